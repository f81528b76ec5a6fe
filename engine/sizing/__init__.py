"""What the engine is built from: its configs, presets and windows, and what a preset needs of a device
(`python -m engine info`).

Runs in: either side (the configs in a room's process too; the sizing that builds the model on the meta
device in the engine's and the worker's). May import: any of `engine/`.
Imported by: `engine.__main__`, `engine.api`, `engine.client`, `engine.door`, `engine.model`,
`engine.observe`, `engine.text`, `engine.tick` and `agent`.
"""
