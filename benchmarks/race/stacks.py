"""Where a race rank's time goes: py-spy's collapsed stacks summed into categories.

Record a rank of a running race (its pid: ``pgrep -f 'benchmarks.race.worker <workdir>/spec.json'``;
``--keep-logs`` keeps the workdir) with py-spy, every thread, idle samples included (waits are
what this is for), without pausing the process::

    py-spy record --pid PID --rate 20 --nonblocking --threads --idle --format raw \\
        --duration 45 --output rank0.txt
    python -m benchmarks.race.stacks rank0.txt [rank1.txt ...] [--rate 20] [--json out.json]

Each sample of a thread counts ``1 / rate`` seconds; a stack is put in the first category (in the
order of :data:`CATEGORIES`) one of whose markers is in it, so a wait inside the node's gradient
all-reduce counts there and not as backward. ``eval`` is the race's validation (off its clock).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("eval (off the clock)", ("RaceMeter.evaluate", "RaceMeter._validate", "validation_metric")),
    ("adpsgd: phase end (quiesce)", ("AsyncGossip.quiesce",)),
    ("adpsgd: epoch-end meeting (waiting for every rank)", ("Phases.meet",)),
    ("adpsgd: node all-gather of slice deltas", ("NodeAverager.all_gather",)),
    ("adpsgd: add the gathered delta", ("AsyncGossip._apply_gathered",)),
    ("adpsgd: staleness wait", ("SharedState.wait_for",)),
    ("adpsgd: rest of after_step", ("AsyncGossip.after_step",)),
    ("adpsgd: phase begin", ("AsyncGossip.before_step",)),
    ("dpsgd: gossip (waits and mixing)", ("SyncGossip", "lightning_gossip/sync_gossip")),
    ("node gradient all-reduce", ("NodeAverager.average_gradients",)),
    ("node buffer all-reduce", ("NodeAverager.average_buffers",)),
    ("shared cursor claims (store)", ("Claims.next",)),
    ("race meter (the slow node's sleep)", ("on_train_batch_end (benchmarks/race/worker",
                                            "on_train_batch_end (worker")),
    ("backward", ("backward",)),
    ("forward", ("training_step", "_loss")),
    ("optimizer", ("Adam", "adamw", "Optimizer.step", "clip_grad")),
    ("data", ("_next_data", "fetch", "collate")),
]
"""(category, markers): the first category with a marker in the stack wins."""


def categorise(stack: str) -> str:
    """The category of one collapsed stack (``frame;frame;...``)."""
    return next((name for name, keys in CATEGORIES if any(k in stack for k in keys)), "other")


def summarise(path: Path, rate: float) -> dict[str, dict[str, float]]:
    """Seconds per category of each thread (names without their numeric suffix)."""
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread = re.sub(r"^thread \(\d+\): ", "", stack.split(";")[0])
        thread = re.sub(r"-\d+$", "", thread)
        per[thread][categorise(stack)] += int(count) / rate
    return {t: dict(c.most_common()) for t, c in per.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="py-spy raw outputs, one per rank")
    p.add_argument("--rate", type=float, default=20.0, help="py-spy's --rate")
    p.add_argument("--json", type=Path, default=None, help="write the summaries here")
    args = p.parse_args()
    out = {}
    for path in args.files:
        threads = summarise(path, args.rate)
        out[f"{path.parent.name}/{path.name}"] = threads
        main_thread = threads.get("MainThread", {})
        total = sum(main_thread.values())
        train = total - main_thread.get("eval (off the clock)", 0.0)
        print(f"== {path.name}: training thread {total:.1f} s, {train:.1f} s of it training")
        for cat, s in main_thread.items():
            share = "" if cat.startswith("eval") else f"{100 * s / train:5.1f} %"
            print(f"   {s:6.1f} s {share:>8}  {cat}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
