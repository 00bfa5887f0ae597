"""Flat storage vs per-tensor copies: the three ``FlatState`` operations of a gossip step.

``pack`` (the snapshot), ``add_`` (applying a delta) and ``copy_`` (installing an average), each
timed on one thread (median of ``--repeats``), for two models: the 10.5M-parameter MLP of
``step_time.py`` (8 tensors) and a model of 600 small tensors (100 x Linear(128, 128) +
BatchNorm1d, the tensor count of a ResNet-50). "plain" leaves the tensors where PyTorch put them;
"flat" first calls :func:`lightning_gossip.flat.flatten_module_`, as the gossip strategies do at
set-up.

``--boundary`` times instead the training thread's share of an AD-PSGD step boundary
(``AsyncGossip.after_step`` without its lock and waits: ``DeltaMailbox.apply_due``, then
``leave_snapshot``) on the flat MLP, with and without ``delay_by_one``, one exchange posted
between two boundaries (the gossip thread's ``take_snapshot`` and ``post_delta``, not timed).
For scale it also times one ``pack`` and one ``add_``: issue #11 asks for at most their sum.

    python -m benchmarks.perf.flat_ops --out benchmarks/results/flat_ops.json
    python -m benchmarks.perf.flat_ops --boundary
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import workloads
from lightning_gossip.flat import FlatState, flatten_module_

OPS = ("pack", "add_", "copy_")


def mlp() -> nn.Module:
    """The MLP of ``step_time.py``: 1024 -> 2048 -> 2048 -> 2048 -> 10 (10.5M parameters)."""
    torch.manual_seed(0)
    return workloads.mlp([1024, 2048, 2048, 2048, 10])


def many_small() -> nn.Module:
    """100 x (Linear(128, 128) + BatchNorm1d(128)): 600 mixed tensors, 1.7M values."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(100)
                           for m in (nn.Linear(128, 128), nn.BatchNorm1d(128))])


def time_ops(state: FlatState, repeats: int) -> dict[str, float]:
    """Median milliseconds of each operation on ``state``."""
    out = torch.empty(state.numel)
    delta = torch.randn(state.numel) * 1e-3
    calls: dict[str, Callable[[], object]] = {
        "pack": lambda: state.pack(out=out),
        "add_": lambda: state.add_(delta),
        "copy_": lambda: state.copy_(out),
    }
    times: dict[str, list[float]] = {op: [] for op in OPS}
    for _ in range(repeats):
        for op in OPS:
            t0 = time.perf_counter()
            calls[op]()
            times[op].append((time.perf_counter() - t0) * 1e3)
    return {op: statistics.median(v) for op, v in times.items()}


def time_boundary(delay_by_one: bool, repeats: int, warmup: int = 5) -> float:
    """Median milliseconds of one step boundary of the training thread (flat MLP)."""
    from lightning_gossip.async_gossip.mailbox import DeltaMailbox

    model = mlp()
    flatten_module_(model)
    box = DeltaMailbox(FlatState(model), delay_by_one=delay_by_one)
    box.reset(0)
    delta = torch.randn(box.hi - box.lo) * 1e-6
    times = []
    for step in range(1, warmup + repeats + 1):
        covered = box.take_snapshot()  # the gossip thread: one exchange per step
        box.post_delta(delta, covered)
        t0 = time.perf_counter()
        if box.due_now():  # AsyncGossip.after_step, under its lock
            box.apply_due()
        if not box.fresh_ready:
            box.leave_snapshot(step)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[warmup:])


def boundary(repeats: int) -> dict[str, float]:
    """The ``--boundary`` section: print and return milliseconds per operation."""
    model = mlp()
    flatten_module_(model)
    state = FlatState(model)
    ops = time_ops(state, repeats)
    ms = {"pack": ops["pack"], "add_": ops["add_"],
          "after_step": time_boundary(False, repeats),
          "after_step_delay_by_one": time_boundary(True, repeats)}
    print(f"mlp flat ({state.numel} values): " + "  ".join(f"{k} {v:.2f} ms"
                                                          for k, v in ms.items()), flush=True)
    return ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    parser.add_argument("--boundary", action="store_true",
                        help="time the AD-PSGD step boundary instead (see above)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(),
               "torch": torch.__version__, "load": os.getloadavg()[0]}
    if args.boundary:
        ms = boundary(args.repeats)
        if args.out is not None:
            args.out.write_text(json.dumps({"machine": machine, "repeats": args.repeats,
                                            "boundary_ms": ms}, indent=1))
        return 0
    rows = []
    for name, build in (("mlp_10.5M_8_tensors", mlp), ("many_small_600_tensors", many_small)):
        for layout in ("plain", "flat"):
            model = build()
            if layout == "flat":
                flatten_module_(model)
            state = FlatState(model)
            ms = time_ops(state, args.repeats)
            rows.append({"model": name, "layout": layout, "tensors": len(state.tensors),
                         "segments": len(state.segments), "numel": state.numel, "ms": ms})
            print(f"{name:24s} {layout:5s} tensors {len(state.tensors):4d} segments "
                  f"{len(state.segments):4d}  " + "  ".join(f"{op} {ms[op]:.2f} ms" for op in OPS),
                  flush=True)
    for name in dict.fromkeys(r["model"] for r in rows):
        plain, flat = (next(r for r in rows if r["model"] == name and r["layout"] == lay)
                       for lay in ("plain", "flat"))
        print(f"{name}: flat / plain " + "  ".join(
            f"{op} {flat['ms'][op] / plain['ms'][op]:.2f}x" for op in OPS))
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine, "repeats": args.repeats,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
