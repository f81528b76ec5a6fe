"""The simulation (`python -m agent simulate`, `make run`): virtual rooms on an engine of the simulation's
own, and its report.
"""
