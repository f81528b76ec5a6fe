"""Phone calls through LiveKit's SIP bridge: the caller's line, transfers and hang-ups, and the SIP trunk's
setup.
"""
