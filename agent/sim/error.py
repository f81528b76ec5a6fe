"""The simulation's one error: a bad argument, or an engine that cannot be built or a store that cannot be
opened; one line for the user (`python -m agent simulate` exits 2 with it). Imports nothing, so that a bad
argument is answered before the rooms' modules are loaded.
"""


class SimulateError(Exception):
    """A bad argument or an engine that cannot be built: one line for the user, no traceback."""
