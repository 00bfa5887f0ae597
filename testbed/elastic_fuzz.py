"""A fuzzed campaign of lost ranks in elastic ``adpsgd`` (and ``dpsgd``) fits: does every fit
finish, with every sample once per epoch, no hang and no orphan process?

Each run starts ``testbed.elastic_fit`` on 3 or 4 tasks (as ``srun`` starts them) and loses one
of them: a random victim (never rank 0, whose loss falls back to the emergency checkpoint by
design: ``tests/test_elastic.py``), kind (``SIGKILL``; ``SIGSTOP``: frozen, killed after the
recovery; or frozen and woken up after it, when it must exit on its own), epoch (0 or 1), batch
(1..10) and, given several ``--strategies``, the strategy; ``--pairs P``: a share ``P`` of the
cases kills two of 4 ranks at the same batch instead (a node's tasks); ``--nodes N``:
hierarchical fits (of the ``--strategies``) on ``N`` nodes of 2 ranks, the victim off node 0,
its node leaving with it (its node-mate must exit, RankExcluded; it is not checked as a
survivor). Recorded per run: the
exit codes, whether every survivor ended with 0 after writing its results, whether every
process ended with the status it must have (:func:`expected_statuses`: a survivor 0, a killed
victim -9, a woken one and its node-mates 1; ``statuses_ok``) and the number of aborts at exit
seen in the output (``aborts``: must be 0), the detection, recovery and
stall seconds (:func:`testbed.elastic_fit.outcome`), the wall time, and the processes of the
run still alive after the launch (orphans); the output is kept in ``RUN/log.txt``. Usage::

    python -m testbed.elastic_fuzz --runs 30 --seed 0 --out /tmp/elastic_fuzz
    python -m testbed.elastic_fuzz --runs 30 --strategies adpsgd dpsgd --out /tmp/both
    python -m testbed.elastic_fuzz --runs 30 --nodes 3 --out /tmp/nodes  # 3 nodes x 2
    python -m testbed.elastic_fuzz --runs 16 --nodes 3 --strategies dpsgd --out /tmp/dnodes

One JSON line per run on stdout (and in ``OUT/runs.jsonl``), then a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from lightning_gossip.hierarchy import NodeLayout
from testbed.elastic_fit import BATCH_SIZE, SAMPLES, outcome
from testbed.launch import fake_slurm_commands, launch_processes

EXIT_ABORT = "terminate called without an active exception"
"""What a process that dies of ``SIGABRT`` at exit prints (issue 48: never accepted)."""


def fit_layout(case: dict[str, Any]) -> NodeLayout:
    """The case's nodes, seen from rank 0 (one node: each rank alone, a flat fit)."""
    nodes, ranks = case.get("nodes", 1), case["ranks"]
    return NodeLayout(nodes, ranks // nodes, 0, 0) if nodes > 1 else NodeLayout.flat(ranks, 0)


def expected_statuses(case: dict[str, Any], lost: bool) -> list[int]:
    """The exit status each process of ``case`` must end with: 0 for a survivor (and for every
    rank when the victim never reached its batch, ``lost`` false); a victim killed (``kill``,
    or ``stop``: frozen, then killed by the lowest survivor) -9; a victim woken up after the
    recovery (``cont``) 1 (``RankExcluded``), as its node-mates that left with it (a
    hierarchical fit)."""
    victims = case["victim"] if isinstance(case["victim"], list) else [case["victim"]]
    codes = [0] * case["ranks"]
    if not lost:
        return codes
    for r in fit_layout(case).whole_nodes(victims):
        codes[r] = 1  # a node-mate: RankExcluded
    for r in victims:
        codes[r] = 1 if case["kind"] == "cont" else -9
    return codes


def orphans(out: Path) -> list[int]:
    """Processes whose command line names ``out`` (a run's folder), still alive."""
    found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split() if int(pid) != os.getpid()]


