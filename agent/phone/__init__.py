"""Phone calls through LiveKit's SIP bridge: the caller's line, transfers and hang-ups, and the SIP trunk's
setup (`python -m agent sip setup`).

Runs in: a room's process (and the command line's). May import: what `agent/` may.
"""
