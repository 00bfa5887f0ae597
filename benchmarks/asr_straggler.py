"""The ASR recipe with and without a straggler: adpsgd vs dpsgd vs Lightning ddp, samples/s and WER.

One run starts N CPU ranks once (torchrun, gloo, one thread per rank) and trains, back to back
in the same processes, the recipe's BLSTM-CTC model (``recipes.asr``: ``KaldiDataModule`` with
its length buckets, ``SpeechRecognizer``) on a synthetic espeak-ng corpus with every selected
strategy, in two modes:

* ``equal``:     all ranks run at the same speed;
* ``straggler``: rank 1 (``--straggler-rank``) sleeps a fixed time after every training batch:
                 ``(slowdown - 1) x`` the calibrated local step time (the median step of a
                 communication-free fit run on every rank at once right before the timed fits),
                 the same sleep for every strategy, so its steps take about ``slowdown`` (2)
                 times as long.

Under ``adpsgd`` the buckets are shared through the strategy's shared cursor (faster ranks take
more batches; every utterance once per epoch); under ``ddp`` and ``dpsgd`` every rank keeps its
own shard. Throughput = utterances processed by all ranks / wall time from the earliest
``on_train_start`` to the latest final ``on_train_batch_end``; time per epoch = that wall time /
epochs. Test WER = ``trainer.test`` on the test set (voices not in training) right after the fit
(gossip strategies end with the exact average of the replicas), reduced over all ranks.

Usage::

    python benchmarks/asr_straggler.py                  # 4 ranks, ddp/dpsgd/adpsgd, both modes
    python benchmarks/asr_straggler.py --quick          # 2 ranks, a tiny corpus, 1 epoch (smoke)
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

DEFAULT_STRATEGIES = ("ddp", "dpsgd", "adpsgd")
#: adpsgd variants that can be added to a run (remedies tried when adpsgd falls short)
VARIANTS: dict[str, dict[str, Any]] = {
    "adpsgd_nowait": {"max_staleness": None},
    "adpsgd_delay": {"delay_by_one": True},
    "adpsgd_random": {"pairing": "random"},
}
STRATEGIES = DEFAULT_STRATEGIES + tuple(VARIANTS)
MODES = ("equal", "straggler")
DEFAULT_OUT = H.RESULTS_DIR / "asr_straggler.json"
DEFAULT_CORPUS = H.ROOT / "data" / "asr-bench"


# ----------------------------------------------------------------------------------------------
# Worker side (runs inside every torchrun rank)
# ----------------------------------------------------------------------------------------------
def _worker(spec_path: Path) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    import lightning_gossip
    from recipes.asr.datamodule import KaldiDataModule
    from recipes.asr.recognizer import SpeechRecognizer

    H.worker_init()
    spec = json.loads(spec_path.read_text())
    out = spec_path.parent
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Lightning reuses it; also used for barriers between cases
    corpus = Path(spec["corpus"])

    data = KaldiDataModule(train_dir=str(corpus / "train"), test_dir=str(corpus / "test"),
                           batch_size=spec["batch_size"], eval_batch_size=32,
                           cache_features=True, cmvn_utterances=300, seed=spec["seed"])
    # Features are computed (and cached) before any timing, on every rank.
    data.setup("fit")
    data.setup("test")
    for split in ("train", "test"):
        dataset = data.datasets[split]
        for i in range(len(dataset)):
            dataset.features(i)
    H.progress(f"features cached: {len(data.datasets['train'])} train / "
               f"{len(data.datasets['test'])} test utterances")

    def make_model() -> SpeechRecognizer:
        torch.manual_seed(spec["seed"])
        return SpeechRecognizer(
            num_layers=spec["layers"], hidden_size=spec["hidden"], frame_stacking=3, lr=spec["lr"],
            warmup_steps=spec["warmup_steps"], anneal_start_epoch=spec["anneal_start_epoch"],
            anneal_factor=spec["anneal_factor"], report_dir=str(out / "report"))

    class Meter(Callback):
        """Wall-clock window, utterances and steps of this rank; optional per-step sleep."""

        def __init__(self, sleep_s: float = 0.0) -> None:
            self.sleep_s = sleep_s
            self.t_start = self.t_end = float("nan")
            self.samples = self.steps = 0
            self.ends: list[float] = []
            self.epoch_steps: list[int] = []

        def on_train_start(self, *args: Any) -> None:
            self.t_start = time.time()

        def on_train_epoch_start(self, *args: Any) -> None:
            self.epoch_steps.append(0)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.sleep_s > 0:
                time.sleep(self.sleep_s)
            self.samples += len(batch)
            self.steps += 1
            self.epoch_steps[-1] += 1
            self.t_end = time.time()
            self.ends.append(time.perf_counter())

    def make_strategy(name: str) -> Any:
        if name == "ddp":
            return DDPStrategy(process_group_backend="gloo")
        kwargs: dict[str, Any] = dict(consensus_every_n_steps=None, process_group_backend="gloo")
        if name == "dpsgd":
            return lightning_gossip.DPSGDStrategy(**kwargs)
        kwargs.update(spec.get("adpsgd_kwargs") or {})
        kwargs.update(VARIANTS.get(name, {}))
        return lightning_gossip.ADPSGDStrategy(**kwargs)

    common = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False,
                  num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                  gradient_clip_val=5.0, default_root_dir=str(out / "lightning"))

    def fit(strategy_name: str | None, epochs: int, sleep_s: float = 0.0,
            limit_batches: int | None = None) -> dict[str, Any]:
        model = make_model()
        meter = Meter(sleep_s)
        kwargs = dict(common, max_epochs=epochs, callbacks=[meter])
        if limit_batches is not None:
            kwargs["limit_train_batches"] = limit_batches
        if strategy_name is None:  # communication-free calibration fit
            with H.without_launcher_env():
                trainer = L.Trainer(strategy=SingleDeviceStrategy(torch.device("cpu")),
                                    devices=1, **kwargs)
                trainer.fit(model, datamodule=data)
            wer = float("nan")
        else:
            trainer = L.Trainer(strategy=make_strategy(strategy_name),
                                devices=int(os.environ["WORLD_SIZE"]), **kwargs)
            trainer.fit(model, datamodule=data)
            wer = float(trainer.test(model, datamodule=data, verbose=False)[0]["test_wer"])
        steps = [b - a for a, b in zip(meter.ends[:-1], meter.ends[1:])]
        return {"t_start": meter.t_start, "t_end": meter.t_end, "samples": meter.samples,
                "steps": meter.steps, "epoch_steps": meter.epoch_steps,
                "median_step_s": H.median(steps[2:] or steps), "test_wer": wer,
                "gossip_stats": dict(getattr(trainer.strategy, "gossip_stats", {}) or {})}

    dist.barrier()
    slow_rank = spec["straggler_rank"]
    H.progress(f"calibrating the local step time ({spec['calibration_batches']} batches per "
               "rank, no communication)")
    calib = fit(None, 1, limit_batches=spec["calibration_batches"])
    local_step = torch.tensor([calib["median_step_s"]], dtype=torch.float64)
    dist.broadcast(local_step, src=slow_rank)
    sleep_s = (spec["slowdown"] - 1.0) * float(local_step.item())
    H.progress(f"  local step {local_step.item() * 1e3:.0f} ms on rank {slow_rank}; the "
               f"straggler sleeps {sleep_s * 1e3:.0f} ms per step")

    runs: dict[str, Any] = {}
    for mode in spec["modes"]:
        for name in spec["strategies"]:
            dist.barrier()
            H.progress(f"{name} / {mode}")
            slow = mode == "straggler" and rank == slow_rank
            res = fit(name, spec["epochs"], sleep_s=sleep_s if slow else 0.0)
            runs[f"{name}/{mode}"] = res
            (out / f"partial_rank{rank}.json").write_text(json.dumps(
                {"rank": rank, "calibration": calib, "sleep_s": sleep_s, "runs": runs}))
            dist.barrier()
            H.progress(f"  done: steps per epoch on rank 0 {res['epoch_steps']}, "
                       f"test WER {100 * res['test_wer']:.2f}%")
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "calibration": calib, "sleep_s": sleep_s, "runs": runs}))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
def summarise(per: list[dict[str, Any]], slow_rank: int, epochs: int) -> dict[str, Any]:
    """One fit over all ranks: throughput, time per epoch, WER, batches per rank."""
    wall = max(p["t_end"] for p in per) - min(p["t_start"] for p in per)
    samples = sum(p["samples"] for p in per)
    steps = [p["median_step_s"] for p in per]
    others = [t for r, t in enumerate(steps) if r != slow_rank]
    return {
        "samples": samples, "wall_s": wall, "samples_per_s": samples / wall,
        "epoch_s": wall / epochs, "test_wer": per[0]["test_wer"],
        "steps_per_rank": [p["steps"] for p in per],
        "last_epoch_steps_per_rank": [p["epoch_steps"][-1] for p in per],
        "median_step_s_per_rank": steps,
        "straggler_step_ratio": steps[slow_rank] / H.median(others) if others else 1.0,
        # adpsgd: exchanges and seconds the training thread waited for gossip (max_staleness)
        "gossip_stats_per_rank": [p.get("gossip_stats", {}) for p in per],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (driver), or one rank of it (``--worker``)."""
    p = argparse.ArgumentParser(
        description="Utterances/s, time per epoch and test WER of the ASR recipe under ddp, "
        "dpsgd and adpsgd on N CPU ranks, with equal ranks and with one rank 2x slower.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="world size")
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                   choices=STRATEGIES, help="adpsgd_nowait: max_staleness=None; adpsgd_delay: "
                   "delay_by_one=True; adpsgd_random: random pairing")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--slowdown", type=float, default=2.0,
                   help="the straggler sleeps (slowdown - 1) x the calibrated local step")
    p.add_argument("--straggler-rank", type=int, default=1, help="which rank is slowed down")
    p.add_argument("--num-train", type=int, default=1200, help="training utterances")
    p.add_argument("--num-test", type=int, default=300, help="test utterances (unseen voices)")
    p.add_argument("--corpus-seed", type=int, default=0)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help="where the corpus is generated (cached)")
    p.add_argument("--layers", type=int, default=2, help="BLSTM layers")
    p.add_argument("--hidden", type=int, default=128, help="BLSTM units per direction")
    p.add_argument("--batch-size", type=int, default=8, help="utterances per batch and rank")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--anneal-start-epoch", type=int, default=5)
    p.add_argument("--anneal-factor", type=float, default=0.6)
    p.add_argument("--calibration-batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234, help="model and data-order seed")
    p.add_argument("--adpsgd-kwargs", type=json.loads, default=None,
                   help='extra ADPSGDStrategy keywords as JSON, e.g. \'{"max_staleness": 8}\'')
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the launch")
    p.add_argument("--quick", action="store_true",
                   help="2 ranks, 48 utterances, a tiny model, 1 epoch (smoke test)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.quick:
        args.ranks, args.num_train, args.num_test, args.epochs = 2, 48, 16, 1
        args.layers, args.hidden, args.calibration_batches = 1, 16, 4
        if args.corpus == DEFAULT_CORPUS:
            args.corpus = DEFAULT_CORPUS.with_name("asr-bench-quick")
    if not 0 <= args.straggler_rank < args.ranks:
        p.error(f"--straggler-rank must be in [0, {args.ranks})")

    from recipes.asr.synth import CorpusConfig, generate_corpus

    config = CorpusConfig(seed=args.corpus_seed, num_train=args.num_train, num_dev=8,
                          num_test=args.num_test)
    t0 = time.time()
    corpus = generate_corpus(args.corpus, config, jobs=os.cpu_count() or 2, progress=False)
    print(f"corpus {corpus}: {args.num_train} train / {args.num_test} test utterances "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)

    before = H.machine_info()
    print(f"asr_straggler: {args.ranks} ranks, {args.strategies}, {args.modes}, BLSTM "
          f"{args.layers}x{args.hidden}, per-rank batch {args.batch_size}, {args.epochs} epochs; "
          f"load average {before['loadavg_1_5_15']}", file=sys.stderr)
    spec = {k: getattr(args, k) for k in ("strategies", "modes", "slowdown", "straggler_rank",
                                           "layers", "hidden", "batch_size", "epochs", "lr",
                                           "warmup_steps", "anneal_start_epoch", "anneal_factor",
                                           "calibration_batches", "seed", "adpsgd_kwargs")}
    spec["corpus"] = str(corpus)
    workdir = args.out.parent / f".{args.out.stem}_work"
    t0 = time.time()
    ranks = H.launch(Path(__file__).resolve(), spec, args.ranks, workdir, args.timeout)
    wall = time.time() - t0
    after = H.machine_info()

    keys = [f"{s}/{m}" for m in args.modes for s in args.strategies]
    summary = {k: summarise([r["runs"][k] for r in ranks], args.straggler_rank, args.epochs)
               for k in keys}
    rows = []
    for key in keys:
        name, mode = key.split("/")
        s = summary[key]
        ref = summary.get(f"ddp/{mode}")
        s["over_ddp"] = s["samples_per_s"] / ref["samples_per_s"] if ref else None
        s["wer_minus_ddp"] = 100 * (s["test_wer"] - ref["test_wer"]) if ref else None
        rows.append([name, mode, s["samples_per_s"], s["over_ddp"] or float("nan"),
                     s["epoch_s"], f"{100 * s['test_wer']:.2f}%",
                     "/".join(str(n) for n in s["last_epoch_steps_per_rank"]),
                     s["straggler_step_ratio"],
                     "/".join(f"{g.get('staleness_wait_s', 0):.0f}"
                              for g in s["gossip_stats_per_rank"]) if name != "ddp" and
                     name != "dpsgd" else "-"])
    calib = ranks[args.straggler_rank]["calibration"]["median_step_s"]
    md = [f"ASR recipe (BLSTM {args.layers}x{args.hidden}, CTC), synthetic corpus "
          f"({args.num_train} train / {args.num_test} test utterances, test voices unseen), "
          f"{args.ranks} ranks, per-rank batch {args.batch_size}, {args.epochs} epochs, one "
          f"round; straggler = rank {args.straggler_rank} sleeping "
          f"{ranks[0]['sleep_s'] * 1e3:.0f} ms per step ({args.slowdown - 1:g}x its calibrated "
          f"local step of {calib * 1e3:.0f} ms).",
          H.describe_machine(before) + f" Load after: {after['loadavg_1_5_15']}.", "",
          H.markdown_table(["strategy", "mode", "utterances/s", "x ddp", "s per epoch",
                            "test WER", "batches per rank (last epoch)",
                            f"rank-{args.straggler_rank} step / others", "staleness wait s"],
                           rows)]
    text = "\n".join(md)
    print(text)
    H.write_json(args.out, {
        "benchmark": "asr_straggler", "quick": args.quick,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k != "worker"},
        "machine": before, "loadavg_after": after["loadavg_1_5_15"], "launch_wall_s": wall,
        "sleep_s": ranks[0]["sleep_s"], "calibrated_local_step_s": calib, "runs": summary,
        "markdown": text,
    })
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
