"""What a room's process imports to reach the engine: its client, the session's shared-memory link, the wire
codec and the worker's control. No torch.
"""
