"""Fuzz harness: seeded random runs with random faults; no run may hang or fail unnamed.

Each run draws a strategy (dpsgd/adpsgd), a world size, a launcher (Lightning's or torchrun),
the topology or pairing, overlap / delay-by-one / max_staleness, the wire dtype (fp32 or bf16),
hierarchical dpsgd on 2 nodes x 2 (world 4, torchrun ``--nnodes 2``), the heartbeat timeout
(30 or 60 s: a loaded machine must not make a live rank look silent), random per-step delays
and a slow rank, a dataset size that does not split evenly over the ranks, validation,
checkpointing, stock callbacks (``max_time``, early stopping) and a fault: none, an exception,
NaN weights, SIGSTOP or SIGKILL of a random rank at a random step. It runs
``tests/scripts/fault_cases.py`` (one fit per launch) and judges the outcome:

* ``ok``: no fault fired, every rank finished and the final replicas are equal;
* ``named``: a fault fired and every surviving rank exited non-zero within
  ``heartbeat_timeout + 30`` s of it (the run's drawn ``heartbeat_timeout``), with at least
  one message naming the faulty rank;
* ``hang`` (the launch hit its limit, ``--limit``: 1800 s by default, so that a run slowed
  down by a loaded machine is not taken for a hang; hangs after a fault show as ``slow``),
  ``orphan`` (a rank outlived its launcher by 15 s),
  ``unnamed`` (a failure whose messages do not name the faulty rank), ``slow`` (failed, but
  later than ``heartbeat_timeout + 30`` s), ``wrong`` (no fault, but failed or replicas differ),
  ``bad-checkpoint`` (a checkpoint that does not load).

Usage::

    python -m testbed.fuzz --runs 200 --seed 0 --out benchmarks/results/fuzz.json
    python -m testbed.fuzz --runs 10 --seed 1 --max-world 3   # what `make test` runs

It prints a table of outcomes and writes every run's spec and verdict as JSON. With ``--out
X.json`` each run is also appended to ``X.jsonl`` as soon as it is judged (and ``X.json`` is
rewritten), so an interrupted campaign keeps its results; running the same command again
skips the runs already in ``X.jsonl`` (same ``--seed`` and ``--max-world``) and goes on.
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
import threading
import time
from pathlib import Path
from typing import Any

from testbed.launch import (
    Launched,
    base_env,
    descendants,
    free_port,
    launch_processes,
    signal_all,
    torchrun_command,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fault_cases.py"
HEARTBEAT_CHOICES = (30.0, 60.0)  # seconds; tolerant of a loaded machine (see the docstring)
JUDGE_MARGIN_S = 30.0  # every rank ends within heartbeat_timeout + this after the fault
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
        "epochs": epochs, "timeout": 600,
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
    # drawn after the draws above, so that the earlier choices of a seed stay what they were
    spec["heartbeat_timeout"] = rng.choice(HEARTBEAT_CHOICES)
    if rng.random() < 1 / 3:
        kwargs["wire_dtype"] = "bf16"
    if strategy == "dpsgd" and world == 4 and rng.random() < 0.6:
        # 2 nodes x 2 ranks (torchrun --nnodes 2): hierarchical D-PSGD between the nodes
        kwargs["hierarchical"] = True
        spec["launcher"], spec["nodes"] = "torchrun", 2
    return spec


class StarvationClock:
    """Seconds this process was kept from running, as a step function of wall time.

    A probe thread of the harness sleeps ``tick`` seconds, then computes for ``spin`` seconds
    of wall time and measures the CPU time it got: the share of a CPU a runnable thread of this
    priority gets now. Each tick adds ``(1 - share)`` of its wall time to :attr:`starved`.
    (Sleeping threads are woken at once even under heavy load; threads that compute are not:
    hence a probe that computes.) The probe costs ``spin / tick`` of a CPU (2 %) at most.

    Run at a low priority (``nice -n 19``) on a machine busy with higher-priority work, the
    harness and the ranks it starts (same priority) may get almost no CPU for long stretches;
    those seconds are not counted against a run: the launch limit (``hang``) and the time from
    the fault to the last exit (``slow``) are measured on wall time minus starved time.
    """

    def __init__(self, tick: float = 2.0, spin: float = 0.04) -> None:
        self.tick, self.spin = tick, spin
        self.starved = 0.0
        self.samples: list[tuple[float, float]] = [(time.time(), 0.0)]  # (wall, starved)
        threading.Thread(target=self._run, daemon=True, name="fuzz-starvation-clock").start()

    def share(self) -> float:
        """Compute for ``spin`` s of wall time; the CPU share obtained (0..1)."""
        wall0, cpu0 = time.monotonic(), time.thread_time()
        x = 0
        while time.monotonic() - wall0 < self.spin:
            x += 1
        wall = time.monotonic() - wall0
        return min(1.0, (time.thread_time() - cpu0) / wall) if wall > 0 else 1.0

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(self.tick)
            share = self.share()
            now = time.monotonic()
            lost = (now - last) * (1.0 - share)
            last = now
            if share < 0.9:
                self.starved += lost
                self.samples.append((time.time(), self.starved))

    def at(self, wall: float) -> float:
        """Starved seconds up to wall time ``wall`` (``time.time()``)."""
        value = 0.0
        for t, v in self.samples:
            if t > wall:
                break
            value = v
        return value


_clock: StarvationClock | None = None


def starvation_clock() -> StarvationClock:
    """The process's :class:`StarvationClock` (started on first use)."""
    global _clock
    if _clock is None:
        _clock = StarvationClock()
    return _clock


