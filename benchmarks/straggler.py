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

    python benchmarks/straggler.py                       # ddp, dpsgd, adpsgd
    python benchmarks/straggler.py --strategies ddp dpsgd
    python benchmarks/straggler.py --quick               # seconds; used by the smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

STRATEGIES = ("ddp", "dpsgd", "adpsgd", "adpsgd_random")
DEFAULT_STRATEGIES = ("ddp", "dpsgd", "adpsgd")
MODES = ("equal", "straggler")
DEFAULT_OUT = H.RESULTS_DIR / "straggler.json"


# ----------------------------------------------------------------------------------------------
# Worker side (runs inside every torchrun rank)
# ----------------------------------------------------------------------------------------------
def _worker(spec_path: Path) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from torch import nn
    from torch.utils.data import DataLoader

    import lightning_gossip

    H.worker_init()
    spec = json.loads(spec_path.read_text())
    out = spec_path.parent
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Lightning reuses it; also used for barriers between cases

    train, x_val, y_val = H.digits_split()

    class DigitsMLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            dims = [64] + [spec["width"]] * spec["depth"] + [10]
            layers: list[nn.Module] = []
            for a, b in zip(dims[:-1], dims[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.net = nn.Sequential(*layers[:-1])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            xb, yb = batch
            return nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=spec["lr"], momentum=0.9)

    class Meter(Callback):
        """Wall-clock window, samples and steps of this rank; optional per-step sleep.

        ``factor > 0``: after every step sleep ``factor x`` the time that step took (from
        ``on_train_batch_start`` to ``on_train_batch_end``); else sleep ``sleep_s``.
        """

        def __init__(self, sleep_s: float = 0.0, factor: float = 0.0) -> None:
            self.sleep_s, self.factor = sleep_s, factor
            self.t_start = self.t_end = float("nan")
            self.samples = self.steps = 0
            self.slept = 0.0
            self.ends: list[float] = []
            self._batch_start = 0.0

        def on_train_start(self, *args: Any) -> None:
            self.t_start = time.time()

        def on_train_batch_start(self, *args: Any) -> None:
            self._batch_start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            pause = self.sleep_s
            if self.factor > 0:
                pause = self.factor * (time.perf_counter() - self._batch_start)
            if pause > 0:
                time.sleep(pause)
                self.slept += pause
            self.samples += len(batch[0])
            self.steps += 1
            self.t_end = time.time()
            self.ends.append(time.perf_counter())

    def make_strategy(name: str) -> Any:
        if name == "ddp":
            return DDPStrategy(process_group_backend="gloo")
        kwargs: dict[str, Any] = dict(consensus_every_n_steps=None, process_group_backend="gloo")
        if name == "dpsgd":
            return lightning_gossip.DPSGDStrategy(**kwargs)
        cls = getattr(lightning_gossip, "ADPSGDStrategy", None)
        if cls is None:
            raise RuntimeError("lightning_gossip.ADPSGDStrategy does not exist in this version")
        if name == "adpsgd_random":
            kwargs["pairing"] = "random"
        kwargs.update(spec.get("adpsgd_kwargs") or {})
        return cls(**kwargs)

    def fit(strategy_name: str | None, epochs: int, sleep_s: float = 0.0,
            factor: float = 0.0) -> dict[str, Any]:
        torch.manual_seed(spec["seed"])
        model = DigitsMLP()
        meter = Meter(sleep_s, factor)
        loader = DataLoader(train, batch_size=spec["batch_size"], shuffle=True,
                            generator=torch.Generator().manual_seed(spec["seed"] + rank))
        common = dict(accelerator="cpu", max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[meter], num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=str(out / "lightning"))
        if strategy_name is None:  # communication-free calibration fit
            with H.without_launcher_env():
                trainer = L.Trainer(strategy=SingleDeviceStrategy(torch.device("cpu")),
                                    devices=1, **common)
                trainer.fit(model, loader)
        else:
            trainer = L.Trainer(strategy=make_strategy(strategy_name), devices=world, **common)
            trainer.fit(model, loader)
        with torch.no_grad():
            acc = (model.net(x_val).argmax(-1) == y_val).float().mean().item()
        steps = [b - a for a, b in zip(meter.ends[:-1], meter.ends[1:])]
        return {"t_start": meter.t_start, "t_end": meter.t_end, "samples": meter.samples,
                "steps": meter.steps, "median_step_s": H.median(steps[2:] or steps),
                "slept_s": meter.slept, "val_acc": acc}

    # Calibration: the local (communication-free) step time under the same contention.
    dist.barrier()
    H.progress(f"calibrating the local step time ({world} ranks, no communication)")
    calib = fit(None, spec["calibration_epochs"])
    local_step = torch.tensor([calib["median_step_s"]], dtype=torch.float64)
    slow_rank = spec["straggler_rank"]
    dist.broadcast(local_step, src=slow_rank)
    sleep_s = (spec["slowdown"] - 1.0) * float(local_step.item())
    adaptive = spec["straggler"] == "adaptive"
    H.progress(f"  local step {local_step.item() * 1e3:.1f} ms on rank {slow_rank}; "
               + (f"straggler sleeps {spec['slowdown'] - 1:g}x each of its steps" if adaptive
                  else f"straggler sleeps {sleep_s * 1e3:.1f} ms per step"))

    runs: dict[str, list[Any]] = {}
    cases = [(name, mode) for mode in spec["modes"] for name in spec["strategies"]]
    for rnd, (name, mode) in ((r, c) for r in range(spec["repeats"]) for c in cases):
        dist.barrier()
        H.progress(f"round {rnd + 1}/{spec['repeats']} {name} / {mode}")
        slow = mode == "straggler" and rank == slow_rank
        try:
            if slow and adaptive:
                res = fit(name, spec["epochs"], factor=spec["slowdown"] - 1.0)
            else:
                res = fit(name, spec["epochs"], sleep_s=sleep_s if slow else 0.0)
        except Exception as e:  # report, then fail the launch on every rank
            H.progress(f"  {name} / {mode} failed on rank {rank}: {type(e).__name__}: {e}")
            raise
        runs.setdefault(f"{name}/{mode}", []).append(res)
        dist.barrier()
        if rank == 0:
            H.progress(f"  done: rank-0 steps {res['steps']}, val_acc {res['val_acc']:.3f}")
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "calibration": calib, "sleep_s": sleep_s, "runs": runs}))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
def _summarise_round(per: list[dict[str, Any]], slow_rank: int) -> dict[str, Any]:
    """One fit: throughput over all ranks, accuracy, steps, the straggler's real slowdown."""
    wall = max(p["t_end"] for p in per) - min(p["t_start"] for p in per)
    samples = sum(p["samples"] for p in per)
    accs = [p["val_acc"] for p in per]
    steps = [p["median_step_s"] for p in per]
    others = [t for r, t in enumerate(steps) if r != slow_rank]
    return {
        "samples": samples, "wall_s": wall, "samples_per_s": samples / wall,
        "val_acc": accs[0], "val_acc_min": min(accs), "val_acc_max": max(accs),
        "steps_per_rank": [p["steps"] for p in per],
        "median_step_s_per_rank": steps,
        # how much slower the straggler's steps really were than the others' (medians)
        "straggler_step_ratio": steps[slow_rank] / H.median(others),
        "straggler_slept_s": per[slow_rank]["slept_s"],
    }


