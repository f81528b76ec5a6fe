"""What the engine is built from, either side's: its configs, presets and windows, and what a preset needs of
a device (`python -m engine info`).
"""
