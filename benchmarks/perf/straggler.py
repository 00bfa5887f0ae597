"""Throughput with and without a straggler: adpsgd vs dpsgd vs Lightning ddp, plus accuracy.

One run of this script starts N CPU ranks once (torchrun, gloo, one thread per rank) and trains,
back to back in the same processes, an MLP on scikit-learn's bundled handwritten digits
(1400 training / 397 held-out images) with every selected strategy, twice:

* ``equal``:     all ranks run at the same speed;
* ``straggler``: rank 1 (``--straggler-rank``) is made ``--slowdown`` (2) times slower per
                 step. Default
                 (``--straggler adaptive``): after every step it sleeps ``(slowdown - 1) x``
                 the time that step took (``on_train_batch_start`` to ``on_train_batch_end``).
                 ``--straggler fixed``: it sleeps ``(slowdown - 1) x`` the *calibrated* local
                 step time instead (the median step of a communication-free fit run on every
                 rank at once right before the timed fits), the same sleep for every strategy.

A sleeping rank frees its share of the CPU, so on an oversubscribed CPU the other ranks get
faster meanwhile; the ``rank-K step / others`` column reports how much slower the straggler
really ran in each fit.

Throughput = samples processed by all ranks / wall time from the earliest ``on_train_start``
to the latest final ``on_train_batch_end`` (all ranks on one machine, one clock). Accuracy =
the model each rank holds after ``fit`` (gossip strategies end with the exact average of the
replicas) on the held-out images; rank 0's figure is reported, the spread over ranks is in
the JSON. For ``adpsgd`` its straggler-resilient data (one shared permutation, faster ranks
take more batches) is whatever the strategy does by default.

Usage::

    python -m benchmarks.perf.straggler                       # ddp, dpsgd, adpsgd
    python -m benchmarks.perf.straggler --strategies ddp dpsgd
    python -m benchmarks.perf.straggler --quick               # seconds; used by the smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import cli_args, harness
from benchmarks.perf import straggling

#: strategy name -> (kind, keywords of the strategy)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}), "dpsgd": ("dpsgd", {}), "adpsgd": ("adpsgd", {}),
    "adpsgd_random": ("adpsgd", {"pairing": "random"}),
}
STRATEGIES = tuple(CASES)
DEFAULT_STRATEGIES = ("ddp", "dpsgd", "adpsgd")
MODES = ("equal", "straggler")
DEFAULT_OUT = harness.RESULTS_DIR / "straggler.json"


# ----------------------------------------------------------------------------------------------
# Worker side (runs inside every torchrun rank)
# ----------------------------------------------------------------------------------------------
def _strategy(name: str, spec: dict[str, Any]) -> Any:
    from benchmarks.common import trainers

    kind, options = CASES[name]
    gossip: dict[str, Any] = dict(consensus_every_n_steps=None, **options)
    if kind == "adpsgd":
        gossip.update(spec.get("adpsgd_kwargs") or {})
    return trainers.make_strategy(kind, **gossip)


def _fit(w: harness.Worker, data: tuple[Any, Any, Any], name: str | None, epochs: int,
         sleep_s: float = 0.0, factor: float = 0.0) -> dict[str, Any]:
    """One fit of the digits MLP with strategy ``name`` (``None``: alone, no communication)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.common import meters, trainers, workloads

    spec = w.spec
    train, x_val, y_val = data
    torch.manual_seed(spec["seed"])
    model = workloads.Classifier([64] + [spec["width"]] * spec["depth"] + [10], lr=spec["lr"])
    meter = meters.ThroughputMeter(sleep_s, factor)
    loader = DataLoader(train, batch_size=spec["batch_size"], shuffle=True,
                        generator=torch.Generator().manual_seed(spec["seed"] + w.rank))
    options = trainers.trainer_kwargs(w.out, max_epochs=epochs, callbacks=[meter])
    if name is None:  # communication-free calibration fit
        trainers.fit_alone(model, options, train_dataloaders=loader)
    else:
        L.Trainer(strategy=_strategy(name, spec), devices=w.world, **options).fit(model, loader)
    return {**meter.window(), "slept_s": meter.slept, "val_acc": model.accuracy(x_val, y_val)}