def _summarise(ranks: list[dict[str, Any]], keys: list[str], slow_rank: int) -> dict[str, Any]:
    """Per case: every round, and the medians over rounds (the figures reported)."""
    summary: dict[str, Any] = {}
    for key in keys:
        rounds = [_summarise_round([r["runs"][key][i] for r in ranks], slow_rank)
                  for i in range(len(ranks[0]["runs"][key]))]
        tput = [x["samples_per_s"] for x in rounds]
        summary[key] = {
            "samples_per_s": H.median(tput), "samples_per_s_min": min(tput),
            "samples_per_s_max": max(tput),
            "wall_s": H.median([x["wall_s"] for x in rounds]),
            "val_acc": H.median([x["val_acc"] for x in rounds]),
            "val_acc_min": min(x["val_acc_min"] for x in rounds),
            "val_acc_max": max(x["val_acc_max"] for x in rounds),
            "straggler_step_ratio": H.median([x["straggler_step_ratio"] for x in rounds]),
            "steps_per_rank": rounds[len(rounds) // 2]["steps_per_rank"],
            "rounds": rounds,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Samples/s and final accuracy of adpsgd, dpsgd and Lightning ddp on N CPU "
        "ranks, with equal ranks and with one rank made slower per step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="world size")
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                   choices=STRATEGIES, help="strategies to compare (ddp is the reference)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="equal ranks and/or one straggler")
    p.add_argument("--slowdown", type=float, default=2.0,
                   help="the straggler's steps take this many times as long (see --straggler)")
    p.add_argument("--straggler", choices=("adaptive", "fixed"), default="adaptive",
                   help="adaptive: after each step the straggler sleeps (slowdown - 1) x the "
                   "time that step took; fixed: (slowdown - 1) x the calibrated local step "
                   "time, the same sleep for every strategy")
    p.add_argument("--straggler-rank", type=int, default=1,
                   help="which rank is slowed down (adpsgd: 1 is passive, 0 is active)")
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
    p.add_argument("--adpsgd-kwargs", type=json.loads, default=None,
                   help='extra ADPSGDStrategy keywords as JSON, e.g. \'{"max_staleness": 4}\'')
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the launch")
    p.add_argument("--quick", action="store_true",
                   help="small MLP, 2 ranks, 1 epoch (smoke test; seconds)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.quick:
        args.width, args.depth, args.epochs, args.calibration_epochs = 64, 1, 1, 1
        args.ranks, args.repeats = 2, 1
    if not 0 <= args.straggler_rank < args.ranks:
        p.error(f"--straggler-rank must be in [0, {args.ranks})")

    before = H.machine_info()
    print(f"straggler: {args.ranks} ranks, strategies {args.strategies}, modes {args.modes}, "
          f"MLP 64-{args.width}x{args.depth}-10, per-rank batch {args.batch_size}, "
          f"{args.epochs} epochs; load average {before['loadavg_1_5_15']}", file=sys.stderr)
    spec = {k: getattr(args, k) for k in ("strategies", "modes", "slowdown", "straggler",
                                           "width", "depth", "batch_size", "epochs",
                                           "calibration_epochs", "lr", "seed", "adpsgd_kwargs",
                                           "repeats", "straggler_rank")}
    workdir = args.out.parent / f".{args.out.stem}_work"
    t0 = time.time()
    ranks = H.launch(Path(__file__).resolve(), spec, args.ranks, workdir, args.timeout)
    wall = time.time() - t0
    after = H.machine_info()
    keys = [f"{s}/{m}" for m in args.modes for s in args.strategies]
    summary = _summarise(ranks, keys, args.straggler_rank)

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
    calib = ranks[args.straggler_rank]["calibration"]["median_step_s"]
    if args.straggler == "adaptive":
        how = (f"sleeping {args.slowdown - 1:g}x the time each of its steps took "
               f"(calibrated local step, for reference: {calib * 1e3:.1f} ms)")
    else:
        how = (f"sleeping {ranks[0]['sleep_s'] * 1e3:.1f} ms per step ({args.slowdown - 1:g}x "
               f"its calibrated local step of {calib * 1e3:.1f} ms)")
    md = [f"Digits MLP 64-{args.width}x{args.depth}-10, {args.ranks} ranks, per-rank batch "
          f"{args.batch_size}, {args.epochs} epochs, median of {args.repeats} round(s); "
          f"straggler = rank {args.straggler_rank} {how}.",
          H.describe_machine(before) + f" Load after: {after['loadavg_1_5_15']}.", "",
          H.markdown_table(["strategy", "mode", "samples/s (median)", "rounds range",
                            "x ddp", "steps per rank", f"rank-{args.straggler_rank} step / others",
                            "val acc"], rows)]
    text = "\n".join(md)
    print(text)
    H.write_json(args.out, {
        "benchmark": "straggler", "quick": args.quick,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k != "worker"},
        "machine": before, "loadavg_after": after["loadavg_1_5_15"], "launch_wall_s": wall,
        "straggler_rank": args.straggler_rank, "sleep_s": ranks[0]["sleep_s"],
        "calibrated_local_step_s": calib, "runs": summary, "markdown": text,
    })
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
