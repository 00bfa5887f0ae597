"""Parity on the ASR demo, re-measured on one commit with the logs kept.

Does the per-learner learning-rate rule compensate Adam's noise under gossip, or does a higher
rate help every method? Each of ``ddp``, ``dpsgd`` and ``adpsgd`` trains the demo (the recipe's
``configs/synth.yaml``, as ``python -m recipes.asr.demo`` runs it) at **ddp's rate** (the
config's ``model.lr``; gossip with ``gossip_lr_rule=none``) and at **the rule's rate**
(``model.lr`` x sqrt(ranks) under Adam; ddp given it directly, gossip by ``gossip_lr_rule=auto``),
for every seed of ``--seeds`` (``seed_everything`` and the data order's seed). Per run the
record keeps the command, the effective peak rate, the dev WER after every epoch (a CSV
logger's ``val_wer``), the test WER of the best-dev checkpoint and the log, next to the JSON
(``<out>.logs/<run>.log``). Runs are appended to the JSON as they finish; a run already in it
is skipped, so a stopped session goes on where it stopped. All runs must come from one commit
(the JSON's; a clean tree), else the script refuses.

    python -m benchmarks.perf.parity_demo                       # 3 strategies x 2 rates x 2 seeds
    python -m benchmarks.perf.parity_demo --seeds 1234 --strategies ddp adpsgd   # a part

On the demo machine (2 cores) one run takes 10-25 minutes: the full set, 12 runs, 2-5 hours.
``--quick`` (the test's size) trains 2 batches of 1 epoch on 2 processes of a corpus given by
``--data`` (already generated).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from testbed.launch import ROOT

CONFIG = ROOT / "recipes" / "asr" / "configs" / "synth.yaml"
OUT = ROOT / "benchmarks" / "results" / "parity" / "demo_parity.json"
QUICK = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
         "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1",
         "--data.cmvn_utterances=16"]
"""Overrides of ``--quick``: a smoke run of the same code path."""


def config_lr() -> float:
    """The demo's peak rate under ddp (``model.lr`` of ``configs/synth.yaml``)."""
    return float(yaml.safe_load(CONFIG.read_text())["model"]["lr"])


def plan(strategies: list[str], seeds: list[int], devices: int,
         base_lr: float) -> list[dict[str, Any]]:
    """Every run: strategy, rate ("ddp" or "rule"), seed, effective peak rate, CLI overrides.

    >>> [(r["name"], r["lr"]) for r in plan(["ddp", "adpsgd"], [1], 4, 0.006)]
    [('ddp_ddprate_seed1', 0.006), ('ddp_rulerate_seed1', 0.012), \
('adpsgd_ddprate_seed1', 0.006), ('adpsgd_rulerate_seed1', 0.012)]
    """
    factor = math.sqrt(devices)  # Adam, one learner per rank (the demo is not hierarchical)
    runs = []
    for seed in seeds:
        for strategy in strategies:
            for rate in ("ddp", "rule"):
                lr = base_lr * (factor if rate == "rule" else 1.0)
                if strategy == "ddp":
                    overrides = [f"--model.lr={lr:g}"]
                else:  # the rule gives gossip its rate; "none" keeps ddp's
                    overrides = [f"--model.lr={base_lr:g}", "--model.gossip_lr_rule="
                                 + ("auto" if rate == "rule" else "none")]
                runs.append({"name": f"{strategy}_{rate}rate_seed{seed}", "strategy": strategy,
                             "rate": rate, "seed": seed, "lr": float(f"{lr:.6g}"),
                             "overrides": [*overrides, f"--seed_everything={seed}",
                                           f"--data.seed={seed}"]})
    return runs


def table(rec: dict[str, Any]) -> str:
    """The record as a Markdown table: per strategy and rate, the peak rate and each seed's
    test WER (%) of the best-dev checkpoint and last dev WER; failed runs marked, missing ones
    a dash.

    >>> print(table({"runs": [{"strategy": "ddp", "rate": "ddp", "seed": 1, "lr": 0.006,
    ...                        "test_wer": 2.27, "dev_wer": [9.0, 4.26]}]}))
    | strategy | peak rate | test WER %, seed 1 | last dev WER %, seed 1 |
    |---|---|---:|---:|
    | ddp | ddp's (0.006) | 2.27 | 4.26 |
    """
    runs = rec["runs"]
    seeds = sorted({r["seed"] for r in runs})
    head = ("| strategy | peak rate | " + " | ".join(f"test WER %, seed {s}" for s in seeds)
            + " | " + " | ".join(f"last dev WER %, seed {s}" for s in seeds) + " |")
    lines = [head, "|---|---|" + "---:|" * 2 * len(seeds)]
    def cell(run: dict[str, Any] | None, what: str) -> str:
        if run is None:
            return "-"
        value = run["test_wer"] if what == "test" else (run["dev_wer"] or [None])[-1]
        return "failed" if value is None else f"{value:.2f}"

    for strategy, rate in dict.fromkeys((r["strategy"], r["rate"]) for r in runs):
        mine = {r["seed"]: r for r in runs if (r["strategy"], r["rate"]) == (strategy, rate)}
        lr = next(iter(mine.values()))["lr"]
        lines.append(f"| {strategy} | {'the rule' if rate == 'rule' else 'ddp'}'s ({lr:g}) | "
                     + " | ".join(cell(mine.get(s), "test") for s in seeds) + " | "
                     + " | ".join(cell(mine.get(s), "dev") for s in seeds) + " |")
    return "\n".join(lines)


