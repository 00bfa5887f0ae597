"""Time per training step: dpsgd (blocking, overlapped, delay-by-one) and adpsgd vs Lightning
ddp vs no communication, with and without simulated compute, and the training thread's own
time in gossip.

One run of this script starts N CPU ranks once per world size (torchrun, gloo, one thread per
rank) and times, back to back in the same processes, every case below on the same
~10M-parameter MLP with the same per-rank batch, for every ``--simulated-compute-ms`` value:

* ``solo``           one process alone, no communication (rank 0 trains, the others wait idle);
* ``local_xN``       every rank trains its own replica at the same time, no communication
                     (the same CPU contention as the distributed cases, minus the messages);
* ``ddp``            Lightning's DDPStrategy (bucketed gradient all-reduce overlapped with
                     backward);
* ``dpsgd_blocking`` DPSGDStrategy(overlap=False): exchange after the local step;
* ``dpsgd_overlap``  DPSGDStrategy(overlap=True, the default): exchange posted before
                     forward/backward;
* ``dpsgd_delay1``   DPSGDStrategy(delay_by_one=True): each exchange has a whole step to hide;
* ``adpsgd``         ADPSGDStrategy() (asynchronous pairwise gossip on a background thread);
* ``dpsgd_overlap_bf16`` DPSGDStrategy(wire_dtype="bf16"): overlapped, a compressed wire (the
                     sharded rounds of ``lightning_gossip.sync_gossip.sharded.ShardedExchange``).

Gossip on the training thread: ``time.perf_counter`` around the strategy methods the training
thread runs for gossip in a step (``SyncGossip._start``, ``_apply_delta``,
``_finish_blocking``; ``AsyncGossip.after_step``), wrapped in the worker, summed per step; the
median over the measured steps is reported. The same wrapping works on older versions of the
package, so before/after figures come from this one script.

CPU per thread: at the first and the last measured step every rank reads the CPU time of
each of its threads from ``/proc/self/task`` (``schedstat``, in ns; Linux only), grouped as
``training`` (the main thread), the Python threads by name (``lightning-gossip-comm``: the
thread that finishes dpsgd rounds; adpsgd's gossip thread, the heartbeat) and ``native``
(threads Python does not know: gloo's transport and torch's); reported as CPU ms per step,
averaged over ranks. Where the busy CPU time is larger than the cores, overlap cannot hide it.

Step time = wall time between consecutive ``on_train_batch_end`` calls (data, forward,
backward, optimizer, gossip: everything the user waits for). The first ``--warmup`` steps of
every fit are dropped; the reported figure is the median over the remaining steps (pooled over
``--repeats`` rounds), averaged over ranks. Ratios are to ``solo`` (the issue's baseline) and
to ``local_xN`` (which separates CPU oversubscription from communication cost).

Usage::

    python -m benchmarks.perf.step_time                 # 2 then 4 ranks, 0 and 100 ms compute
    python -m benchmarks.perf.step_time --ranks 4       # only the 4-rank launch
    python -m benchmarks.perf.step_time --quick         # seconds; used by the smoke test
    python -m benchmarks.perf.step_time --simulated-compute-ms 200  # compute that frees the CPU

On a CPU-only machine "communication" (gloo over loopback TCP, the mixing arithmetic) is CPU
work too, so it competes with the forward/backward it is meant to hide behind.
``--simulated-compute-ms`` adds a sleep to every step (an accelerator computing while the CPU
is free), which shows what the overlap buys when there is something to overlap with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import cli_args, harness

CASES = ("solo", "local", "ddp", "dpsgd_blocking", "dpsgd_overlap", "dpsgd_delay1", "adpsgd",
         "dpsgd_overlap_bf16")
DEFAULT_CASES = CASES[1:]
#: the engine methods the training thread runs for gossip, timed per step
GOSSIP_METHODS = {"dpsgd": ("_start", "_apply_delta", "_finish_blocking"),
                  "adpsgd": ("after_step",)}
DEFAULT_OUT = harness.RESULTS_DIR / "step_time.json"


# ----------------------------------------------------------------------------------------------
# Worker side (runs inside every torchrun rank)
# ----------------------------------------------------------------------------------------------
def _param_count(in_features: int, width: int, depth: int, classes: int) -> int:
    """Parameters of the MLP (as ``workloads.mlp_params``, without importing torch)."""
    dims = [in_features] + [width] * depth + [classes]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def _dims(spec: dict[str, Any]) -> list[int]:
    return [spec["in_features"]] + [spec["width"]] * spec["depth"] + [spec["classes"]]


def _strategy(case: str, topology: str) -> Any:
    from benchmarks.common import trainers

    if case == "ddp":
        return trainers.make_strategy("ddp")
    if case == "adpsgd":
        return trainers.make_strategy("adpsgd", consensus_every_n_steps=None, final_average=False)
    return trainers.make_strategy("dpsgd", topology=topology, overlap="blocking" not in case,
                                  delay_by_one=case == "dpsgd_delay1", consensus_every_n_steps=None,
                                  final_average=False,
                                  wire_dtype="bf16" if case.endswith("_bf16") else "fp32")


def _fit(w: harness.Worker, clock: Any, case: str,
         compute_ms: float) -> tuple[list[float], list[float], dict[str, float]]:
    """One fit of ``case``: step times, training-thread gossip time per step, CPU per step."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common import meters, trainers, workloads

    spec = w.spec
    steps_total = spec["warmup"] + spec["steps"]
    n_samples = (steps_total + 1) * spec["batch_size"] * w.world
    skip = max(spec["warmup"] - 1, 0)
    torch.manual_seed(0)
    model = workloads.FixedBatchMLP(_dims(spec), spec["batch_size"], seed=1234 + w.rank,
                                    compute_ms=compute_ms)
    timer = meters.StepTimer(clock=clock, cpu_at=(skip, steps_total - 1))
    options = trainers.trainer_kwargs(w.out, max_steps=steps_total, max_epochs=-1,
                                      callbacks=[timer])
    loader = DataLoader(TensorDataset(torch.arange(n_samples)),
                        batch_size=spec["batch_size"], shuffle=False, drop_last=True)
    if case in ("solo", "local"):
        trainers.fit_alone(model, options, train_dataloaders=loader)
    else:
        trainer = L.Trainer(strategy=_strategy(case, spec["topology"]), devices=w.world,
                            **options)
        trainer.fit(model, loader)
    cpu = (meters.cpu_per_step(*timer.cpu, steps=steps_total - 1 - skip) if len(timer.cpu) == 2
           else {})
    return meters.intervals(timer.ends, skip), meters.intervals(timer.gossip, skip), cpu


