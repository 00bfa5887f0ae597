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

    python -m benchmarks.perf.asr_straggler          # 4 ranks, ddp/dpsgd/adpsgd, both modes
    python -m benchmarks.perf.asr_straggler --quick  # 2 ranks, a tiny corpus, 1 epoch (smoke)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cli_args, harness
from benchmarks.perf import straggling

DEFAULT_STRATEGIES = ("ddp", "dpsgd", "adpsgd")
#: adpsgd variants that can be added to a run (remedies tried when adpsgd falls short)
VARIANTS: dict[str, dict[str, Any]] = {
    "adpsgd_nowait": {"max_staleness": None},
    "adpsgd_delay": {"delay_by_one": True},
    "adpsgd_random": {"pairing": "random"},
}
STRATEGIES = DEFAULT_STRATEGIES + tuple(VARIANTS)
MODES = ("equal", "straggler")
DEFAULT_OUT = harness.RESULTS_DIR / "asr_straggler.json"
DEFAULT_CORPUS = harness.ROOT / "data" / "asr-bench"


# ----------------------------------------------------------------------------------------------
# Worker side (runs inside every torchrun rank)
# ----------------------------------------------------------------------------------------------
def _strategy(name: str, spec: dict[str, Any]) -> Any:
    from benchmarks.common import trainers

    if name in ("ddp", "dpsgd"):
        return trainers.make_strategy(name, consensus_every_n_steps=None)
    kwargs: dict[str, Any] = dict(consensus_every_n_steps=None)
    kwargs.update(spec.get("adpsgd_kwargs") or {})
    kwargs.update(VARIANTS.get(name, {}))
    return trainers.make_strategy("adpsgd", **kwargs)


def _fit(w: harness.Worker, data: Any, name: str | None, epochs: int, sleep_s: float = 0.0,
         limit_batches: int | None = None) -> dict[str, Any]:
    """One fit of the recipe with strategy ``name`` (``None``: alone, no communication), then
    the test WER (not after the calibration fit)."""
    import lightning as L

    from benchmarks.common import meters, trainers, workloads

    model = workloads.asr_model(w.spec, w.out / "report")
    meter = meters.ThroughputMeter(sleep_s, samples_of=len)
    options = trainers.trainer_kwargs(w.out, use_distributed_sampler=False, gradient_clip_val=5.0,
                                      max_epochs=epochs, callbacks=[meter])
    if limit_batches is not None:
        options["limit_train_batches"] = limit_batches
    if name is None:  # communication-free calibration fit
        trainer = trainers.fit_alone(model, options, datamodule=data)
        wer = float("nan")
    else:
        trainer = L.Trainer(strategy=_strategy(name, w.spec), devices=w.world, **options)
        trainer.fit(model, datamodule=data)
        wer = float(trainer.test(model, datamodule=data, verbose=False)[0]["test_wer"])
    window = meter.window()
    return {**{k: window[k] for k in ("t_start", "t_end", "samples", "steps")},
            "epoch_steps": meter.epoch_steps, "median_step_s": window["median_step_s"],
            "test_wer": wer,
            "gossip_stats": dict(getattr(trainer.strategy, "gossip_stats", {}) or {})}


