"""Run a rank script and say where its process spends the time of its exit (for
:mod:`testbed.frozen_exit`).

``python testbed/exit_probe.py SCRIPT ARGS...`` runs ``SCRIPT`` as ``__main__`` after registering,
before anything else is imported, one ``atexit`` handler; being the first registered, it runs
after every other one. It prints ``EXITPROBE atexit-done <pid> <wall time>`` and arms
``faulthandler`` to print every thread's Python stack if the process is still alive
``EXIT_PROBE_DUMP_S`` seconds later (default 2): what is left then is the interpreter's
finalization (modules torn down, objects' finalizers, C++ destructors). It prints
``EXITPROBE rank <pid> <SLURM_PROCID>`` at its start, and ``EXITPROBE script-end <pid> <wall
time>`` when the script raises ``SystemExit``.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import runpy
import sys
import time


def _done() -> None:
    print(f"EXITPROBE atexit-done {os.getpid()} {time.time():.3f}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(float(os.environ.get("EXIT_PROBE_DUMP_S", "2")),
                                      exit=False)


def main() -> None:
    """Run ``sys.argv[1]`` as ``__main__`` with the rest of the arguments."""
    atexit.register(_done)
    print(f"EXITPROBE rank {os.getpid()} {os.environ.get('SLURM_PROCID', '-1')}",
          file=sys.stderr, flush=True)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        print(f"EXITPROBE script-end {os.getpid()} {time.time():.3f}", file=sys.stderr,
              flush=True)
        raise


if __name__ == "__main__":
    main()
