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
                     sharded rounds of ``lightning_gossip.hierarchy.ShardedExchange``).

Gossip on the training thread: ``time.perf_counter`` around the strategy methods the training
thread runs for gossip in a step (``DPSGDStrategy._start``, ``_apply_delta``,
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

    python benchmarks/step_time.py                 # 2 then 4 ranks, 0 and 100 ms compute
    python benchmarks/step_time.py --ranks 4       # only the 4-rank launch
    python benchmarks/step_time.py --quick         # seconds; used by the smoke test
    python benchmarks/step_time.py --simulated-compute-ms 200   # only compute that frees the CPU

On a CPU-only machine "communication" (gloo over loopback TCP, the mixing arithmetic) is CPU
work too, so it competes with the forward/backward it is meant to hide behind.
``--simulated-compute-ms`` adds a sleep to every step (an accelerator computing while the CPU
is free), which shows what the overlap buys when there is something to overlap with.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

CASES = ("solo", "local", "ddp", "dpsgd_blocking", "dpsgd_overlap", "dpsgd_delay1", "adpsgd",
         "dpsgd_overlap_bf16")
DEFAULT_CASES = CASES[1:]
#: the strategy methods the training thread runs for gossip, timed per step
GOSSIP_METHODS = {"dpsgd": ("_start", "_apply_delta", "_finish_blocking"),
                  "adpsgd": ("after_step",)}
DEFAULT_OUT = H.RESULTS_DIR / "step_time.json"


# ----------------------------------------------------------------------------------------------
# Worker side (runs inside every torchrun rank)
# ----------------------------------------------------------------------------------------------
def _thread_cpu() -> dict[str, float] | None:
    """CPU seconds used so far by this process's threads, grouped: ``training`` (the main
    thread), Python threads by name without their trailing number, ``native`` for the
    threads Python does not know (gloo's, torch's). ``None`` where ``/proc`` has no tasks."""
    task = Path("/proc/self/task")
    if not task.is_dir():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    named = {th.native_id: th.name for th in threading.enumerate()}
    main = threading.main_thread().native_id
    groups: dict[str, float] = {}
    for d in task.iterdir():
        try:  # schedstat: nanoseconds on the CPU; stat: user + system in clock ticks
            seconds = int((d / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            try:
                stat = (d / "stat").read_text()
            except OSError:  # the thread ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick
        tid = int(d.name)
        group = ("training" if tid == main else
                 re.sub(r"[-_]?\d+$", "", named[tid]) if tid in named else "native")
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


def _per_step(start: dict[str, float] | None, end: dict[str, float] | None,
              steps: int) -> dict[str, float]:
    """CPU seconds per step and group between two :func:`_thread_cpu` readings."""
    if not start or not end or steps <= 0:
        return {}
    return {g: (end[g] - start.get(g, 0.0)) / steps for g in end}


def _param_count(in_features: int, width: int, depth: int, classes: int) -> int:
    dims = [in_features] + [width] * depth + [classes]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def _worker(spec_path: Path) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_gossip

    gossip_clock = [0.0]  # seconds the training thread spent in the timed gossip methods

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                gossip_clock[0] += time.perf_counter() - t0
        return wrapper

    from lightning_gossip.async_gossip.engine import AsyncGossip

    for name in GOSSIP_METHODS["dpsgd"]:
        setattr(lightning_gossip.DPSGDStrategy, name,
                timed(getattr(lightning_gossip.DPSGDStrategy, name)))
    for name in GOSSIP_METHODS["adpsgd"]:
        setattr(AsyncGossip, name, timed(getattr(AsyncGossip, name)))

    H.worker_init()
    spec = json.loads(spec_path.read_text())
    out = spec_path.parent
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Lightning reuses it; also used for barriers between cases

    class MLP(L.LightningModule):
        """A plain MLP trained on one fixed random batch (data loading is not measured)."""

        def __init__(self) -> None:
            super().__init__()
            dims = [spec["in_features"]] + [spec["width"]] * spec["depth"] + [spec["classes"]]
            layers: list[nn.Module] = []
            for a, b in zip(dims[:-1], dims[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.net = nn.Sequential(*layers[:-1])
            g = torch.Generator().manual_seed(1234 + rank)
            # Plain attributes, not buffers: buffers would be gossiped with the weights.
            self.x = torch.randn(spec["batch_size"], spec["in_features"], generator=g)
            self.y = torch.randint(0, spec["classes"], (spec["batch_size"],), generator=g)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            n = len(batch[0])
            if compute_ms[0]:  # an accelerator busy, this CPU free
                time.sleep(compute_ms[0] / 1e3)
            return nn.functional.cross_entropy(self.net(self.x[:n]), self.y[:n])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    class StepTimer(Callback):
        def __init__(self, first: int, last: int) -> None:
            self.ends: list[float] = []
            self.gossip: list[float] = []
            self.first, self.last = first, last  # batch ends bounding the measured steps
            self.cpu: list[dict[str, float] | None] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.perf_counter())
            self.gossip.append(gossip_clock[0])
            if len(self.ends) - 1 in (self.first, self.last):
                self.cpu.append(_thread_cpu())

    compute_ms = [0.0]

    steps_total = spec["warmup"] + spec["steps"]
    n_samples = (steps_total + 1) * spec["batch_size"] * world

    skip = max(spec["warmup"] - 1, 0)

    def fit(case: str) -> tuple[list[float], list[float], dict[str, float]]:
        torch.manual_seed(0)
        model = MLP()
        timer = StepTimer(first=skip, last=steps_total - 1)
        common = dict(accelerator="cpu", max_steps=steps_total, max_epochs=-1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[timer], num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=str(out / "lightning"))
        loader = DataLoader(TensorDataset(torch.arange(n_samples)),
                            batch_size=spec["batch_size"], shuffle=False, drop_last=True)
        if case in ("solo", "local"):
            with H.without_launcher_env():
                trainer = L.Trainer(strategy=SingleDeviceStrategy(torch.device("cpu")),
                                    devices=1, **common)
                trainer.fit(model, loader)
        else:
            if case == "ddp":
                strategy: Any = DDPStrategy(process_group_backend="gloo")
            elif case == "adpsgd":
                strategy = lightning_gossip.ADPSGDStrategy(
                    consensus_every_n_steps=None, final_average=False,
                    process_group_backend="gloo")
            else:
                strategy = lightning_gossip.DPSGDStrategy(
                    topology=spec["topology"], overlap="blocking" not in case,
                    delay_by_one=case == "dpsgd_delay1", consensus_every_n_steps=None,
                    final_average=False, process_group_backend="gloo",
                    wire_dtype="bf16" if case.endswith("_bf16") else "fp32")
            trainer = L.Trainer(strategy=strategy, devices=world, **common)
            trainer.fit(model, loader)
        ends, clock = timer.ends, timer.gossip
        cpu = _per_step(*timer.cpu, steps=steps_total - 1 - skip) if len(timer.cpu) == 2 else {}
        return ([b - a for a, b in zip(ends[:-1], ends[1:])][skip:],
                [b - a for a, b in zip(clock[:-1], clock[1:])][skip:], cpu)

    keys = [f"{case}@{ms:g}" for ms in spec["simulated_compute_ms"] for case in spec["cases"]]
    results: dict[str, list[list[float]]] = {k: [] for k in keys}
    gossip: dict[str, list[list[float]]] = {k: [] for k in keys}
    cpu: dict[str, list[dict[str, float]]] = {k: [] for k in keys}
    for ms in spec["simulated_compute_ms"]:
        compute_ms[0] = ms
        for rnd in range(spec["repeats"]):
            for case in spec["cases"]:
                key = f"{case}@{ms:g}"
                dist.barrier()
                H.progress(f"round {rnd + 1}/{spec['repeats']} {case}, {ms:g} ms compute "
                           f"({world} ranks)")
                times, in_gossip, per_step = (fit(case) if case != "solo" or rank == 0
                                              else ([], [], {}))
                results[key].append(times)
                gossip[key].append(in_gossip)
                cpu[key].append(per_step)
                dist.barrier()
                if rank == 0 and times:
                    H.progress(f"  {case}: median step {H.median(times) * 1e3:.1f} ms, "
                               f"gossip on the training thread "
                               f"{H.median(in_gossip) * 1e3:.2f} ms")
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "times": results,
                                                      "gossip": gossip, "cpu": cpu}))
    dist.barrier()
    dist.destroy_process_group()


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
                per_rank.append(H.median(pooled))
                means.append(sum(pooled) / len(pooled))
                in_gossip.append(H.median([g for rnd in r["gossip"][key] for g in rnd]))
            per_round.append([H.median(rnd) for rnd in rounds if rnd])
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Time per training step at N CPU ranks: dpsgd (overlap on/off, "
        "delay-by-one), adpsgd, Lightning ddp, and no communication; ratios to no "
        "communication; the training thread's time in gossip.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                   help="world sizes, one launch each (e.g. --ranks 4 2)")
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
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps, 2 ranks, 1 round (smoke test; seconds)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.quick:
        args.width, args.depth, args.in_features = 256, 2, 128
        args.steps, args.warmup, args.repeats, args.ranks = 4, 2, 1, [2]
        args.simulated_compute_ms = args.simulated_compute_ms[:1]
        args.cases = args.cases or list(CASES[:-2])
    args.cases = args.cases or list(DEFAULT_CASES)

    params = _param_count(args.in_features, args.width, args.depth, args.classes)
    before = H.machine_info()
    print(f"step_time: {params / 1e6:.2f}M parameters, per-rank batch {args.batch_size}, "
          f"{args.steps} measured steps after {args.warmup} warm-up, {args.repeats} round(s), "
          f"ranks {args.ranks}; load average {before['loadavg_1_5_15']}", file=sys.stderr)
    launches = []
    for world in args.ranks:
        spec = {k: getattr(args, k) for k in ("width", "depth", "in_features", "classes",
                                               "batch_size", "steps", "warmup", "repeats",
                                               "topology", "simulated_compute_ms")}
        spec["cases"] = list(args.cases)
        workdir = args.out.parent / f".{args.out.stem}_work_{world}"
        t0 = time.time()
        ranks = H.launch(Path(__file__).resolve(), spec, world, workdir, args.timeout)
        wall = time.time() - t0
        for ms in args.simulated_compute_ms:
            launches.append({"world_size": world, "simulated_compute_ms": ms, "wall_s": wall,
                             "cases": _summarise(ranks, list(args.cases), ms)})
    after = H.machine_info()

    md = [f"Step time, {params / 1e6:.2f}M-parameter MLP, per-rank batch {args.batch_size}, "
          f"median of {args.steps} steps x {args.repeats} round(s) after {args.warmup} warm-up; "
          "gossip ms = the training thread's own time in the strategy's gossip code per step "
          "(median), x blocking = that over dpsgd_blocking's.",
          H.describe_machine(before) + f" Load after: {after['loadavg_1_5_15']}."]
    headers = ["case", "step ms (median)", "round medians ms", "x solo", "x local",
               "gossip ms", "x blocking"]
    for launch in launches:
        world, summary = launch["world_size"], launch["cases"]
        ms = launch["simulated_compute_ms"]
        sim = f", {ms:g} ms simulated compute (sleep) per step" if ms else ", no simulated compute"
        md += ["", f"**{world} ranks{sim}**", "",
               H.markdown_table(headers, _rows(world, summary))]
        cpu_rows = _cpu_rows(world, summary)
        if cpu_rows:
            md += ["", "CPU ms per step per rank, by thread (mean over the measured steps; "
                   "busy cores = all ranks' CPU time / wall time):", "",
                   H.markdown_table(CPU_HEADERS, cpu_rows)]
        b = summary.get("dpsgd_blocking", {}).get("median_step_s")
        o = summary.get("dpsgd_overlap", {}).get("median_step_s")
        if b and o:
            launch["blocking_over_overlap"] = b / o
            md.append(f"\nblocking / overlap = {b / o:.3f}")
        if o and "solo" in summary:
            launch["overlap_over_solo"] = o / summary["solo"]["median_step_s"]
        if o and "local" in summary:
            launch["overlap_over_local"] = o / summary["local"]["median_step_s"]
    text = "\n".join(md)
    print(text)
    H.write_json(args.out, {
        "benchmark": "step_time", "quick": args.quick, "parameters": params,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("worker",)},
        "machine": before, "loadavg_after": after["loadavg_1_5_15"],
        "launches": launches, "markdown": text,
    })
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
