"""Shared plumbing for the benchmark scripts: launching ranks, describing the machine, reporting.

The benchmark scripts are run in two roles. As a *driver* (what a user starts) they parse the
command line, start the ranks with ``torchrun`` and collect what every rank wrote; as a *worker*
(``--worker SPEC.json``, started by the driver through torchrun) they run the measured fits.
Everything measured in one launch shares the same processes, so Lightning/torch start-up is
paid once and the cases run back to back under the same machine load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from testbed import launch

ROOT = launch.ROOT

RESULTS_DIR = ROOT / "benchmarks" / "results"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the tests' launcher's)."""
    return launch.free_port()


def worker_env(**extra: str) -> dict[str, str]:
    """Environment for the ranks: one thread per rank, the repository importable, warnings
    off; plus ``extra``."""
    return launch.base_env(PYTHONWARNINGS="ignore", **extra)


#: run commands, each with its environment, under a timeout (the tests' launcher's)
launch_processes = launch.launch_processes


def launch_workers(module: str, spec: dict[str, Any], nprocs: int, workdir: Path,
                   timeout: float) -> list[dict[str, Any]]:
    """Run ``python -m MODULE --worker SPEC`` on ``nprocs`` torchrun ranks; return each rank's
    results.

    Worker progress lines (``[bench] ...``) are passed through to this process's stderr as
    they arrive; the whole output is kept in ``workdir/log.txt``. Every rank writes
    ``workdir/rank<r>.json``. A failed launch raises ``RuntimeError`` with the tail of the
    output; on timeout every rank first dumps its threads' stacks (see
    ``testbed/launch.py``, the one launcher of tests and benchmarks) so a hang can be located,
    then the launch is killed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("rank*.json"):
        old.unlink()
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = launch.torchrun_command(module, "--worker", str(spec_path), nprocs=nprocs,
                                  port=free_port())

    def forward(line: str) -> None:
        if line.startswith("[bench]"):
            print(line.rstrip(), file=sys.stderr, flush=True)

    with open(workdir / "log.txt", "w") as log:
        launched = launch.launch_processes([(cmd, worker_env())], timeout, log=log, on_line=forward)
        log.write(launched.diagnostics)
    tail = "".join(launched.stdout.splitlines(keepends=True)[-120:])
    if launched.timed_out:
        raise RuntimeError(f"benchmark launch timed out after {timeout}s (stacks in "
                           f"{workdir / 'log.txt'}):\n{tail}")
    if launched.returncode != 0:
        raise RuntimeError(f"benchmark launch failed (exit code {launched.returncode}):\n{tail}")
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(nprocs)]


def worker_init() -> None:
    """Per-rank set-up: ``SIGUSR1`` dumps every thread's stack (for a look at a live run).

    The launcher itself dumps the stacks on timeout (``SIGABRT`` with faulthandler on, or
    ``py-spy``), so this is only for a person poking at a running benchmark.
    """
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


def spread(runs: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, dict[str, float]]:
    """Median, min and max over ``runs`` of each of ``keys`` (a repeated benchmark's summary).

    >>> spread([{"s": 1.0}, {"s": 3.0}, {"s": 2.0}], ["s"])
    {'s': {'median': 2.0, 'min': 1.0, 'max': 3.0}}
    """
    return {key: {"median": median([r[key] for r in runs]), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key in keys}


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


@dataclasses.dataclass
class Worker:
    """One rank of a benchmark launch: the driver's spec, the work folder, rank and size."""

    spec: dict[str, Any]
    out: Path
    rank: int
    world: int

    def write(self, payload: dict[str, Any], name: str = "rank") -> None:
        """``payload`` as ``<out>/<name><rank>.json`` (``rank<r>.json``: what the driver
        reads)."""
        (self.out / f"{name}{self.rank}.json").write_text(json.dumps(payload))


@contextlib.contextmanager
def worker_session(spec_path: Path) -> Iterator[Worker]:
    """Set up one rank (:func:`worker_init`, one torch thread, a gloo process group that
    Lightning reuses and the cases use for barriers); after the body, a barrier and the group
    destroyed. Imports torch, so it is for the workers only."""
    import torch
    import torch.distributed as dist

    worker_init()
    spec = json.loads(spec_path.read_text())
    worker = Worker(spec, spec_path.parent, int(os.environ["RANK"]),
                    int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    yield worker
    dist.barrier()
    dist.destroy_process_group()


def timed_launch(module: str, spec: dict[str, Any], nprocs: int, workdir: Path,
                 timeout: float) -> tuple[list[dict[str, Any]], float]:
    """:func:`launch_workers`, and its wall time in seconds."""
    t0 = time.time()
    ranks = launch_workers(module, spec, nprocs, workdir, timeout)
    return ranks, time.time() - t0


def progress(msg: str) -> None:
    """A progress line from a worker (rank 0 only); the driver forwards ``[bench]`` lines."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[bench] {time.strftime('%H:%M:%S')} {msg}", flush=True)
