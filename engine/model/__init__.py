"""The model's stages, one per file: perception, thinker, talker, codec; plus weight loading."""