def _gossip_clock() -> Any:
    """A clock around the engine methods the training thread runs for gossip."""
    from benchmarks.common import meters
    from lightning_gossip.async_gossip.engine import AsyncGossip

    try:
        from lightning_gossip.sync_gossip.engine import SyncGossip as sync_rounds
    except ImportError:  # before the engine (issue 21) the strategy ran the rounds itself
        from lightning_gossip import DPSGDStrategy as sync_rounds

    clock = meters.GossipClock()
    clock.wrap(sync_rounds, GOSSIP_METHODS["dpsgd"])
    clock.wrap(AsyncGossip, GOSSIP_METHODS["adpsgd"])
    return clock


def _worker(spec_path: Path) -> None:
    import torch.distributed as dist

    clock = _gossip_clock()
    with harness.worker_session(spec_path) as w:
        spec = w.spec
        keys = [f"{case}@{ms:g}" for ms in spec["simulated_compute_ms"] for case in spec["cases"]]
        results: dict[str, list[list[float]]] = {k: [] for k in keys}
        gossip: dict[str, list[list[float]]] = {k: [] for k in keys}
        cpu: dict[str, list[dict[str, float]]] = {k: [] for k in keys}
        for ms in spec["simulated_compute_ms"]:
            for rnd in range(spec["repeats"]):
                for case in spec["cases"]:
                    key = f"{case}@{ms:g}"
                    dist.barrier()
                    harness.progress(f"round {rnd + 1}/{spec['repeats']} {case}, {ms:g} ms compute "
                                     f"({w.world} ranks)")
                    times, in_gossip, per_step = (_fit(w, clock, case, ms)
                                                  if case != "solo" or w.rank == 0
                                                  else ([], [], {}))
                    results[key].append(times)
                    gossip[key].append(in_gossip)
                    cpu[key].append(per_step)
                    dist.barrier()
                    if w.rank == 0 and times:
                        harness.progress(f"  {case}: median step "
                                         f"{harness.median(times) * 1e3:.1f} ms, "
                                         f"gossip on the training thread "
                                         f"{harness.median(in_gossip) * 1e3:.2f} ms")
        w.write({"rank": w.rank, "times": results, "gossip": gossip, "cpu": cpu})


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
def _summarise(ranks: list[dict[str, Any]], cases: list[str], ms: float) -> dict[str, Any]:
    """Per case (at ``ms`` simulated compute): per-rank medians (rounds pooled), their mean,
    per-round spread, and the median training-thread gossip time per step."""
    summary: dict[str, Any] = {}
    for case in cases:
        key = f"{case}@{ms:g}"
        per_rank, per_round, in_gossip, means = [], [], [], []
        for r in ranks:
            rounds = r["times"][key]
            pooled = [t for rnd in rounds for t in rnd]
            if pooled:
                per_rank.append(harness.median(pooled))
                means.append(sum(pooled) / len(pooled))
                in_gossip.append(harness.median([g for rnd in r["gossip"][key] for g in rnd]))
            per_round.append([harness.median(rnd) for rnd in rounds if rnd])
        round_medians = [sum(col) / len(col) for col in zip(*[x for x in per_round if x])]
        readings = [c for r in ranks for c in r.get("cpu", {}).get(key, []) if c]
        groups = sorted({g for c in readings for g in c})
        cpu = {g: sum(c.get(g, 0.0) for c in readings) / len(readings) for g in groups}
        summary[case] = {
            "median_step_s": sum(per_rank) / len(per_rank),
            "per_rank_median_step_s": per_rank,
            "round_median_step_s": round_medians,
            "train_thread_gossip_s": sum(in_gossip) / len(in_gossip),
            "steps_measured_per_rank": len([t for rnd in ranks[0]["times"][key] for t in rnd]),
            "mean_step_s": sum(means) / len(means),
            "cpu_s_per_step": cpu,  # per rank, by thread group (mean over ranks and rounds)
        }
    return summary


