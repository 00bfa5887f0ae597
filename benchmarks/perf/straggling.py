"""A straggler experiment, shared by ``straggler.py`` and ``asr_straggler.py``: the sleep that
makes one rank slower, and the throughput of one fit over all ranks.

Standard library at import (the drivers use :func:`fit_throughput`); torch only inside
:func:`calibrated_sleep`, which the ranks call.
"""

from __future__ import annotations

import statistics
from typing import Any


def calibrated_sleep(local_step_s: float, slow_rank: int, slowdown: float) -> tuple[float, float]:
    """``(local step, sleep)``: ``slow_rank``'s calibrated local step time (broadcast to
    every rank) and the sleep per step, ``(slowdown - 1) x`` that, that makes its steps take
    about ``slowdown`` times as long. A collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    local_step = torch.tensor([local_step_s], dtype=torch.float64)
    dist.broadcast(local_step, src=slow_rank)
    step = float(local_step.item())
    return step, (slowdown - 1.0) * step


def fit_throughput(per: list[dict[str, Any]], slow_rank: int) -> dict[str, Any]:
    """One fit over all ranks (each rank's ``ThroughputMeter.window()``): samples, wall time
    from the earliest start to the latest end, samples/s, steps and median step per rank, and
    how much slower the straggler's steps really were than the others' (medians)."""
    wall = max(p["t_end"] for p in per) - min(p["t_start"] for p in per)
    samples = sum(p["samples"] for p in per)
    steps = [p["median_step_s"] for p in per]
    others = [t for r, t in enumerate(steps) if r != slow_rank]
    return {
        "samples": samples, "wall_s": wall, "samples_per_s": samples / wall,
        "steps_per_rank": [p["steps"] for p in per],
        "median_step_s_per_rank": steps,
        "straggler_step_ratio": (steps[slow_rank] / float(statistics.median(others))
                                 if others else 1.0),
    }
