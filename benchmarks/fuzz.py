"""Fuzz harness: seeded random runs with random faults; no run may hang or fail unnamed.

Each run draws a strategy (dpsgd/adpsgd), a world size, a launcher (Lightning's or torchrun),
the topology or pairing, overlap / delay-by-one / max_staleness, random per-step delays and a
slow rank, a dataset size that does not split evenly over the ranks, validation, checkpointing,
stock callbacks (``max_time``, early stopping) and a fault: none, an exception, NaN weights,
SIGSTOP or SIGKILL of a random rank at a random step. It runs
``tests/scripts/fault_cases.py`` (one fit per launch) and judges the outcome:

* ``ok``: no fault fired, every rank finished and the final replicas are equal;
* ``named``: a fault fired and every surviving rank exited non-zero within
  ``heartbeat_timeout + 30`` s of it, with at least one message naming the faulty rank;
* ``hang`` (the launch hit its limit), ``orphan`` (a rank outlived its launcher by 15 s),
  ``unnamed`` (a failure whose messages do not name the faulty rank), ``slow`` (failed, but
  later than ``heartbeat_timeout + 30`` s), ``wrong`` (no fault, but failed or replicas differ),
  ``bad-checkpoint`` (a checkpoint that does not load).

Usage::

    python benchmarks/fuzz.py --runs 200 --seed 0 --out benchmarks/results/fuzz.json
    python benchmarks/fuzz.py --runs 10 --seed 1 --max-world 3   # what `make test` runs

It prints a table of outcomes and writes every run's spec and verdict as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the launcher is shared with the tests
    sys.path.insert(0, str(ROOT))

from tests.launch import base_env, free_port, launch_processes, torchrun_command  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "fault_cases.py"
HEARTBEAT_S = 5.0
GOOD = ("ok", "named")

__all__ = ["draw", "judge", "main", "run_one"]


def draw(seed: int, index: int, max_world: int = 5) -> dict[str, Any]:
    """The spec of run ``index`` of a fuzz campaign with ``seed`` (deterministic)."""
    rng = random.Random(seed * 1_000_003 + index)
    strategy = rng.choice(["dpsgd", "adpsgd"])
    world = rng.randint(2, max_world)
    kwargs: dict[str, Any]
    if strategy == "dpsgd":
        kwargs = {"topology": rng.choice(["ring", "random_ring", "exponential", "complete"]),
                  "overlap": rng.random() < 0.5, "delay_by_one": rng.random() < 0.3,
                  "seed": rng.randrange(10)}
    else:
        kwargs = {"pairing": rng.choice(["ring", "random"]),
                  "max_staleness": rng.choice([None, 0, 2, 4]),
                  "delay_by_one": rng.random() < 0.3, "seed": rng.randrange(10)}
    samples = rng.randint(10 * world, 60 * world) | 1  # odd: never splits evenly
    steps_per_rank = samples // (4 * world)
    epochs = rng.randint(1, 3)
    val = rng.random() < 0.4
    spec: dict[str, Any] = {
        "strategy": strategy, "devices": world, "strategy_kwargs": kwargs,
        "launcher": rng.choice(["lightning", "torchrun"]), "samples": samples,
        "epochs": epochs, "heartbeat_timeout": HEARTBEAT_S, "timeout": 600,
        "delay_ms": rng.choice([0, 0, 5, 20]), "seed": index,
        "val_batches": 2 if val else 0,
    }
    if rng.random() < 0.3:
        spec["slow_rank"], spec["slow_s"] = rng.randrange(world), rng.choice([0.02, 0.1])
    if rng.random() < 0.2:
        spec["max_time"] = f"00:00:00:{rng.randint(5, 15):02d}"
    if val and rng.random() < 0.5:
        spec["early_stopping"] = True
    if rng.random() < 0.3:
        spec["checkpoint"] = True
    kind = rng.choice(["none", "none", "raise", "nan", "freeze", "sigkill"])
    if kind != "none":
        spec["fault"] = {"kind": kind, "rank": rng.randrange(world),
                         "step": rng.randint(1, max(1, steps_per_rank * epochs - 1))}
    return spec


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_one(spec: dict[str, Any], work: Path, limit_s: float = 600) -> dict[str, Any]:
    """Launch one run; return what happened (events, survivors, time-out, checkpoints)."""
    work.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, out=str(work))
    if spec.pop("checkpoint", False):
        spec["checkpoint_dir"] = str(work / "ckpt")
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    world = spec["devices"]
    if spec["launcher"] == "lightning":
        cmd = [sys.executable, str(SCRIPT), str(path)]
        env = base_env(MASTER_PORT=str(free_port()))
    else:
        cmd = torchrun_command(SCRIPT, str(path), nprocs=world, port=free_port())
        env = base_env()
    t0 = time.time()
    launched = launch_processes([(cmd, env)], limit_s)
    ended = time.time()
    events: list[dict] = []
    decoder = json.JSONDecoder()
    for piece in launched.stdout.split("EVENT ")[1:]:  # two ranks' lines may share a line
        try:
            events.append(decoder.raw_decode(piece)[0])
        except json.JSONDecodeError:
            pass
    pids = [int(p.read_text()) for p in work.glob("pid*")]
    frozen = {e["rank"] for e in events if e["event"] == "fault" and e.get("kind") == "freeze"}
    frozen_pids = {int((work / f"pid{r}").read_text()) for r in frozen
                   if (work / f"pid{r}").exists()}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids if p not in frozen_pids):
        time.sleep(0.2)
    survivors = [p for p in pids if p not in frozen_pids and _alive(p)]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    bad_ckpt = []
    for ckpt in (work / "ckpt").glob("*.ckpt") if (work / "ckpt").exists() else []:
        try:
            import torch

            torch.load(ckpt, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - reported
            bad_ckpt.append(f"{ckpt.name}: {e}")
    return {"events": events, "survivors": survivors, "timed_out": launched.timed_out,
            "returncode": launched.returncode, "seconds": ended - t0, "bad_ckpt": bad_ckpt,
            "tail": launched.stdout[-3000:]}


def judge(spec: dict[str, Any], result: dict[str, Any]) -> tuple[str, str]:
    """``(verdict, detail)`` of one run (see the module docstring)."""
    if result["timed_out"]:
        return "hang", "the launch hit its time limit"
    if result["survivors"]:
        return "orphan", f"pids {result['survivors']} outlived the launcher"
    if result["bad_ckpt"]:
        return "bad-checkpoint", "; ".join(result["bad_ckpt"])
    events = result["events"]
    fired = [e for e in events if e["event"] == "fault"]
    done = {e["rank"]: e for e in events if e["event"] == "done"}
    errors = [e for e in events if e["event"] == "error"]
    if not fired:
        if result["returncode"] != 0 or len(done) != spec["devices"]:
            return "wrong", f"no fault, exit {result['returncode']}, {len(done)} ranks done"
        sums = [d["checksum"] for d in done.values()]
        if not all(math.isfinite(x) for x in sums) or max(sums) - min(sums) > 1e-4 * max(
                1.0, abs(sums[0])):
            return "wrong", f"final replicas differ or are not finite: {sums}"
        return "ok", f"{len(done)} ranks done"
    fault = fired[0]
    culprit = fault["rank"]
    if len(done) == spec["devices"] and result["returncode"] == 0:
        sums = [d["checksum"] for d in done.values()]
        if not all(math.isfinite(x) for x in sums) or max(sums) - min(sums) > 1e-4 * max(
                1.0, abs(sums[0])):
            return "wrong", f"completed after a {fault.get('kind')} with replicas {sums}"
        return "ok", "the fault fired but the run completed"  # e.g. a freeze after the end
    names = (f"rank {culprit}", f"rank(s) {culprit}", f"ranks [{culprit}", f" {culprit}]",
             f"rank {culprit}:")
    named = [e for e in errors if e["rank"] != culprit and any(n in e["message"] for n in names)]
    own = [e for e in errors if e["rank"] == culprit]  # the culprit's own error names itself
    if not named and not own and fault.get("kind") != "sigkill":
        return "unnamed", "; ".join(e["message"][:200] for e in errors) or "no error message"
    if not named and fault.get("kind") in ("freeze", "sigkill") and errors:
        return "unnamed", "; ".join(e["message"][:200] for e in errors)
    last = max([e["time"] for e in events if e["event"] in ("error", "exit")],
               default=fault["time"])
    if last - fault["time"] > HEARTBEAT_S + 30:
        return "slow", f"last rank ended {last - fault['time']:.0f} s after the fault"
    return "named", f"{fault['kind']} on rank {culprit}, ended after {last - fault['time']:.1f} s"


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; print a table; write JSON. Exit status 1 on any bad verdict."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-world", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    parser.add_argument("--limit", type=float, default=600, help="seconds per launch")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lg-fuzz-") as tmp:
        for i in range(args.runs):
            spec = draw(args.seed, i, args.max_world)
            result = run_one(spec, Path(tmp) / f"run{i}", args.limit)
            verdict, detail = judge(spec, result)
            fault = spec.get("fault", {})
            row = {"run": i, "verdict": verdict, "detail": detail, "spec": spec,
                   "seconds": round(result["seconds"], 1)}
            if verdict not in GOOD:
                row["tail"] = result["tail"]
            rows.append(row)
            print(f"{i:4d} {verdict:8s} {spec['strategy']:6s} n={spec['devices']} "
                  f"{spec['launcher']:9s} fault={fault.get('kind', 'none'):7s} "
                  f"{result['seconds']:6.1f}s  {detail[:60]}", flush=True)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"seed": args.seed, "runs": rows, "counts": counts},
                                       indent=1))
    return 0 if all(r["verdict"] in GOOD for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
