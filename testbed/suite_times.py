"""Where the time of a test run goes, per file and per pytest-xdist worker.

``LG_TEST_TIMES=times.jsonl make test`` makes ``tests/conftest.py`` append one JSON line per
test phase (setup, call, teardown: ``nodeid``, ``when``, ``start``, ``stop``, ``duration``,
``worker``); ``python -m testbed.suite_times times.jsonl`` then prints the run's wall time, each
file's total (the sum of its tests' phases: with ``--dist loadfile`` a file runs on one worker,
so no run is shorter than its longest file), when each file began and ended, and how busy each
worker was. Importing this module starts nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class FileTime:
    """One test file's phases: their summed duration, first start, last stop, its workers."""

    path: str
    seconds: float
    start: float
    stop: float
    workers: tuple[str, ...]


def file_of(nodeid: str) -> str:
    """The file part of a pytest node id.

    >>> file_of("tests/test_faults.py::test_clean_exit[adpsgd-lightning-rank0-raises]")
    'tests/test_faults.py'
    >>> file_of("lightning_gossip/topology.py::lightning_gossip.topology.ring")
    'lightning_gossip/topology.py'
    """
    return nodeid.split("::", 1)[0]


def per_file(records: Iterable[dict]) -> list[FileTime]:
    """Each file's :class:`FileTime`, the longest first.

    >>> recs = [{"nodeid": "a.py::t", "duration": 2.0, "start": 0.0, "stop": 2.0, "worker": "gw0"},
    ...         {"nodeid": "a.py::u", "duration": 1.0, "start": 2.0, "stop": 3.0, "worker": "gw0"},
    ...         {"nodeid": "b.py::t", "duration": 4.0, "start": 0.0, "stop": 4.0, "worker": "gw1"}]
    >>> [(f.path, f.seconds, f.stop) for f in per_file(recs)]
    [('b.py', 4.0, 4.0), ('a.py', 3.0, 3.0)]
    """
    files: dict[str, FileTime] = {}
    for r in records:
        path = file_of(r["nodeid"])
        f = files.setdefault(path, FileTime(path, 0.0, r["start"], r["stop"], ()))
        f.seconds += r["duration"]
        f.start, f.stop = min(f.start, r["start"]), max(f.stop, r["stop"])
        if r["worker"] not in f.workers:
            f.workers += (r["worker"],)
    return sorted(files.values(), key=lambda f: -f.seconds)


def report(records: list[dict], top: int = 40) -> str:
    """The summary :func:`main` prints: wall time, the ``top`` longest files, the workers."""
    t0 = min(r["start"] for r in records)
    wall = max(r["stop"] for r in records) - t0
    files = per_file(records)
    lines = [f"wall {wall:.0f} s, {len({r['nodeid'] for r in records})} tests, "
             f"{len(files)} files, phases summed {sum(f.seconds for f in files):.0f} s",
             f"{'seconds':>8} {'from':>6} {'to':>6}  worker  file"]
    lines += [f"{f.seconds:8.1f} {f.start - t0:6.0f} {f.stop - t0:6.0f}  {','.join(f.workers):6}  "
              f"{f.path}" for f in files[:top]]
    rest = files[top:]
    if rest:
        lines.append(f"{sum(f.seconds for f in rest):8.1f}   (the other {len(rest)} files)")
    for worker in sorted({r["worker"] for r in records}):
        mine = [r for r in records if r["worker"] == worker]
        busy = sum(r["duration"] for r in mine)
        end = max(r["stop"] for r in mine) - t0
        lines.append(f"worker {worker}: busy {busy:.0f} s, last test ended at {end:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m testbed.suite_times TIMES.jsonl [TOP]``: print :func:`report`."""
    args = sys.argv[1:] if argv is None else argv
    records = [json.loads(line) for line in Path(args[0]).read_text().splitlines() if line]
    print(report(records, int(args[1]) if len(args) > 1 else 40))


if __name__ == "__main__":
    main()