def _run_cases(w: harness.Worker, data: tuple[Any, Any, Any],
               sleep_s: float) -> dict[str, list[Any]]:
    """Every strategy in every mode, ``repeats`` rounds, interleaved."""
    import torch.distributed as dist

    spec, slow_rank = w.spec, w.spec["straggler_rank"]
    adaptive = spec["straggler"] == "adaptive"
    runs: dict[str, list[Any]] = {}
    cases = [(name, mode) for mode in spec["modes"] for name in spec["strategies"]]
    for rnd, (name, mode) in ((r, c) for r in range(spec["repeats"]) for c in cases):
        dist.barrier()
        harness.progress(f"round {rnd + 1}/{spec['repeats']} {name} / {mode}")
        slow = mode == "straggler" and w.rank == slow_rank
        try:
            if slow and adaptive:
                res = _fit(w, data, name, spec["epochs"], factor=spec["slowdown"] - 1.0)
            else:
                res = _fit(w, data, name, spec["epochs"], sleep_s=sleep_s if slow else 0.0)
        except Exception as e:  # report, then fail the launch on every rank
            harness.progress(f"  {name} / {mode} failed on rank {w.rank}: {type(e).__name__}: {e}")
            raise
        runs.setdefault(f"{name}/{mode}", []).append(res)
        dist.barrier()
        if w.rank == 0:
            harness.progress(f"  done: rank-0 steps {res['steps']}, val_acc {res['val_acc']:.3f}")
    return runs


def _worker(spec_path: Path) -> None:
    import torch.distributed as dist

    from benchmarks.common import workloads
    from benchmarks.perf import straggling

    with harness.worker_session(spec_path) as w:
        spec, data = w.spec, workloads.digits_split()
        # Calibration: the local (communication-free) step time under the same contention.
        dist.barrier()
        harness.progress(f"calibrating the local step time ({w.world} ranks, no communication)")
        calib = _fit(w, data, None, spec["calibration_epochs"])
        slow_rank = spec["straggler_rank"]
        local_step, sleep_s = straggling.calibrated_sleep(calib["median_step_s"], slow_rank,
                                                          spec["slowdown"])
        harness.progress(f"  local step {local_step * 1e3:.1f} ms on rank {slow_rank}; "
                         + (f"straggler sleeps {spec['slowdown'] - 1:g}x each of its steps"
                      if spec["straggler"] == "adaptive"
                      else f"straggler sleeps {sleep_s * 1e3:.1f} ms per step"))
        runs = _run_cases(w, data, sleep_s)
        w.write({"rank": w.rank, "calibration": calib, "sleep_s": sleep_s, "runs": runs})


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
def _summarise_round(per: list[dict[str, Any]], slow_rank: int) -> dict[str, Any]:
    """One fit: throughput over all ranks, accuracy, steps, the straggler's real slowdown."""
    accs = [p["val_acc"] for p in per]
    return {**straggling.fit_throughput(per, slow_rank),
            "val_acc": accs[0], "val_acc_min": min(accs), "val_acc_max": max(accs),
            "straggler_slept_s": per[slow_rank]["slept_s"]}


def _summarise(ranks: list[dict[str, Any]], keys: list[str], slow_rank: int) -> dict[str, Any]:
    """Per case: every round, and the medians over rounds (the figures reported)."""
    summary: dict[str, Any] = {}
    for key in keys:
        rounds = [_summarise_round([r["runs"][key][i] for r in ranks], slow_rank)
                  for i in range(len(ranks[0]["runs"][key]))]
        tput = [x["samples_per_s"] for x in rounds]
        summary[key] = {
            "samples_per_s": harness.median(tput), "samples_per_s_min": min(tput),
            "samples_per_s_max": max(tput),
            "wall_s": harness.median([x["wall_s"] for x in rounds]),
            "val_acc": harness.median([x["val_acc"] for x in rounds]),
            "val_acc_min": min(x["val_acc_min"] for x in rounds),
            "val_acc_max": max(x["val_acc_max"] for x in rounds),
            "straggler_step_ratio": harness.median([x["straggler_step_ratio"] for x in rounds]),
            "steps_per_rank": rounds[len(rounds) // 2]["steps_per_rank"],
            "rounds": rounds,
        }
    return summary


def _parser() -> argparse.ArgumentParser:
    p = cli_args.parser("Samples/s and final accuracy of adpsgd, dpsgd and Lightning ddp on N CPU "
                        "ranks, with equal ranks and with one rank made slower per step.")
    cli_args.add_ranks(p)
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                   choices=STRATEGIES, help="strategies to compare (ddp is the reference)")
    cli_args.add_straggler_options(
        p, modes=MODES,
        slowdown="the straggler's steps take this many times as long (see --straggler)",
        rank="which rank is slowed down (adpsgd: 1 is passive, 0 is active)")
    p.add_argument("--straggler", choices=("adaptive", "fixed"), default="adaptive",
                   help="adaptive: after each step the straggler sleeps (slowdown - 1) x the "
                   "time that step took; fixed: (slowdown - 1) x the calibrated local step "
                   "time, the same sleep for every strategy")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=2, help="hidden layers of the MLP")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--epochs", type=int, default=10, help="epochs per fit")
    p.add_argument("--calibration-epochs", type=int, default=2,
                   help="epochs of the communication-free calibration fit")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds over all fits (interleaved, to spread drifting load); "
                   "medians over rounds are reported")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data order")
    cli_args.add_adpsgd_kwargs(p, '{"max_staleness": 4}')
    cli_args.add_run_options(p, timeout=1800, out=DEFAULT_OUT,
                             quick="small MLP, 2 ranks, 1 epoch (smoke test; seconds)")
    return p


