"""Chorus's shared engine: the model, per-slot state and the 80 ms tick, by the process each part runs in.

- `engine/api.py`: the contract the rooms use (`EngineClient`, `SessionPort`, requests, outputs, errors,
  the snapshot); plain data, either side's.
- `engine/client/`: in a room's process and the worker's; `engine/door/`, `engine/tick/`, `engine/observe/`,
  `engine/model/`, `engine/kernels/`: in the engine's process; `engine/transport/`, `engine/config/`,
  `engine/text/`, `engine/process/`: either side's; `engine/sizing/` and `memory.py`: a preset sized with
  torch (`python -m engine info`, the engine's build, the worker's report).

Imports nothing of Chorus's but `redaction/`; knows nothing of LiveKit, rooms or hotels
(tests/test_imports.py).
"""
