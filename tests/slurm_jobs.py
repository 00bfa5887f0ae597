"""Helpers of the real-SLURM tests (``tests/test_slurm_cluster.py``,
``tests/test_slurm_faults.py``): the digits data, watching a job while it runs, and reading the
claim logs of ``tests/scripts/claim_log.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import slurm_cluster
from testbed.launch import ROOT, base_env

#: every rank logs the shared cursor's claims and its trained batches (tests/scripts/claim_log.py)
CLAIM_LOG = "--trainer.callbacks+=tests.scripts.claim_log.ClaimLog"
DIGITS_TEMPLATE = ROOT / "recipes/imagenet/slurm/digits_cpu.sbatch"


def digits_data() -> Path:
    """``data/digits`` (prepared once, from scikit-learn's bundled digits)."""
    data = ROOT / "data" / "digits"
    if not data.exists():
        subprocess.run([sys.executable, "-m", "recipes.imagenet.prepare_digits", "--out",
                        str(data)], cwd=ROOT, check=True, env=base_env(), timeout=600)
    return data


def seconds(runtime: str) -> int:
    """SLURM's ``[D-]HH:MM:SS`` in seconds.

    >>> seconds("1-00:02:03")
    86523
    """
    days, _, hms = runtime.rpartition("-")
    h, m, sec = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


@dataclass
class Watch:
    """What :func:`watch_job` saw: the job's last ``scontrol`` fields, the time (s after the
    watch began, as polled) each marker first appeared in its output, and that output."""

    info: dict[str, str] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)
    text: str = ""


def watch_job(cluster: slurm_cluster.SlurmCluster, job: str, out_path: Path,
              markers: dict[str, str], on_poll: Callable[[float, Watch], None] | None = None,
              timeout_s: float = 3600.0, poll_s: float = 1.0,
              start: float | None = None) -> Watch:
    """Poll job ``job`` until it ends: every ``poll_s`` read its ``scontrol`` fields and its
    output file ``out_path``, note when each of ``markers`` (``name -> text``) first shows in
    it, and call ``on_poll(now, watch)`` (which may act on the job and add to ``watch.seen``).
    ``start``: the ``time.monotonic()`` the times count from (default: now). After
    ``timeout_s`` the job is cancelled and ``info["wait_timeout"]`` says so."""
    start = time.monotonic() if start is None else start
    w = Watch()
    while True:
        w.info = cluster.job(job) or w.info
        w.text = out_path.read_text(errors="replace") if out_path.exists() else ""
        now = round(time.monotonic() - start, 1)
        for name, marker in markers.items():
            if marker in w.text and name not in w.seen:
                w.seen[name] = now
        if on_poll is not None:
            on_poll(now, w)
        if w.info.get("JobState") in slurm_cluster.TERMINAL_STATES:
            return w
        if now > timeout_s:
            cluster.client(["scancel", job], check=False)
            w.info["wait_timeout"] = f"not finished within {timeout_s:g} s: cancelled"
            return w
        time.sleep(poll_s)


def read_claims(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's claim logs (``<run_dir>/claims/*.jsonl``), in file order."""
    records = []
    for path in sorted((run_dir / "claims").glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def attempts(records: list[dict[str, Any]], world: int) -> list[list[dict[str, Any]]]:
    """The records split by ``srun`` step: processes ordered by their first record, ``world``
    processes a step (each step starts every rank afresh)."""
    first: dict[int, float] = {}
    for r in records:
        first[r["pid"]] = min(first.get(r["pid"], r["t"]), r["t"])
    pids = sorted(first, key=first.__getitem__)
    steps = [set(pids[k:k + world]) for k in range(0, len(pids), world)]
    return [[r for r in records if r["pid"] in step] for step in steps]


def units(records: list[dict[str, Any]], epoch: int) -> list[int]:
    """The units of ``epoch`` claimed in ``records`` (``None``, an exhausted epoch, left out)."""
    return [r["unit"] for r in records
            if r["kind"] == "claim" and r["epoch"] == epoch and r["unit"] is not None]


def trained(records: list[dict[str, Any]], epoch: int | None = None) -> list[dict[str, Any]]:
    """The ``trained`` records (of ``epoch``, or all)."""
    return [r for r in records
            if r["kind"] == "trained" and (epoch is None or r["epoch"] == epoch)]


def off_epoch_claims(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The claims of an epoch made in a pass over another epoch's permutation (the last
    ``iter`` record of the same process says which): their samples are not that epoch's."""
    current: dict[int, int] = {}
    off = []
    for r in records:
        if r["kind"] == "iter":
            current[r["pid"]] = r["epoch"]
        elif r["kind"] == "claim" and current.get(r["pid"], r["epoch"]) != r["epoch"]:
            off.append(r)
    return off


def cursor_resume_report(before: list[dict[str, Any]], after: list[dict[str, Any]],
                         epoch: int) -> dict[str, Any]:
    """What a resume of the interrupted ``epoch`` claimed and trained, from the claim logs of
    the step before (``before``) and after (``after``) the interruption; a complete epoch of
    the same run (another epoch of ``before`` or ``after``) is the reference."""
    done = Counter(units(before, epoch))
    again = Counter(units(after, epoch))
    # a complete epoch: one before the interrupted one (before it), else one after it (after it)
    earlier = sorted({r["epoch"] for r in before if r["kind"] == "claim"} - {epoch})
    later = sorted({r["epoch"] for r in after if r["kind"] == "claim" and r["epoch"] > epoch})
    reference = Counter(units(before, earlier[0]) if earlier
                        else units(after, later[0]) if later else [])
    by_rank = {}
    for rank in sorted({r["rank"] for r in before}):
        mine = [r for r in before if r["rank"] == rank]
        by_rank[rank] = {"claimed": len(units(mine, epoch)),
                         "trained": len(trained(mine, epoch)),
                         "last_step": max((r["step"] for r in trained(mine)), default=0)}
    last_before = max((r["t"] for r in trained(before)), default=None)
    first_after = min((r["t"] for r in trained(after)), default=None)
    return {
        "epoch": epoch,
        "claimed_before": sum(done.values()), "claimed_after": sum(again.values()),
        "claimed_in_both": sorted((done & again).elements()),
        "union_is_one_epoch": done + again == reference,
        "reference_epoch_units": sum(reference.values()),
        "trained_before": len(trained(before, epoch)), "trained_after": len(trained(after, epoch)),
        "claimed_not_trained_before": sum(done.values()) - len(trained(before, epoch)),
        "ranks_before": by_rank,
        "first_step_after": {r: min((x["step"] for x in trained(after) if x["rank"] == r),
                                    default=None) for r in sorted(by_rank)},
        "claims_of_later_epochs_before": len([r for r in before if r["kind"] == "claim"
                                              and r["epoch"] > epoch]),
        "claims_of_earlier_epochs_after": len([r for r in after if r["kind"] == "claim"
                                               and r["epoch"] < epoch]),
        "off_epoch_claims": len(off_epoch_claims(before)) + len(off_epoch_claims(after)),
        "gap_s": (round(first_after - last_before, 1)
                  if first_after is not None and last_before is not None else None),
    }