def _rows(summary: dict[str, Any], keys: list[str]) -> list[list[Any]]:
    """The table's rows; adds ``over_ddp`` (samples/s over ddp's in the same mode)."""
    rows = []
    for key in keys:
        name, mode = key.split("/")
        s = summary[key]
        ref = summary.get(f"ddp/{mode}", {}).get("samples_per_s")
        s["over_ddp"] = s["samples_per_s"] / ref if ref else None
        rng = (f"{s['samples_per_s_min']:.0f}-{s['samples_per_s_max']:.0f}"
               if len(s["rounds"]) > 1 else "-")
        acc = (f"{s['val_acc']:.3f} ({s['val_acc_min']:.3f}-{s['val_acc_max']:.3f})"
               if len(s["rounds"]) > 1 else f"{s['val_acc']:.3f}")
        rows.append([name, mode, s["samples_per_s"], rng, s["over_ddp"] or float("nan"),
                     "/".join(str(n) for n in s["steps_per_rank"]),
                     s["straggler_step_ratio"], acc])
    return rows


def _markdown(args: argparse.Namespace, ranks: list[dict[str, Any]], rows: list[list[Any]],
              before: dict[str, Any], after: dict[str, Any], calib: float) -> str:
    if args.straggler == "adaptive":
        how = (f"sleeping {args.slowdown - 1:g}x the time each of its steps took "
               f"(calibrated local step, for reference: {calib * 1e3:.1f} ms)")
    else:
        how = (f"sleeping {ranks[0]['sleep_s'] * 1e3:.1f} ms per step ({args.slowdown - 1:g}x "
               f"its calibrated local step of {calib * 1e3:.1f} ms)")
    md = [f"Digits MLP 64-{args.width}x{args.depth}-10, {args.ranks} ranks, per-rank batch "
          f"{args.batch_size}, {args.epochs} epochs, median of {args.repeats} round(s); "
          f"straggler = rank {args.straggler_rank} {how}.",
          harness.describe_machine(before) + f" Load after: {after['loadavg_1_5_15']}.", "",
          harness.markdown_table(["strategy", "mode", "samples/s (median)", "rounds range",
                                  "x ddp", "steps per rank",
                                  f"rank-{args.straggler_rank} step / others", "val acc"], rows)]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = cli_args.parse(p, argv, _worker)
    if args is None:
        return 0
    if args.quick:
        args.width, args.depth, args.epochs, args.calibration_epochs = 64, 1, 1, 1
        args.ranks, args.repeats = 2, 1
    cli_args.check_straggler_rank(p, args)

    before = harness.machine_info()
    print(f"straggler: {args.ranks} ranks, strategies {args.strategies}, modes {args.modes}, "
          f"MLP 64-{args.width}x{args.depth}-10, per-rank batch {args.batch_size}, "
          f"{args.epochs} epochs; load average {before['loadavg_1_5_15']}", file=sys.stderr)
    spec = cli_args.spec_of(args, ("strategies", "modes", "slowdown", "straggler", "width", "depth",
                                   "batch_size", "epochs", "calibration_epochs", "lr", "seed",
                                   "adpsgd_kwargs", "repeats", "straggler_rank"))
    ranks, wall = harness.timed_launch("benchmarks.perf.straggler", spec, args.ranks,
                                       args.out.parent / f".{args.out.stem}_work", args.timeout)
    after = harness.machine_info()
    keys = [f"{s}/{m}" for m in args.modes for s in args.strategies]
    summary = _summarise(ranks, keys, args.straggler_rank)
    rows = _rows(summary, keys)
    calib = ranks[args.straggler_rank]["calibration"]["median_step_s"]
    text = _markdown(args, ranks, rows, before, after, calib)
    print(text)
    harness.write_json(args.out, {
        "benchmark": "straggler", "quick": args.quick, "config": cli_args.config_of(args),
        "machine": before, "loadavg_after": after["loadavg_1_5_15"], "launch_wall_s": wall,
        "straggler_rank": args.straggler_rank, "sleep_s": ranks[0]["sleep_s"],
        "calibrated_local_step_s": calib, "runs": summary, "markdown": text,
    })
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
