"""How long one call takes: the median over several samples, each a timed run of a few calls (after one
untimed warm-up call). Shared by the probes that choose a kernel (`runtime.row_norm`, `runtime.one_query`) and
the kernel benchmark (`bench/native_kernels.py`)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(run: Callable[[], object], calls: int, samples: int, per_call: int = 1) -> float:
    """Median seconds of one unit of work: `samples` timings of `calls` runs of `run`, each run doing `per_call`
    units (e.g. one run reads several cold copies of a weight in turn)."""
    run()
    timings = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        timings.append((time.perf_counter() - start) / (calls * per_call))
    return statistics.median(timings)