def _worker(spec_path: Path) -> None:
    import torch.distributed as dist

    from benchmarks.common import workloads

    with harness.worker_session(spec_path) as w:
        spec, slow_rank = w.spec, w.spec["straggler_rank"]
        # Features are computed (and cached) before any timing, on every rank.
        data = workloads.asr_datamodule(Path(spec["corpus"]), spec["batch_size"], spec["seed"])
        harness.progress(f"features cached: {len(data.datasets['train'])} train / "
                         f"{len(data.datasets['test'])} test utterances")
        dist.barrier()
        harness.progress(f"calibrating the local step time ({spec['calibration_batches']} batches "
                         "per rank, no communication)")
        calib = _fit(w, data, None, 1, limit_batches=spec["calibration_batches"])
        local_step, sleep_s = straggling.calibrated_sleep(calib["median_step_s"], slow_rank,
                                                          spec["slowdown"])
        harness.progress(f"  local step {local_step * 1e3:.0f} ms on rank {slow_rank}; the "
                         f"straggler sleeps {sleep_s * 1e3:.0f} ms per step")
        runs: dict[str, Any] = {}
        for mode in spec["modes"]:
            for name in spec["strategies"]:
                dist.barrier()
                harness.progress(f"{name} / {mode}")
                slow = mode == "straggler" and w.rank == slow_rank
                res = runs[f"{name}/{mode}"] = _fit(w, data, name, spec["epochs"],
                                                    sleep_s=sleep_s if slow else 0.0)
                w.write({"rank": w.rank, "calibration": calib, "sleep_s": sleep_s,
                         "runs": runs}, name="partial_rank")
                dist.barrier()
                harness.progress(f"  done: steps per epoch on rank 0 {res['epoch_steps']}, "
                                 f"test WER {100 * res['test_wer']:.2f}%")
        w.write({"rank": w.rank, "calibration": calib, "sleep_s": sleep_s, "runs": runs})


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
def summarise(per: list[dict[str, Any]], slow_rank: int, epochs: int) -> dict[str, Any]:
    """One fit over all ranks: throughput, time per epoch, WER, batches per rank."""
    out = straggling.fit_throughput(per, slow_rank)
    out.update({
        "epoch_s": out["wall_s"] / epochs, "test_wer": per[0]["test_wer"],
        "last_epoch_steps_per_rank": [p["epoch_steps"][-1] for p in per],
        # adpsgd: exchanges and seconds the training thread waited for gossip (max_staleness)
        "gossip_stats_per_rank": [p.get("gossip_stats", {}) for p in per],
    })
    return out


def _parser() -> argparse.ArgumentParser:
    p = cli_args.parser("Utterances/s, time per epoch and test WER of the ASR recipe under ddp, "
                        "dpsgd and adpsgd on N CPU ranks, with equal ranks and with one rank 2x "
                        "slower.")
    cli_args.add_ranks(p)
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                   choices=STRATEGIES, help="adpsgd_nowait: max_staleness=None; adpsgd_delay: "
                   "delay_by_one=True; adpsgd_random: random pairing")
    cli_args.add_straggler_options(
        p, modes=MODES, slowdown="the straggler sleeps (slowdown - 1) x the calibrated local step",
        rank="which rank is slowed down")
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
    cli_args.add_adpsgd_kwargs(p, '{"max_staleness": 8}')
    cli_args.add_run_options(p, timeout=3600, out=DEFAULT_OUT,
                             quick="2 ranks, 48 utterances, a tiny model, 1 epoch (smoke test)")
    return p