def git_commit() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()

    return {"sha": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def dev_wer_per_epoch(run_dir: Path) -> list[float]:
    """``val_wer`` (%) after every epoch, from the CSV logger's ``metrics.csv``."""
    files = sorted(run_dir.glob("logs/version_*/metrics.csv"))
    if not files:
        return []
    out = []
    with open(files[-1]) as f:
        for row in csv.DictReader(f):
            if row.get("val_wer"):
                out.append(round(100 * float(row["val_wer"]), 2))
    return out


def command(run: dict[str, Any], args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The demo's training command (``recipes.asr.demo`` step 2) with the run's overrides."""
    data = Path(args.data)
    return [sys.executable, "-m", "recipes.asr", "fit", "--config", str(CONFIG),
            f"--trainer.strategy={run['strategy']}", f"--trainer.devices={args.devices}",
            f"--trainer.default_root_dir={run_dir}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={run_dir}", "--trainer.logger.name=logs",
            f"--data.train_dir={data / 'train'}", f"--data.val_dir={data / 'dev'}",
            f"--data.test_dir={data / 'test'}", f"--model.report_dir={run_dir / 'report'}",
            "--test_after_fit=true", *run["overrides"], *(QUICK if args.quick else [])]


def main(argv: list[str] | None = None) -> int:
    """Run the missing runs of the plan; 0 when all finished, 1 when one failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", nargs="+", default=["ddp", "dpsgd", "adpsgd"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    p.add_argument("--devices", type=int, default=4, help="CPU processes (the demo's 4)")
    p.add_argument("--data", default=str(ROOT / "data" / "asr-synth"),
                   help="the demo's corpus (generated here when missing, as the demo does)")
    p.add_argument("--out", type=Path, default=OUT, help="the JSON; logs in <out>.logs/")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "parity",
                   help="checkpoints and reports (not kept in the repository)")
    p.add_argument("--quick", action="store_true", help="the test's size (see the docstring)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run from a tree with uncommitted changes (recorded)")
    args = p.parse_args(argv)
    here = git_commit()
    if here["dirty"] and not args.allow_dirty:
        print("parity demo: the tree has uncommitted changes; commit first (or --allow-dirty)",
              file=sys.stderr)
        return 2
    rec: dict[str, Any] = {"what": __doc__.split("\n\n")[0], "config": str(CONFIG.relative_to(
        ROOT)), "base_lr": config_lr(), "devices": args.devices, "commit": here,
        "quick": args.quick, "runs": []}
    if args.out.exists():
        rec = json.loads(args.out.read_text())
        if rec["commit"]["sha"] != here["sha"]:
            print(f"parity demo: {args.out} holds runs of {rec['commit']['sha'][:10]}, this is "
                  f"{here['sha'][:10]}: one commit per record (give another --out)",
                  file=sys.stderr)
            return 2
    if not args.quick:
        from recipes.asr.synth import CorpusConfig, generate_corpus

        generate_corpus(args.data, CorpusConfig(seed=0), jobs=os.cpu_count() or 2)
    logs = args.out.with_name(args.out.name + ".logs")
    logs.mkdir(parents=True, exist_ok=True)
    done = {r["name"] for r in rec["runs"]}
    failed = 0
    for run in plan(args.strategies, args.seeds, args.devices, rec["base_lr"]):
        if run["name"] in done:
            continue
        run_dir = args.runs_dir / run["name"]
        cmd = command(run, args, run_dir)
        log = logs / f"{run['name']}.log"
        print(f"[parity {time.strftime('%H:%M:%S')}] {run['name']} (lr {run['lr']:g})",
              flush=True)
        t0 = time.time()
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with open(log, "w") as f:
            code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        report = run_dir / "report" / "wer.json"
        numbers = json.loads(report.read_text()) if code == 0 and report.exists() else None
        failed += numbers is None
        rec["runs"].append({
            **{k: run[k] for k in ("name", "strategy", "rate", "seed", "lr")},
            "command": [Path(cmd[0]).name, *cmd[1:]], "exit_code": code,
            "dev_wer": dev_wer_per_epoch(run_dir),
            "test_wer": None if numbers is None else round(100 * numbers["wer"], 2),
            "log": str(log.relative_to(args.out.parent)), "wall_s": round(time.time() - t0),
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())})
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        tmp.replace(args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