def fuzz_case(rng: random.Random, strategies: tuple[str, ...] = ("adpsgd",),
              pairs: float = 0.0, nodes: int = 1) -> dict[str, Any]:
    """One random loss: ``ranks``, ``victim``, ``kind``, ``epoch``, ``batch``, ``strategy``
    (drawn last, and only from several: one strategy draws the cases it always drew); with
    probability ``pairs`` (drawn after them), two ranks of 4 killed at the same batch instead,
    as a node's tasks die (``victim`` a list). ``nodes`` > 1: hierarchical fits on that
    many nodes of 2 ranks, the victim any rank off node 0 (its node leaves with it), at a batch
    every rank reaches (1..10 on 2 nodes, 1..6 on 3: a rank's share of an epoch, less 2)."""
    if nodes > 1:
        ranks, share = 2 * nodes, SAMPLES // BATCH_SIZE // (2 * nodes)
        case = {"ranks": ranks, "nodes": nodes, "victim": rng.randrange(2, ranks),
                "kind": rng.choice(("kill", "stop", "cont")), "epoch": rng.randrange(2),
                "batch": rng.randrange(1, share - 1)}
        case["strategy"] = rng.choice(strategies) if len(strategies) > 1 else strategies[0]
        return case
    ranks = rng.choice((3, 4))
    case = {"ranks": ranks, "victim": rng.randrange(1, ranks),
            "kind": rng.choice(("kill", "stop", "cont")),
            "epoch": rng.randrange(2), "batch": rng.randrange(1, 11)}
    case["strategy"] = rng.choice(strategies) if len(strategies) > 1 else strategies[0]
    if pairs and rng.random() < pairs:
        case.update(ranks=4, victim=sorted(rng.sample(range(1, 4), 2)), kind="kill")
    return case


def run_case(out: Path, case: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Launch one case in ``out``; what happened (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    victims = case["victim"] if isinstance(case["victim"], list) else [case["victim"]]
    nodes = case.get("nodes", 1)
    commands = fake_slurm_commands("testbed.elastic_fit", str(out), ",".join(map(str, victims)),
                                   str(case["batch"]), case["kind"], str(case["epoch"]),
                                   ntasks=case["ranks"], nodes=nodes,
                                   env={"ELASTIC_FIT_STRATEGY": case.get("strategy", "adpsgd"),
                                        "ELASTIC_FIT_NODES": str(nodes)})
    start = time.monotonic()
    launched = launch_processes(commands, timeout)
    result: dict[str, Any] = dict(case, wall_s=round(time.monotonic() - start, 1),
                                  codes=launched.returncodes, hang=launched.timed_out,
                                  orphans=orphans(out))
    left = tuple(r for r in fit_layout(case).whole_nodes(victims)  # node-mates leave too
                 if r not in victims)
    survivors = [r for r in range(case["ranks"]) if r not in victims and r not in left]
    result["finished"] = not launched.timed_out and all(
        launched.returncodes[r] == 0 and (out / f"done{r}.json").exists() for r in survivors)
    (out / "log.txt").write_text(launched.stdout)
    result["lost"] = (out / "victim.json").exists()  # (the victim reached its batch)
    result["expected"] = expected_statuses(case, result["lost"])
    result["statuses_ok"] = launched.returncodes == result["expected"]
    result["aborts"] = launched.stdout.count(EXIT_ABORT)
    if result["finished"] and result["lost"]:
        result.update(outcome(out, case["ranks"], case["victim"], left))
    return result


def main() -> None:
    """Run the campaign (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", nargs="+", choices=("adpsgd", "dpsgd"),
                        default=["adpsgd"])
    parser.add_argument("--pairs", type=float, default=0.0,
                        help="share of cases that kill two ranks at the same batch")
    parser.add_argument("--nodes", type=int, default=1,
                        help="hierarchical fits on this many nodes of 2 ranks (> 1)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with open(args.out / "runs.jsonl", "a") as log:
        for i in range(args.runs):
            case = fuzz_case(rng, tuple(args.strategies), args.pairs, args.nodes)
            result = dict(run_case(args.out / f"run{i}", case), run=i)
            results.append(result)
            line = json.dumps(result)
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
    good = [r for r in results if r["finished"]]
    print(json.dumps({
        "runs": len(results), "finished": len(good), "lost": sum(r["lost"] for r in results),
        "hangs": sum(r["hang"] for r in results),
        "orphans": sum(len(r["orphans"]) for r in results),
        "statuses_ok": sum(r["statuses_ok"] for r in results),
        "aborts": sum(r["aborts"] for r in results),
        "once": sum(bool(r.get("once")) for r in good),
        "same_replica": sum(bool(r.get("same_replica")) for r in good),
        "stall_s_max": max((r["stall_s"] for r in good), default=None),
    }), flush=True)


if __name__ == "__main__":
    main()