def _corpus(args: argparse.Namespace) -> Path:
    """The synthetic corpus (generated once, cached)."""
    from recipes.asr.synth import CorpusConfig, generate_corpus

    config = CorpusConfig(seed=args.corpus_seed, num_train=args.num_train, num_dev=8,
                          num_test=args.num_test)
    t0 = time.time()
    corpus = generate_corpus(args.corpus, config, jobs=os.cpu_count() or 2, progress=False)
    print(f"corpus {corpus}: {args.num_train} train / {args.num_test} test utterances "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return Path(corpus)


def _rows(summary: dict[str, Any], keys: list[str]) -> list[list[Any]]:
    """The table's rows; adds ``over_ddp`` and ``wer_minus_ddp`` (to ddp in the same mode)."""
    rows = []
    for key in keys:
        name, mode = key.split("/")
        s = summary[key]
        ref = summary.get(f"ddp/{mode}")
        s["over_ddp"] = s["samples_per_s"] / ref["samples_per_s"] if ref else None
        s["wer_minus_ddp"] = 100 * (s["test_wer"] - ref["test_wer"]) if ref else None
        waits = ("/".join(f"{g.get('staleness_wait_s', 0):.0f}" for g in s["gossip_stats_per_rank"])
                 if name not in ("ddp", "dpsgd") else "-")
        rows.append([name, mode, s["samples_per_s"], s["over_ddp"] or float("nan"),
                     s["epoch_s"], f"{100 * s['test_wer']:.2f}%",
                     "/".join(str(n) for n in s["last_epoch_steps_per_rank"]),
                     s["straggler_step_ratio"], waits])
    return rows


def _markdown(args: argparse.Namespace, ranks: list[dict[str, Any]], rows: list[list[Any]],
              before: dict[str, Any], after: dict[str, Any], calib: float) -> str:
    md = [f"ASR recipe (BLSTM {args.layers}x{args.hidden}, CTC), synthetic corpus "
          f"({args.num_train} train / {args.num_test} test utterances, test voices unseen), "
          f"{args.ranks} ranks, per-rank batch {args.batch_size}, {args.epochs} epochs, one "
          f"round; straggler = rank {args.straggler_rank} sleeping "
          f"{ranks[0]['sleep_s'] * 1e3:.0f} ms per step ({args.slowdown - 1:g}x its calibrated "
          f"local step of {calib * 1e3:.0f} ms).",
          harness.describe_machine(before) + f" Load after: {after['loadavg_1_5_15']}.", "",
          harness.markdown_table(["strategy", "mode", "utterances/s", "x ddp", "s per epoch",
                                  "test WER", "batches per rank (last epoch)",
                                  f"rank-{args.straggler_rank} step / others", "staleness wait s"],
                                 rows)]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (driver), or one rank of it (``--worker``)."""
    p = _parser()
    args = cli_args.parse(p, argv, _worker)
    if args is None:
        return 0
    if args.quick:
        args.ranks, args.num_train, args.num_test, args.epochs = 2, 48, 16, 1
        args.layers, args.hidden, args.calibration_batches = 1, 16, 4
        if args.corpus == DEFAULT_CORPUS:
            args.corpus = DEFAULT_CORPUS.with_name("asr-bench-quick")
    cli_args.check_straggler_rank(p, args)
    corpus = _corpus(args)

    before = harness.machine_info()
    print(f"asr_straggler: {args.ranks} ranks, {args.strategies}, {args.modes}, BLSTM "
          f"{args.layers}x{args.hidden}, per-rank batch {args.batch_size}, {args.epochs} epochs; "
          f"load average {before['loadavg_1_5_15']}", file=sys.stderr)
    spec = cli_args.spec_of(args, ("strategies", "modes", "slowdown", "straggler_rank", "layers",
                                   "hidden", "batch_size", "epochs", "lr", "warmup_steps",
                                   "anneal_start_epoch", "anneal_factor", "calibration_batches",
                                   "seed", "adpsgd_kwargs"))
    spec["corpus"] = str(corpus)
    ranks, wall = harness.timed_launch("benchmarks.perf.asr_straggler", spec, args.ranks,
                                       args.out.parent / f".{args.out.stem}_work", args.timeout)
    after = harness.machine_info()
    keys = [f"{s}/{m}" for m in args.modes for s in args.strategies]
    summary = {k: summarise([r["runs"][k] for r in ranks], args.straggler_rank, args.epochs)
               for k in keys}
    rows = _rows(summary, keys)
    calib = ranks[args.straggler_rank]["calibration"]["median_step_s"]
    text = _markdown(args, ranks, rows, before, after, calib)
    print(text)
    harness.write_json(args.out, {
        "benchmark": "asr_straggler", "quick": args.quick, "config": cli_args.config_of(args),
        "machine": before, "loadavg_after": after["loadavg_1_5_15"], "launch_wall_s": wall,
        "sleep_s": ranks[0]["sleep_s"], "calibrated_local_step_s": calib, "runs": summary,
        "markdown": text,
    })
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
