"""What it takes a replacement to join a running elastic ``adpsgd`` (or ``dpsgd``) fit.

Each repeat runs ``testbed.elastic_fit`` on 4 ranks started as ``srun`` starts tasks (gloo,
loopback, ``heartbeat_timeout=3``, 1 s training steps so that the fit outlasts the
replacement's start-up): rank 2 is killed at the start of its 4th batch of epoch 0, and once a
survivor has recovered, a replacement is started with rank 2's environment (as ``srun``
relaunching the task would). Measured from the processes' wall clocks (one machine):

* ``start_to_first_batch_s``: the replacement's process start (after its imports: the module
  is loaded) to its first trained batch (its engine runs from set-up, so the first exchange is
  at that step at the latest): the issue's goal is at most 30 s;
* ``admit_s``: the longest member-side admission (quiesce, agree, new groups, hand-over, new
  engine);
* ``once``: every sample of every epoch trained exactly once among all processes;
* ``same_replica``: every process ends with the same replica (the final average);
* ``codes``, ``failed_at_exit``: the exit codes, and the processes that wrote their results and
  then failed at exit (recorded, not hidden: ``docs/exit-status.md``).

Usage::

    python -m benchmarks.perf.elastic_join                 # 3 repeats, about 3 minutes
    python -m benchmarks.perf.elastic_join --repeats 1 --out /tmp/join.json
    python -m benchmarks.perf.elastic_join --strategy dpsgd   # join_dpsgd.json
    python -m benchmarks.perf.elastic_join --nodes 2          # join_adpsgd_2x2.json

``--nodes 2``: hierarchical, 2 nodes of 2 ranks; rank 3 is killed, its node-mate 2 leaves with
it, and both are relaunched (2 s apart, as two tasks restart); the node is admitted whole, and
``start_to_first_batch_s`` is the later of the two.

Under ``dpsgd`` the members look for joins every ``JOIN_CHECK_EVERY`` (8) steps, all at the
same step, so the replacement waits up to 8 training steps (8 s here) to be admitted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common.harness import describe_machine, machine_info, spread, write_json
from testbed.elastic_fit import EPOCHS, SAMPLES, records
from testbed.launch import ROOT, fake_slurm_commands, launch_processes, relaunched_once

RANKS, VICTIM, BATCH, STEP_S = 4, 2, 3, "1.0"
OUTS = {"adpsgd": ROOT / "benchmarks" / "results" / "elastic" / "join.json",
        "dpsgd": ROOT / "benchmarks" / "results" / "elastic" / "join_dpsgd.json"}


def measure(out: Path, strategy: str = "adpsgd", nodes: int = 1) -> dict[str, Any]:
    """One fit with a loss and a replacement (``nodes`` 2: a node's two); what the join cost."""
    victim, slots = (3, (2, 3)) if nodes > 1 else (VICTIM, (VICTIM,))
    commands = fake_slurm_commands("testbed.elastic_fit", str(out), str(victim), str(BATCH),
                                   ntasks=RANKS, nodes=nodes,
                                   env={"ELASTIC_FIT_STEP_S": STEP_S, "ELASTIC_FIT_NODES":
                                        str(nodes), "ELASTIC_FIT_STRATEGY": strategy})
    commands += [relaunched_once(commands[slot], out / "recovered", 2 * k)
                 for k, slot in enumerate(slots)]
    t0 = time.time()
    launched = launch_processes(commands, timeout=600)
    wall = time.time() - t0
    codes = launched.returncodes
    finished = [(out / f"done{r}.json").exists() for r in range(RANKS)]
    if launched.timed_out or not all(finished):
        raise RuntimeError(f"a fit did not finish ({codes}):\n{launched.stdout[-4000:]}")
    # a process that wrote its results and then failed at exit is recorded, not hidden
    # (docs/exit-status.md); which process: 0-3 the ranks (the slots' first
    # processes were lost or left), 4 and on the replacements
    failed_at_exit = [i for i in range(len(codes)) if i not in slots and codes[i] != 0]
    done = {r: json.loads((out / f"done{r}.json").read_text()) for r in range(RANKS)}
    lost = json.loads((out / "victim.json").read_text())["t"]
    mine = {r: [rec["t"] for rec in records(out, r) if rec["t"] > lost] for r in slots}
    once = all(Counter(i for r in range(RANKS) for rec in records(out, r) if rec["epoch"] == e
                       for i in rec["idx"]) == Counter(range(SAMPLES)) for e in range(EPOCHS))
    return {"start_to_first_batch_s": round(max(min(mine[r]) - done[r]["started"]
                                                for r in slots), 2),
            "admit_s": round(max(j[2] for r, d in done.items() if r not in slots
                                 for j in d["joins"]), 2),
            "joined_at_step": done[0]["joins"][0][1],
            "replacement_batches": sum(len(m) for m in mine.values()),
            "once": once, "same_replica": len({round(d["sum"], 5) for d in done.values()}) == 1,
            "wall_s": round(wall, 1), "codes": codes, "failed_at_exit": failed_at_exit}


def main() -> None:
    """Run the repeats and write the record (``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", choices=sorted(OUTS), default="adpsgd")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--out", type=Path, default=None, help="default: by the strategy")
    args = parser.parse_args()
    out = args.out or (OUTS[args.strategy] if args.nodes == 1 else
                       OUTS["adpsgd"].with_name(f"join_{args.strategy}_2x2.json"))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            folder = Path(tmp) / f"r{i}"
            folder.mkdir()
            runs.append(dict(measure(folder, args.strategy, args.nodes), repeat=i))
            print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, Any] = spread(runs, ("start_to_first_batch_s", "admit_s", "wall_s"))
    summary["once"] = all(r["once"] for r in runs)
    summary["same_replica"] = all(r["same_replica"] for r in runs)
    summary["failed_at_exit"] = sum(bool(r["failed_at_exit"]) for r in runs)
    info = machine_info()
    write_json(out, {"what": __doc__.split("\n\n")[0], "strategy": args.strategy,
                     "ranks": RANKS, "nodes": args.nodes, "heartbeat_timeout_s": 3.0,
                     "step_s": float(STEP_S),
                     "machine": info, "machine_text": describe_machine(info), "runs": runs,
                     "summary": summary})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
