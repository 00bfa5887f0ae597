"""The project demo: synthesize a speech corpus once, train the BLSTM-CTC recipe, report test WER.

    python -m recipes.asr.demo                      # AD-PSGD on 4 CPU processes
    python -m recipes.asr.demo --strategy dpsgd     # or ddp, for comparison

Step 1 writes the espeak-ng corpus to ``data/asr-synth`` (skipped when it is already there);
step 2 runs ``python -m recipes.asr fit --config recipes/asr/configs/synth.yaml`` with
``--test_after_fit true``; then the test WER on unseen voices, the report and the logs are
printed, with how many training batches each rank processed in the last epoch (under ``adpsgd``
faster ranks take more of them). Extra arguments are passed on to the CLI
(``--trainer.max_epochs=3``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recipes.asr.synth import CorpusConfig, generate_corpus

CONFIG = Path(__file__).resolve().parent / "configs" / "synth.yaml"


def batches_per_rank(numbers: dict[str, Any]) -> str | None:
    """How many training batches each rank processed in the last epoch, as one line.

    >>> print(batches_per_rank({"train_batches_last_epoch": [80, 41, 90, 89]}))
    batches in the last training epoch: rank 0: 80, rank 1: 41, rank 2: 90, rank 3: 89 (300)
    >>> batches_per_rank({"wer": 0.1}) is None
    True
    """
    counts = numbers.get("train_batches_last_epoch")
    if not counts:
        return None
    known = [n for n in counts if n is not None]
    per_rank = ", ".join(f"rank {r}: {'?' if n is None else n}" for r, n in enumerate(counts))
    return f"batches in the last training epoch: {per_rank} ({sum(known)})"


def summary(numbers: dict[str, Any], report_dir: Path, logs: Path, out: Path,
            minutes: float) -> str:
    """The block printed at the end of the demo: test WER, batches per rank, where things are."""
    lines = [
        "=" * 72,
        f"test WER on unseen voices: {100 * numbers['wer']:.2f}%  ({numbers['substitutions']} S"
        f" / {numbers['deletions']} D / {numbers['insertions']} I over "
        f"{numbers['reference_words']} words, {numbers['utterances']} utterances)",
    ]
    batches = batches_per_rank(numbers)
    if batches is not None:
        lines.append(batches)
    lines += [
        f"report:      {report_dir / 'wer_report.txt'}",
        f"logs:        {logs}   (tensorboard --logdir {out / 'logs'})",
        f"checkpoints: {logs / 'checkpoints'}",
        f"total time:  {minutes:.1f} min",
        "=" * 72,
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the training process's exit code."""
    parser = argparse.ArgumentParser(prog="python -m recipes.asr.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="adpsgd",
                        help="Lightning strategy name: adpsgd (default), dpsgd, ddp, ...")
    parser.add_argument("--devices", type=int, default=4, help="CPU processes")
    parser.add_argument("--data", default="data/asr-synth", help="corpus directory (cached)")
    parser.add_argument("--out", default="runs/asr-demo", help="logs, checkpoints, report")
    parser.add_argument("--corpus-seed", type=int, default=0)
    args, cli_args = parser.parse_known_args(argv)

    started = time.monotonic()
    corpus = CorpusConfig(seed=args.corpus_seed)
    print(f"[1/2] corpus: {corpus.num_train} train / {corpus.num_dev} dev / {corpus.num_test} "
          f"test utterances in {args.data} (test voices are not in training)", flush=True)
    data = generate_corpus(args.data, corpus, jobs=os.cpu_count() or 2)

    out = Path(args.out)
    report_dir = out / "report"
    (report_dir / "wer.json").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "recipes.asr", "fit", "--config", str(CONFIG),
           f"--trainer.strategy={args.strategy}", f"--trainer.devices={args.devices}",
           f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}",
           f"--data.train_dir={data / 'train'}", f"--data.val_dir={data / 'dev'}",
           f"--data.test_dir={data / 'test'}", f"--model.report_dir={report_dir}",
           "--test_after_fit=true", *cli_args]
    print(f"[2/2] training with strategy={args.strategy} on {args.devices} CPU processes:\n  "
          + " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    code = subprocess.call(cmd, env=env)
    minutes = (time.monotonic() - started) / 60
    if code != 0 or not (report_dir / "wer.json").is_file():
        print(f"training failed (exit code {code}) after {minutes:.1f} min", file=sys.stderr)
        return code or 1
    numbers = json.loads((report_dir / "wer.json").read_text())
    versions = sorted((out / "logs").glob("version_*"), key=lambda p: p.stat().st_mtime)
    logs = versions[-1] if versions else out
    print("\n" + summary(numbers, report_dir, logs, out, minutes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
