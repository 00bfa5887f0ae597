"""A fuzzed campaign of lost ranks: does every survivor name the lost rank, write the emergency
checkpoint, and exit, and how fast?

Each run starts ``tests/scripts/emergency_ranks.py`` on ``--ranks`` tasks (as ``srun`` starts
them: no launcher ends the survivors) with a random strategy (``dpsgd``/``adpsgd``), victim rank,
kind (``SIGKILL``/``SIGSTOP``), step (``2..8``) and delay within the step (``0..0.3`` s), and
records per run: whether exactly one emergency checkpoint was written, whether it is the
survivors' average, whether every survivor failed with ``PeerSilent`` naming the victim, and the
seconds from the loss (the victim's wall clock just before the signal) to the last survivor's
exit. Usage::

    python -m testbed.emergency_fuzz --runs 10 --seed 0 --out /tmp/fuzz [--ranks 3]

One JSON line per run on stdout (and in ``OUT/runs.jsonl``), then a summary line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from testbed.launch import base_env, free_port, launch_processes

ROOT = Path(__file__).resolve().parents[1]

#: the rank program (also the fit that loses a rank in tests/scripts/preempt_ranks.py)
SCRIPT = ROOT / "tests/scripts/emergency_ranks.py"
#: tasks of a launch unless told otherwise (the tests' size)
N = 3


def launch_lost_rank(out: Path, strategy: str, victim: int, kind: str, step: int,
                     delay: float = 0.0, heartbeat_timeout: float = 3.0, n: int = N,
                     timeout: float = 300) -> tuple[list[dict | None], dict, str, float]:
    """Run the script once (``n`` tasks as ``srun`` starts them): ``(per-rank results, the
    victim's record, output, wall seconds)``; ``None`` for a rank that wrote nothing. The
    processes' exit statuses go to ``OUT/returncodes.json``."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "devices": n, "strategy": strategy,
                                "victim": victim, "kind": kind, "step": step, "delay": delay,
                                "heartbeat_timeout": heartbeat_timeout}))
    port = str(free_port())
    commands = []
    for task in range(n):
        env = base_env(SLURM_NTASKS=str(n), SLURM_NTASKS_PER_NODE=str(n),
                       SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NODEID="0",
                       SLURM_NNODES="1", SLURM_JOB_NAME="lightning-gossip-test",
                       SLURM_JOB_ID="4343", SLURM_NODELIST="127.0.0.1", MASTER_PORT=port)
        commands.append(([sys.executable, str(SCRIPT), str(spec)], env))
    start = time.monotonic()
    launched = launch_processes(commands, timeout)
    wall = time.monotonic() - start
    assert not launched.timed_out, launched.stdout[-12000:]
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else None
               for r in range(n)]
    (out / "returncodes.json").write_text(json.dumps(launched.returncodes))
    victim_file = out / "victim.json"
    lost = json.loads(victim_file.read_text()) if victim_file.exists() else {}
    return results, lost, launched.stdout, wall


def one_run(out: Path, rng: random.Random, ranks: int, heartbeat_timeout: float) -> dict:
    case = {"strategy": rng.choice(["dpsgd", "adpsgd"]), "victim": rng.randrange(ranks),
            "kind": rng.choice(["kill", "stop"]), "step": rng.randint(2, 8),
            "delay": round(rng.uniform(0.0, 0.3), 3)}
    results, lost, text, wall = launch_lost_rank(out, n=ranks,
                                                 heartbeat_timeout=heartbeat_timeout, **case)
    survivors = [r for r in range(ranks) if r != case["victim"]]
    files = sorted((out / "ckpts").glob("*emergency*"))
    row = {**case, "lost": bool(lost), "wall_s": round(wall, 1), "files": [f.name for f in files]}
    done = [results[r] for r in survivors if results[r] is not None]
    row["survivors_reported"] = len(done)
    row["named"] = all(case["victim"] in (res.get("ranks") or []) for res in done) and bool(done)
    row["exceptions"] = sorted({f"{res.get('exception')}({res.get('lost')})" for res in done})
    if lost and len(done) == len(survivors):
        row["exit_after_loss_s"] = round(max(res["t_done"] for res in done) - lost["t"], 2)
    row["emergency"] = len(files) == 1
    if files:
        import torch

        ckpt = torch.load(files[0], map_location="cpu", weights_only=False)
        info = ckpt.get("lightning_gossip_emergency", {})
        row["averaged"] = bool(info.get("averaged"))
        row["ckpt_step"] = int(ckpt["global_step"])
        row["lost_at_step"] = lost.get("global_step")
    if not row["emergency"] or not row["named"]:
        (out / "output.txt").write_text(text)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "runs.jsonl").open("a") as log:
        for i in range(args.runs):
            row = {"run": i, **one_run(args.out / f"run{i}", rng, args.ranks,
                                       args.heartbeat_timeout)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
    times = sorted(r["exit_after_loss_s"] for r in rows if "exit_after_loss_s" in r)
    summary = {"runs": len(rows), "emergency_written": sum(r["emergency"] for r in rows),
               "averaged": sum(bool(r.get("averaged")) for r in rows),
               "culprit_named": sum(r["named"] for r in rows),
               "exit_after_loss_s_median": times[len(times) // 2] if times else None,
               "exit_after_loss_s_max": times[-1] if times else None}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