FROZEN_GRACE_S = 5.0
"""Seconds a launch whose only live processes are stopped (SIGSTOP) is left before they are
killed: nothing else can end it."""


def _launch(commands: list, limit_s: float) -> tuple[Launched, bool]:
    """:func:`launch_processes` with a limit of ``limit_s`` seconds not counting starved time
    (``(launched, timed_out)``). At the limit every process of the launch gets ``SIGABRT``
    (faulthandler prints its stacks), then ``SIGKILL``. A launch of which only frozen
    processes are left is ended after :data:`FROZEN_GRACE_S` (not a time-out)."""
    clock = starvation_clock()
    box: dict[str, Launched] = {}
    # launch_processes' own limit is only a backstop (20x: a machine starved that much)
    thread = threading.Thread(
        target=lambda: box.update(launched=launch_processes(commands, 20 * limit_s)),
        daemon=True)
    t0, s0 = time.time(), clock.starved
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if main and previous is signal.SIG_DFL:  # SIGTERM of the harness: kill the launch first

        def raise_exit(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, raise_exit)
    timed_out = False
    frozen_since: float | None = None
    try:
        thread.start()
        while thread.is_alive():
            thread.join(1.0)
            # A frozen rank that is also the launcher (rank 0 under Lightning's launcher) cannot
            # end the launch: once only stopped processes are left, the others all ended
            if thread.is_alive() and _only_frozen_left(descendants(os.getpid())):
                frozen_since = frozen_since or time.monotonic()
                if time.monotonic() - frozen_since > FROZEN_GRACE_S:
                    signal_all(descendants(os.getpid()), signal.SIGKILL)
                    thread.join()
                    break
            else:
                frozen_since = None
            if thread.is_alive() and time.time() - t0 - (clock.starved - s0) > limit_s:
                timed_out = True
                for pid in descendants(os.getpid()):
                    signal_all([pid], signal.SIGABRT)
                    time.sleep(0.3)
                thread.join(10.0)
                signal_all(descendants(os.getpid()), signal.SIGKILL)
                thread.join()
    except BaseException:
        signal_all(descendants(os.getpid()), signal.SIGKILL)
        raise
    finally:
        if main and previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    launched = box["launched"]
    return launched, timed_out or launched.timed_out


