"""A caller's audio on its way in: from the rtc runtime into the engine's ring (natively,
agent/audio_in/native, or through livekit-agents' room input), and the patches to the rtc SDK and the
framework that the rooms of one worker process need.

Runs in: a room's process (the FFI client and its queue in the worker's too). May import: what `agent/`
may.

Each patch reaches into a private part of one version of the SDK, the versions named here (and pinned in
constraints.txt, which tests/test_sdk_versions.py holds to these); a new version means reading each again:

- agent/audio_in/rtc_ffi.py: the SDK's FFI client, created once under a lock, and its event queue replaced
  by one that routes each event to the room that owns it (`FfiClient`, `FfiQueue`, `AudioStream._run`);
- agent/audio_in/rtc_emit.py: `rtc.EventEmitter.emit` without a signature inspected per event;
- agent/audio_in/audio_pump.py: a native callback in front of the SDK's, and captures made and answered
  natively (the FFI's protobuf requests, the library's callback);
- agent/audio_in/caller_input.py: livekit-agents' room input, whose private `_ParticipantAudioInputStream`
  hands its tracks to the native stream.

Outside this folder, two more lean on the framework's private parts: agent/worker.py (`AgentServer`'s
availability, `_get_effective_load`) and agent/audio_out/sinks.py (the room's `disconnect`, wrapped).
"""

LIVEKIT = "1.1.21"  # the rtc SDK (`livekit`)
LIVEKIT_AGENTS = "1.8.9"  # the framework (`livekit-agents`)
