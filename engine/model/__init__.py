"""The model's stages, one per file: perception, thinker, talker, codec; the pipeline; weights and
checkpoints.

Runs in: the engine's process (and on the meta device wherever a preset is sized). May import:
`engine.kernels`, `engine.config`, `engine.text`.
Imported by: `engine.memory`, `engine.sizing` and `engine.tick`.
"""