def _state(pid: int) -> str | None:
    """The process state letter of ``/proc/PID/stat`` (``None``: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _only_frozen_left(pids: list[int]) -> bool:
    """Whether every live process among ``pids`` is stopped (SIGSTOP: state ``T``)."""
    states = [_state(p) for p in pids]
    live = [st for st in states if st not in (None, "Z")]
    return bool(live) and all(st in ("T", "t") for st in live)


def run_one(spec: dict[str, Any], work: Path, limit_s: float = 600) -> dict[str, Any]:
    """Launch one run; return what happened (events, survivors, time-out, checkpoints)."""
    work.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, out=str(work))
    if spec.pop("checkpoint", False):
        spec["checkpoint_dir"] = str(work / "ckpt")
    path = work / "spec.json"
    world, nodes = spec["devices"], spec.get("nodes", 1)
    path.write_text(json.dumps(dict(spec, devices=world // nodes)))  # Trainer(devices=)
    if spec["launcher"] == "lightning":
        commands = [([sys.executable, str(SCRIPT), str(path)],
                     base_env(MASTER_PORT=str(free_port())))]
    elif nodes == 1:
        commands = [(torchrun_command(SCRIPT, str(path), nprocs=world, port=free_port()),
                     base_env())]
    else:  # one torchrun per node, each running this file as the rank script (--rank-script)
        port = free_port()
        commands = [(torchrun_command("testbed.fuzz", "--rank-script", str(path),
                                      nprocs=world // nodes, nnodes=nodes, node_rank=k,
                                      port=port), base_env()) for k in range(nodes)]
    t0 = time.time()
    launched, timed_out = _launch(commands, limit_s)
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
    clock = starvation_clock()
    fired = [e["time"] for e in events if e["event"] == "fault"]
    last = max([e["time"] for e in events if e["event"] in ("error", "exit")], default=ended)
    return {"events": events, "survivors": survivors, "timed_out": timed_out,
            "returncode": launched.returncode, "seconds": ended - t0, "bad_ckpt": bad_ckpt,
            "starved_s": clock.at(ended) - clock.at(t0),
            # starved seconds between the fault and the last rank's end (see judge)
            "starved_after_fault_s": clock.at(last) - clock.at(fired[0]) if fired else 0.0,
            "tail": launched.stdout[-3000:]}


def _rank_script(spec_path: str) -> None:
    """Run ``fault_cases.py`` as one rank of a multi-node torchrun launch.

    ``fault_cases.py`` builds its ``Trainer`` without ``num_nodes``; here it is given the
    number of nodes torchrun started (``GROUP_WORLD_SIZE``) so that Lightning accepts the
    world size (``devices`` in the spec is per node).
    """
    import runpy

    import lightning.pytorch as pl

    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    init = pl.Trainer.__init__

    def init_with_nodes(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("num_nodes", nodes)
        init(self, *args, **kwargs)

    pl.Trainer.__init__ = init_with_nodes  # type: ignore[method-assign]
    sys.argv = [str(SCRIPT), spec_path]
    runpy.run_path(str(SCRIPT), run_name="__main__")


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
    after = last - fault["time"] - result.get("starved_after_fault_s", 0.0)
    if after > spec["heartbeat_timeout"] + JUDGE_MARGIN_S:
        return "slow", (f"last rank ended {last - fault['time']:.0f} s after the fault "
                        f"({after:.0f} s not counting starved time)")
    return "named", f"{fault['kind']} on rank {culprit}, ended after {after:.1f} s"


def _load_done(jsonl: Path, seed: int, max_world: int) -> dict[int, dict[str, Any]]:
    """The rows of ``jsonl`` (written by an earlier, maybe interrupted, run of the same
    campaign: same ``seed`` and ``max_world``), by run index; a torn last line is ignored."""
    done: dict[int, dict[str, Any]] = {}
    if not jsonl.exists():
        return done
    for line in jsonl.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("seed") == seed and row.get("max_world") == max_world:
            done[row["run"]] = row
    return done


def _summary(seed: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return {"seed": seed, "runs": rows, "counts": counts}


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; print a table; write JSON. Exit status 1 on any bad verdict."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-script"]:  # one rank of a multi-node launch (see run_one)
        _rank_script(argv[1])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-world", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the results (and X.jsonl next to it, per run)")
    parser.add_argument("--limit", type=float, default=1800, help="seconds per launch")
    args = parser.parse_args(argv)
    jsonl = args.out.with_suffix(".jsonl") if args.out is not None else None
    done = _load_done(jsonl, args.seed, args.max_world) if jsonl is not None else {}
    if done:
        print(f"resuming: {len(done)} runs already in {jsonl}", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lg-fuzz-") as tmp:
        for i in range(args.runs):
            if i in done:
                rows.append(done[i])
                continue
            spec = draw(args.seed, i, args.max_world)
            load = os.getloadavg()[0]
            result = run_one(spec, Path(tmp) / f"run{i}", args.limit)
            verdict, detail = judge(spec, result)
            fault = spec.get("fault", {})
            row = {"run": i, "seed": args.seed, "max_world": args.max_world,
                   "verdict": verdict, "detail": detail, "spec": spec,
                   "seconds": round(result["seconds"], 1), "load": round(load, 1),
                   "starved_s": round(result["starved_s"], 1)}
            if verdict not in GOOD:
                row["tail"] = result["tail"]
            rows.append(row)
            print(f"{i:4d} {verdict:8s} {spec['strategy']:6s} n={spec['devices']} "
                  f"{spec['launcher']:9s} fault={fault.get('kind', 'none'):7s} "
                  f"{result['seconds']:6.1f}s  {detail[:60]}", flush=True)
            if args.out is not None and jsonl is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                args.out.write_text(json.dumps(_summary(args.seed, rows), indent=1))
    summary = _summary(args.seed, rows)
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["counts"].items())))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    return 0 if all(r["verdict"] in GOOD for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
