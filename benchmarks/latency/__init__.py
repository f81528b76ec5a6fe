"""The parts of the echo-latency benchmark (`python -m benchmarks.livekit_latency`, whose docstring says what
is measured and how): the callers that send bursts and record their echo (caller.py), the matching of each
burst's times across the caller and the engine (timing.py), and one measured session of callers on a worker
(session.py). The figures and the command line are livekit_latency.py's.
"""
