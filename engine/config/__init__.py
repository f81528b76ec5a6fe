"""What the engine is built from, in plain data: each stage's config, the engine's, the presets, dtype
policies and context windows. Free of torch: a room's process reads them too.

Runs in: either side. May import: nothing of `engine/` but itself; never torch.
Imported by: `engine.__main__`, `engine.api`, `engine.client`, `engine.door`, `engine.memory`, `engine.model`,
`engine.observe`, `engine.sizing`, `engine.text`, `engine.tick` and `agent`.
"""
