"""Percentiles of a benchmark's timings, as its JSON reports them (rounded to 0.1). Knows nothing of what was
timed."""

from __future__ import annotations

import numpy as np


def percentiles(values: list[float]) -> dict:
    """p50, p99 and the largest of `values` (None each when there are none)."""
    if not values:
        return {"p50": None, "p99": None, "max": None}
    v = np.asarray(values, dtype=np.float64)
    return {
        "p50": round(float(np.percentile(v, 50)), 1),
        "p99": round(float(np.percentile(v, 99)), 1),
        "max": round(float(v.max()), 1),
    }
