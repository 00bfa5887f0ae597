"""How long a frozen rank's peers take to be gone (issue 48's goal: under ``dpsgd`` within
``heartbeat_timeout + 10`` s of the freeze, the culprit named).

A non-elastic fit of ``tests/scripts/emergency_ranks.py`` on 4 tasks started as ``srun`` starts
them; rank 2 freezes itself (``SIGSTOP``, never woken) after step 4. Each task runs under
``bash``, which prints the wall time its Python process ended; the harness kills the frozen
rank once the three others are gone. Per run, one JSON line: every survivor's exit status, the
seconds from the freeze to the last survivor's exit (``all_gone_s``), to each survivor's end of
fit (``done_s``: named rank 2, emergency checkpoint written) and to its exit (``exit_s``), the
aborts ("terminate called") and the last-resort exits seen, and the load average.

With ``--probe`` each rank runs under :mod:`testbed.exit_probe` (the time its ``atexit``
handlers ended, its Python stacks 2 s later); with ``--gdb`` too, ``gdb`` takes every thread's
native stack of survivor rank 1 one second after its handlers ended
(``OUT/run<i>/gdb_rank1.txt``)::

    python -m testbed.frozen_exit --strategy dpsgd --runs 3 --out /tmp/frozen_exit
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from testbed.launch import ROOT, base_env, free_port, launch_processes

SCRIPT = ROOT / "tests/scripts/emergency_ranks.py"
PROBE = ROOT / "testbed/exit_probe.py"
TASKS, VICTIM = 4, 2


def _gdb_stacks(pid: int, path: Path, delay: float) -> None:
    """Every thread's native stack of ``pid``, ``delay`` seconds from now, into ``path``."""
    time.sleep(delay)
    try:
        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                             capture_output=True, text=True, timeout=60)
        path.write_text(f"at {time.time():.3f}\n{out.stdout}\n{out.stderr}")
    except (OSError, subprocess.TimeoutExpired) as e:
        path.write_text(f"gdb failed: {e}")


def one_run(out: Path, strategy: str, heartbeat: float, probe: bool,
            gdb: bool = False) -> dict[str, Any]:
    """One fit; its record (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "devices": TASKS, "strategy": strategy,
                                "victim": VICTIM, "kind": "freeze", "step": 4, "delay": 0.0,
                                "heartbeat_timeout": heartbeat}))
    port, commands = str(free_port()), []
    for task in range(TASKS):
        env = base_env(SLURM_NTASKS=str(TASKS), SLURM_NTASKS_PER_NODE=str(TASKS),
                       SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NODEID="0",
                       SLURM_NNODES="1", SLURM_JOB_NAME="lightning-gossip-test",
                       SLURM_JOB_ID="4343", SLURM_NODELIST="127.0.0.1", MASTER_PORT=port)
        argv = [sys.executable, *([str(PROBE)] if probe else []), str(SCRIPT), str(spec)]
        line = f"{shlex.join(argv)}; echo EXITED {task} $? $(date +%s.%N)"
        commands.append((["bash", "-c", line], env))
    exited: dict[int, tuple[int, float]] = {}
    atexit_done: dict[int, float] = {}
    pids: dict[int, int] = {}

    def on_line(text: str) -> None:
        words = text.split()
        if text.startswith("EXITED "):
            task = int(words[1])
            exited[task] = (int(words[2]), float(words[3]))
            survivors_gone = len([r for r in exited if r != VICTIM]) == TASKS - 1
            if task != VICTIM and survivors_gone and (out / "victim.json").exists():
                os.kill(json.loads((out / "victim.json").read_text())["pid"], signal.SIGKILL)
        elif text.startswith("EXITPROBE atexit-done "):
            pid, when = int(words[2]), float(words[3])
            rank = pids.get(pid)
            if rank is not None:
                atexit_done[rank] = when
            if rank == 1 and gdb:
                threading.Thread(target=_gdb_stacks, args=(pid, out / "gdb_rank1.txt", 1.0),
                                 daemon=True).start()
        elif text.startswith("EXITPROBE rank "):
            pids[int(words[2])] = int(words[3])

    load = os.getloadavg()[0]
    launched = launch_processes(commands, 400, on_line=on_line)
    (out / "log.txt").write_text(launched.stdout)
    lost = json.loads((out / "victim.json").read_text())
    survivors = [r for r in range(TASKS) if r != VICTIM]
    done = {r: json.loads((out / f"rank{r}.json").read_text())["t_done"] for r in survivors}
    return {
        "strategy": strategy, "heartbeat_timeout": heartbeat,
        "survivor_codes": [exited[r][0] for r in survivors],
        "all_gone_s": round(max(exited[r][1] for r in survivors) - lost["t"], 1),
        "done_s": [round(done[r] - lost["t"], 1) for r in survivors],
        "exit_s": [round(exited[r][1] - done[r], 1) for r in survivors],
        "after_atexit_s": [round(exited[r][1] - atexit_done[r], 1) if r in atexit_done
                           else None for r in survivors],
        "terminate": launched.stdout.count("terminate called"),
        "last_resort": launched.stdout.count("still waiting at exit"),
        "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    """Run the measurement (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("dpsgd", "adpsgd"), default="dpsgd")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--gdb", action="store_true", help="with --probe: native stacks")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for i in range(args.runs):
        record = one_run(args.out / f"run{i}", args.strategy, args.heartbeat_timeout,
                         args.probe, args.gdb)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
