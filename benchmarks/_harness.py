"""Shared plumbing for the benchmark scripts: launching ranks, describing the machine, reporting.

The benchmark scripts are run in two roles. As a *driver* (what a user starts) they parse the
command line, start the ranks with ``torchrun`` and collect what every rank wrote; as a *worker*
(``--worker SPEC.json``, started by the driver through torchrun) they run the measured fits.
Everything measured in one launch shares the same processes, so Lightning/torch start-up is
paid once and the cases run back to back under the same machine load.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.metadata
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env() -> dict[str, str]:
    """Environment for the ranks: one thread per rank, the repository importable."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PL_DISABLE_FORK="1",
        PYTHONWARNINGS="ignore",
    )
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    return env


def launch(script: Path, spec: dict[str, Any], nprocs: int, workdir: Path,
           timeout: float) -> list[dict[str, Any]]:
    """Run ``script --worker SPEC`` on ``nprocs`` torchrun ranks; return each rank's results.

    Worker progress lines (``[bench] ...``) are passed through to this process's stderr as
    they arrive; the whole output is kept in ``workdir/log.txt``. Every rank writes
    ``workdir/rank<r>.json``. A failed launch raises ``RuntimeError`` with the tail of the
    output; on timeout every rank first dumps its threads' stacks (``SIGUSR1``, see
    :func:`worker_init`) so a hang can be located, then the launch is killed.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the ranks get cleaned up
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("rank*.json"):
        old.unlink()
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
           "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           str(script), "--worker", str(spec_path)]
    proc = subprocess.Popen(cmd, env=worker_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        _signal_all(_descendants(proc.pid), signal.SIGUSR1)  # the ranks dump their stacks
        time.sleep(5)
        _signal_all([*_descendants(proc.pid), proc.pid], signal.SIGKILL)

    tail: list[str] = []
    watchdog = threading.Timer(timeout, on_timeout)
    watchdog.start()
    try:
        assert proc.stdout is not None
        with open(workdir / "log.txt", "w") as log:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-120:]
                if line.startswith("[bench]"):
                    print(line.rstrip(), file=sys.stderr, flush=True)
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # interrupted: take the ranks down with us
            _signal_all([*_descendants(proc.pid), proc.pid], signal.SIGKILL)
    if timed_out.is_set():
        raise RuntimeError(f"benchmark launch timed out after {timeout}s (stacks in "
                           f"{workdir / 'log.txt'}):\n{''.join(tail)}")
    if rc != 0:
        raise RuntimeError(f"benchmark launch failed (exit code {rc}):\n{''.join(tail)}")
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(nprocs)]


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts its ranks in sessions of their own,
    so signalling torchrun's process group would not reach them)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def worker_init() -> None:
    """Per-rank set-up: ``SIGUSR1`` dumps every thread's stack (how the driver shows hangs)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


_ELASTIC_KEYS = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


@contextlib.contextmanager
def without_launcher_env() -> Iterator[None]:
    """Hide torchrun's variables so a Trainer in a worker sets up a plain 1-process run."""
    saved = {k: os.environ.pop(k) for k in _ELASTIC_KEYS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    # From the installed metadata: the driver never imports torch (start-up is slow).
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, versions and the current load average (to judge the noise)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": _version("torch"),
        "lightning": _version("lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1_5_15": load,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def describe_machine(info: dict[str, Any]) -> str:
    """One Markdown paragraph describing the machine."""
    load = ", ".join(f"{x:.2f}" for x in info.get("loadavg_1_5_15", []))
    return (f"Machine: {info['usable_cores']} usable cores ({info['cpu_model']}), "
            f"torch {info['torch']}, lightning {info['lightning']}, "
            f"Python {info['python']}; load average (1, 5, 15 min) {load} at the start"
            f"; {info['date_utc']}.")


def median(xs: Sequence[float]) -> float:
    """The median, or NaN for an empty sequence."""
    return float(statistics.median(xs)) if xs else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; floats printed with 3 significant decimals."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, creating parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def progress(msg: str) -> None:
    """A progress line from a worker (rank 0 only); the driver forwards ``[bench]`` lines."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[bench] {time.strftime('%H:%M:%S')} {msg}", flush=True)
