"""The exit-status soak (issue 48): many fits, every process's exit status checked against the
outcome it must have; no process may die of a signal it did not get (``SIGABRT`` at exit:
"terminate called without an active exception").

Cases, drawn in turn (:data:`KINDS`), each with a seeded variation:

* ``elastic``: an elastic fit of ``testbed.elastic_fit`` started as ``srun`` starts tasks, a rank
  (not 0) killed, frozen and killed, or frozen and woken after the survivors' recovery; flat (3-4
  ranks) or hierarchical (2 nodes of 2), ``adpsgd`` or ``dpsgd``
  (:func:`testbed.elastic_fuzz.run_case`). Expected: survivors 0, a killed victim -9, a woken
  victim and a lost rank's node-mates 1 (``RankExcluded``).
* ``plain-srun``: a plain (not elastic) fit of ``tests/scripts/restart_ranks.py`` on 2 ranks, or
  hierarchical on 2 nodes of 2, started as ``srun`` starts tasks: every process 0.
* ``plain-torchrun``: the same under ``torchrun --max-restarts 2``: torchrun 0, every rank
  started training once (round 0: a restart would mean a worker's status was not 0).
* ``plain-lightning``: the same started once, Lightning's own launcher starting the other rank:
  0 (and rank 1's output, printed by the same launch, without an abort).
* ``raise``: the plain fit on 2 or 3 ranks (``srun``) with one rank raising a ``RuntimeError`` at
  a seeded step: every process 1 (the others fail naming it), the message in the output.

Usage::

    python -m testbed.exit_soak --fits 200 --seed 0 --out /tmp/exit_soak \\
        --record benchmarks/results/exit_soak/soak_200.json

``--kinds elastic --elastic hier-adpsgd`` draws only hierarchical ``adpsgd`` losses (2 nodes of
2; the kind of seed 2's fit 24, where node-mates entered different node collectives).

One JSON line per fit on stdout (and in ``OUT/fits.jsonl``); the record (commit, date, machine,
counts, the failing fits) is rewritten after every fit, so an interrupted soak keeps its count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from testbed.elastic_fuzz import EXIT_ABORT, orphans, run_case
from testbed.launch import (
    ROOT,
    base_env,
    fake_slurm_commands,
    free_port,
    launch_processes,
    parse_events,
)

SCRIPT = ROOT / "tests/scripts/restart_ranks.py"
KINDS = ("elastic", "plain-srun", "plain-torchrun", "elastic", "plain-lightning", "raise")
"""The order cases are drawn in (elastic twice: its losses vary most)."""
TIMEOUT_S = 300.0


DRAWS = ("any", "hier-adpsgd")
"""What ``--elastic`` may restrict the elastic draw to: ``hier-adpsgd``, a hierarchical
``adpsgd`` loss only (the kind of seed 2's fit 24)."""


def elastic_case(rng: random.Random, draw: str = "any") -> dict[str, Any]:
    """An elastic loss: the fuzz's draw, flat or hierarchical (2 nodes), either strategy
    (``draw``: one of :data:`DRAWS`; ``any`` draws as before, seed for seed)."""
    strategy = rng.choice(("adpsgd", "dpsgd"))
    kind = rng.choice(("kill", "stop", "cont"))
    if draw == "hier-adpsgd" or rng.random() < 0.3:
        return {"ranks": 4, "nodes": 2, "victim": rng.randrange(2, 4), "kind": kind,
                "epoch": rng.randrange(2), "batch": rng.randrange(1, 9),
                "strategy": "adpsgd" if draw == "hier-adpsgd" else strategy}
    ranks = rng.choice((3, 4))
    return {"ranks": ranks, "victim": rng.randrange(1, ranks), "kind": kind,
            "epoch": rng.randrange(2), "batch": rng.randrange(1, 11), "strategy": strategy}


def _spec(out: Path, rng: random.Random, **extra: Any) -> Path:
    spec = {"strategy": rng.choice(("adpsgd", "dpsgd")), "samples": 128, "epochs": 2,
            "checkpoint_dir": str(out / "ckpt"), "heartbeat_timeout": 10.0, "timeout": 120.0,
            **extra}
    path = out / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def plain_case(out: Path, kind: str, rng: random.Random) -> dict[str, Any]:
    """Launch a plain fit (``kind``: see the module docstring); what happened."""
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"kind": kind}
    if kind == "plain-torchrun":
        spec = _spec(out, rng)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               "--max-restarts=2", str(SCRIPT), str(spec)]
        commands = [(cmd, base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))]
        expected = [0]
    elif kind == "plain-lightning":
        spec = _spec(out, rng)
        commands = [([sys.executable, str(SCRIPT), str(spec)],
                     base_env(MASTER_PORT=str(free_port())))]
        expected = [0]
    elif kind == "raise":
        ranks = rng.choice((2, 3))
        # a step every rank reaches: under adpsgd the shared cursor gives ranks unequal shares
        bad = {"rank": rng.randrange(ranks), "step": rng.randrange(2, 5)}
        spec = _spec(out, rng, **{"raise": bad})
        commands = fake_slurm_commands(SCRIPT, str(spec), ntasks=ranks)
        expected = [1] * ranks
        record["raise"] = bad
    else:  # plain-srun: flat on 2 ranks, or hierarchical on 2 nodes of 2
        nodes = rng.choice((1, 2))
        spec = _spec(out, rng, **({"hierarchical": True, "nodes": 2} if nodes == 2 else {}))
        commands = fake_slurm_commands(SCRIPT, str(spec), ntasks=2 * nodes, nodes=nodes)
        expected = [0] * (2 * nodes)
        record["nodes"] = nodes
    record["strategy"] = json.loads(spec.read_text())["strategy"]
    start = time.monotonic()
    launched = launch_processes(commands, TIMEOUT_S)
    text = launched.stdout
    (out / "log.txt").write_text(text)
    events = parse_events(text)
    ok = launched.returncodes == expected and not launched.timed_out
    if kind == "plain-torchrun":  # trained once per rank, in round 0
        starts = sorted((e["rank"], e["restart"]) for e in events if e["event"] == "start")
        record["starts"] = starts
        ok = ok and starts == [(0, 0), (1, 0)]
    if kind == "raise":
        ok = ok and f"injected failure on rank {record['raise']['rank']}" in text
    record.update(codes=launched.returncodes, expected=expected, hang=launched.timed_out,
                  aborts=text.count(EXIT_ABORT), wall_s=round(time.monotonic() - start, 1),
                  orphans=orphans(out))
    record["statuses_ok"] = ok and record["aborts"] == 0 and not record["orphans"]
    return record


