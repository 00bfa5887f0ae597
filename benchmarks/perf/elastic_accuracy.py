"""Does a lost rank cost accuracy? An elastic fit that loses one of 4 ranks at mid-run, against
the same fit without a loss, per workload and seed (issue 31's goal: within 0.5 points).

Each pair runs ``benchmarks.perf.elastic_accuracy_rank`` twice on 4 ranks started as ``srun``
starts tasks (gloo, loopback, ``heartbeat_timeout=5``): rank 2 ``SIGKILL``\\ ed at batch 10 of
the middle epoch, then (or first, alternating by seed) nobody lost. The workloads: ``digits``
(an MLP on scikit-learn's digits, 16 epochs, test top-1 % of the averaged replica) and ``asr`` (the
recipe's own CLI with the demo's config, 10 epochs, on the race's 1600-utterance corpus; the
last epoch's dev WER %). The record keeps every fit's metric, steps and time, and per pair the
difference (lost minus unfailed, in points; positive: worse for WER, better for top-1).

Usage::

    python -m benchmarks.perf.elastic_accuracy                   # digits and asr, seeds 1 2
    python -m benchmarks.perf.elastic_accuracy --workloads digits --seeds 1 --out /tmp/a.json
    python -m benchmarks.perf.elastic_accuracy --nodes 3 --workloads digits  # 3 nodes x 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.harness import describe_machine, machine_info, progress, write_json
from benchmarks.perf.elastic_accuracy_rank import ASR_CORPUS, HEARTBEAT_S, LOSS_BATCH
from lightning_gossip.hierarchy import NodeLayout
from testbed.launch import ROOT, run_fake_slurm_each

RANKS, VICTIM = 4, 2
OUT = ROOT / "benchmarks" / "results" / "elastic" / "accuracy.json"
GOAL_POINTS = 0.5


def fit(folder: Path, workload: str, seed: int, victim: int, strategy: str,
        nodes: int = 1) -> dict[str, Any]:
    """One fit; rank 0's result (raises when a survivor failed). ``nodes`` > 1: hierarchical
    on that many nodes of 2 ranks (the victim's node-mate leaves with it)."""
    folder.mkdir(parents=True)
    t0 = time.time()
    ranks = RANKS if nodes == 1 else 2 * nodes
    launched = run_fake_slurm_each("benchmarks.perf.elastic_accuracy_rank", str(folder), workload,
                                   str(seed), str(victim), strategy, ntasks=ranks, nodes=nodes,
                                   timeout=1800)
    codes = launched.returncodes
    layout = NodeLayout(nodes, 2, 0, 0) if nodes > 1 else NodeLayout.flat(ranks, 0)
    gone = set(layout.whole_nodes([victim]))  # its node leaves with it
    if any(codes[r] != 0 for r in range(ranks) if r not in gone):
        log = Path(tempfile.gettempdir()) / f"elastic_accuracy_{folder.name}.log"
        log.write_text(launched.stdout)  # (the folder is temporary: the whole output kept)
        raise RuntimeError(f"a survivor failed ({codes}; the output: {log}):\n"
                           f"{launched.stdout[-4000:]}")
    result = json.loads((folder / "result.json").read_text())
    return dict(result, codes=codes, wall_s=round(time.time() - t0, 1))


def gap(lost: dict[str, Any], whole: dict[str, Any]) -> float:
    """Points the lost rank cost: positive is worse (higher WER, lower top-1).

    >>> gap({"value": 3.5, "higher_is_better": False}, {"value": 3.0})
    0.5
    >>> gap({"value": 95.0, "higher_is_better": True}, {"value": 95.5})
    0.5
    """
    sign = -1.0 if lost["higher_is_better"] else 1.0
    return round(sign * (lost["value"] - whole["value"]), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=("digits", "asr"),
                        default=["digits", "asr"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--strategy", choices=("adpsgd", "dpsgd"), default="adpsgd")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--nodes", type=int, default=1,
                        help="hierarchical, on this many nodes of 2 ranks (rank 3 lost)")
    args = parser.parse_args()
    victim = VICTIM if args.nodes == 1 else 3  # (3: a rank off node 0, whose rank 0 must live)
    if "asr" in args.workloads:  # the race's corpus (reused when it is there, as the race does)
        from recipes.asr.synth import CorpusConfig, generate_corpus

        generate_corpus(ASR_CORPUS, CorpusConfig(seed=0, num_train=1600, num_dev=128, num_test=8),
                        jobs=2, progress=False)
    fits: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            for seed in args.seeds:
                order = (victim, -1) if seed % 2 else (-1, victim)
                got = {}
                for lost in order:
                    progress(f"{workload} seed {seed} victim {lost} ({args.strategy})")
                    got[lost] = fit(Path(tmp) / f"{workload}_{seed}_{lost}", workload, seed,
                                    lost, args.strategy, args.nodes)
                    fits.append(got[lost])
                    progress(json.dumps(got[lost]))
                pairs.append({"workload": workload, "seed": seed, "metric": got[-1]["metric"],
                              "unfailed": got[-1]["value"], "lost": got[victim]["value"],
                              "cost_points": gap(got[victim], got[-1]),
                              "within_goal": abs(gap(got[victim], got[-1])) <= GOAL_POINTS})
    info = machine_info()
    write_json(args.out, {
        "what": __doc__.split("\n\n")[0], "strategy": args.strategy,
        "ranks": RANKS if args.nodes == 1 else 2 * args.nodes, "nodes": args.nodes,
        "victim": victim, "loss_at": f"batch {LOSS_BATCH} of the middle epoch",
        "heartbeat_timeout_s": HEARTBEAT_S, "goal_points": GOAL_POINTS,
        "machine": info, "machine_text": describe_machine(info), "fits": fits, "pairs": pairs})
    for p in pairs:
        print(json.dumps(p))


if __name__ == "__main__":
    main()