def _rows(world: int, summary: dict[str, Any]) -> list[list[Any]]:
    solo = summary.get("solo", {}).get("median_step_s")
    local = summary.get("local", {}).get("median_step_s")
    blocking = summary.get("dpsgd_blocking", {}).get("train_thread_gossip_s")
    rows = []
    for case, s in summary.items():
        name = f"local_x{world}" if case == "local" else case
        t = s["median_step_s"]
        rnd = s["round_median_step_s"]
        spread = f"{min(rnd) * 1e3:.0f}-{max(rnd) * 1e3:.0f}" if len(rnd) > 1 else "-"
        g = s["train_thread_gossip_s"]
        timed = case.startswith(("dpsgd", "adpsgd"))
        rows.append([name, t * 1e3, spread, t / solo if solo else float("nan"),
                     t / local if local else float("nan"), g * 1e3 if timed else "-",
                     g / blocking if timed and blocking else "-"])
    return rows


CPU_HEADERS = ["case", "mean step ms", "training", "lightning-gossip-comm", "native", "other",
               "busy cores"]


def _cpu_rows(world: int, summary: dict[str, Any]) -> list[list[Any]]:
    """CPU ms per step per rank by thread group, and the cores the ranks keep busy."""
    rows = []
    for case, s in summary.items():
        cpu = s.get("cpu_s_per_step") or {}
        if not cpu:
            continue
        main_groups = ("training", "lightning-gossip-comm", "native")
        other = sum(v for g, v in cpu.items() if g not in main_groups)
        ranks = 1 if case == "solo" else world
        busy = sum(cpu.values()) * ranks / s["mean_step_s"]
        rows.append([f"local_x{world}" if case == "local" else case, s["mean_step_s"] * 1e3,
                     *(cpu.get(g, 0.0) * 1e3 for g in main_groups), other * 1e3, busy])
    return rows


def _parser() -> argparse.ArgumentParser:
    p = cli_args.parser("Time per training step at N CPU ranks: dpsgd (overlap on/off, "
                        "delay-by-one), adpsgd, Lightning ddp, and no communication; ratios to no "
                        "communication; the training thread's time in gossip.")
    cli_args.add_ranks(p, [2, 4])
    p.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    p.add_argument("--in-features", type=int, default=1024, help="input features")
    p.add_argument("--classes", type=int, default=10, help="output classes")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--simulated-compute-ms", type=float, nargs="+", default=[0.0, 100.0],
                   help="sleep this long in every training_step, on top of the real "
                   "forward/backward: models accelerator compute that leaves the CPU free "
                   "(what overlap is designed for); every value is measured")
    p.add_argument("--steps", type=int, default=20, help="measured steps per fit")
    p.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of a fit")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds over all cases (interleaved, to spread drifting load)")
    p.add_argument("--cases", nargs="+", default=None, choices=CASES,
                   help=f"which cases to run (default: {' '.join(DEFAULT_CASES)}; with "
                   "--quick: solo to dpsgd_delay1)")
    p.add_argument("--topology", default="random_ring", help="dpsgd topology")
    cli_args.add_run_options(p, timeout=1800, out=DEFAULT_OUT, per="per launch",
                             quick="tiny model, few steps, 2 ranks, 1 round (smoke test; seconds)")
    return p