def one_fit(out: Path, kind: str, rng: random.Random, draw: str = "any") -> dict[str, Any]:
    """One fit of ``kind``: its record, ``statuses_ok`` the verdict (``draw``: the elastic
    draw's, :func:`elastic_case`)."""
    if kind != "elastic":
        return plain_case(out, kind, rng)
    case = elastic_case(rng, draw)
    result = run_case(out, case, timeout=TIMEOUT_S)
    result["kind"] = "elastic"
    result["statuses_ok"] = bool(result["statuses_ok"] and result["aborts"] == 0
                                 and not result["hang"] and not result["orphans"])
    keep = ("kind", "strategy", "ranks", "nodes", "victim", "epoch", "batch", "codes",
            "expected", "statuses_ok", "aborts", "hang", "orphans", "lost", "wall_s",
            "detect_s", "stall_s")
    return {k: result[k] for k in keep if k in result} | {"loss": case["kind"]}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summary(fits: list[dict[str, Any]], started: str, seed: int,
            commit: str) -> dict[str, Any]:
    """The record: commit, date, machine and counts (per kind), with the failing fits."""
    per_kind: dict[str, dict[str, int]] = {}
    for f in fits:
        name = f["kind"] if f["kind"] != "elastic" else (
            f"elastic-{f.get('strategy')}-{'hier' if f.get('nodes') else 'flat'}-{f['loss']}")
        k = per_kind.setdefault(name, {"fits": 0, "statuses_ok": 0})
        k["fits"] += 1
        k["statuses_ok"] += bool(f["statuses_ok"])
    return {
        "what": "testbed.exit_soak: every process's exit status against the expected one",
        "commit": commit, "started": started,
        "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_avg": [round(v, 2) for v in os.getloadavg()]},
        "seed": seed, "fits": len(fits),
        "statuses_ok": sum(bool(f["statuses_ok"]) for f in fits),
        "aborts": sum(f["aborts"] for f in fits),
        "hangs": sum(bool(f["hang"]) for f in fits),
        "per_kind": per_kind,
        "failing": [f for f in fits if not f["statuses_ok"]],
    }


def main() -> None:
    """Run the soak (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fits", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--record", type=Path, help="the JSON record (rewritten per fit)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="the kinds drawn in turn, comma-separated (default: KINDS)")
    parser.add_argument("--elastic", choices=DRAWS, default="any",
                        help="restrict the elastic draw (hier-adpsgd: seed 2's fit 24's kind)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kind(s) {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    commit = _commit()
    fits: list[dict[str, Any]] = []
    with open(args.out / "fits.jsonl", "a") as log:
        for i in range(args.fits):
            fit = {"fit": i, **one_fit(args.out / f"fit{i}", kinds[i % len(kinds)], rng,
                                       args.elastic)}
            fits.append(fit)
            line = json.dumps(fit)
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
            if args.record is not None:
                args.record.parent.mkdir(parents=True, exist_ok=True)
                args.record.write_text(json.dumps(summary(fits, started, args.seed, commit),
                                                  indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary(fits, started, args.seed, commit).items()
                      if k != "failing"}), flush=True)


if __name__ == "__main__":
    main()
