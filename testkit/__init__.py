"""What the benchmarks and the tests share: the server they run against (server.py), the worker started as a
user starts it (worker.py), callers that are real WebRTC participants (callers.py), phone calls through the
server's SIP machinery (sip.py), readings of the machine and of timings (machine.py, stats.py), and the
concierge conversation the engine's benchmarks and tests open (concierge.py).

The tests import these modules; nothing here imports the tests or pytest, and nothing here decides what a
test holds: a missing server is the caller's to report (a skip in the tests, an exit in the benchmarks).
"""