def _launch_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One launch per world size; a summary per world size and simulated compute."""
    launches = []
    for world in args.ranks:
        spec = cli_args.spec_of(args, ("width", "depth", "in_features", "classes", "batch_size",
                                       "steps", "warmup", "repeats", "topology",
                                       "simulated_compute_ms"))
        spec["cases"] = list(args.cases)
        workdir = args.out.parent / f".{args.out.stem}_work_{world}"
        ranks, wall = harness.timed_launch("benchmarks.perf.step_time", spec, world, workdir,
                                           args.timeout)
        for ms in args.simulated_compute_ms:
            launches.append({"world_size": world, "simulated_compute_ms": ms, "wall_s": wall,
                             "cases": _summarise(ranks, list(args.cases), ms)})
    return launches


def _launch_markdown(launch: dict[str, Any]) -> list[str]:
    """The tables of one launch; adds its blocking/overlap and overlap/solo|local ratios."""
    world, summary = launch["world_size"], launch["cases"]
    ms = launch["simulated_compute_ms"]
    sim = f", {ms:g} ms simulated compute (sleep) per step" if ms else ", no simulated compute"
    headers = ["case", "step ms (median)", "round medians ms", "x solo", "x local",
               "gossip ms", "x blocking"]
    md = ["", f"**{world} ranks{sim}**", "", harness.markdown_table(headers, _rows(world, summary))]
    cpu_rows = _cpu_rows(world, summary)
    if cpu_rows:
        md += ["", "CPU ms per step per rank, by thread (mean over the measured steps; "
               "busy cores = all ranks' CPU time / wall time):", "",
               harness.markdown_table(CPU_HEADERS, cpu_rows)]
    b = summary.get("dpsgd_blocking", {}).get("median_step_s")
    o = summary.get("dpsgd_overlap", {}).get("median_step_s")
    if b and o:
        launch["blocking_over_overlap"] = b / o
        md.append(f"\nblocking / overlap = {b / o:.3f}")
    if o and "solo" in summary:
        launch["overlap_over_solo"] = o / summary["solo"]["median_step_s"]
    if o and "local" in summary:
        launch["overlap_over_local"] = o / summary["local"]["median_step_s"]
    return md


def main(argv: list[str] | None = None) -> int:
    args = cli_args.parse(_parser(), argv, _worker)
    if args is None:
        return 0
    if args.quick:
        args.width, args.depth, args.in_features = 256, 2, 128
        args.steps, args.warmup, args.repeats, args.ranks = 4, 2, 1, [2]
        args.simulated_compute_ms = args.simulated_compute_ms[:1]
        args.cases = args.cases or list(CASES[:-2])
    args.cases = args.cases or list(DEFAULT_CASES)

    params = _param_count(args.in_features, args.width, args.depth, args.classes)
    before = harness.machine_info()
    print(f"step_time: {params / 1e6:.2f}M parameters, per-rank batch {args.batch_size}, "
          f"{args.steps} measured steps after {args.warmup} warm-up, {args.repeats} round(s), "
          f"ranks {args.ranks}; load average {before['loadavg_1_5_15']}", file=sys.stderr)
    launches = _launch_all(args)
    after = harness.machine_info()
    md = [f"Step time, {params / 1e6:.2f}M-parameter MLP, per-rank batch {args.batch_size}, "
          f"median of {args.steps} steps x {args.repeats} round(s) after {args.warmup} warm-up; "
          "gossip ms = the training thread's own time in the strategy's gossip code per step "
          "(median), x blocking = that over dpsgd_blocking's.",
          harness.describe_machine(before) + f" Load after: {after['loadavg_1_5_15']}."]
    for launch in launches:
        md += _launch_markdown(launch)
    text = "\n".join(md)
    print(text)
    harness.write_json(args.out, {
        "benchmark": "step_time", "quick": args.quick, "parameters": params,
        "config": cli_args.config_of(args), "machine": before,
        "loadavg_after": after["loadavg_1_5_15"],
        "launches": launches, "markdown": text,
    })
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
