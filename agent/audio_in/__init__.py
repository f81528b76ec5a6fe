"""A caller's audio on its way in: from the rtc runtime into the engine's ring (natively,
agent/audio_in/native, or through livekit-agents' room input), and the rtc SDK's patches that route its
events to the room that owns them.
"""
