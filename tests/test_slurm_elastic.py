"""Elastic fits under the real SLURM (``make test-slow``): the elastic digits template
(``recipes/imagenet/slurm/digits_cpu_elastic.sbatch``) on 2 nodes x 2 tasks, ``adpsgd`` or
``dpsgd``; rank 3's training process (node 1) is SIGKILLed in the second epoch.

The survivors go on without it; its task's relaunch loop starts it again with the same
``SLURM_PROCID`` and it joins the running fit; the job completes every epoch (``COMPLETED``)
without an emergency checkpoint or a restart of the step. Needs root, network namespaces and
SLURM (see ``tests/test_slurm_cluster.py``). Times are printed, never asserted.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from testbed import cluster_net, slurm_cluster
from testbed.launch import ROOT, base_env
from tests import slurm_jobs

pytestmark = pytest.mark.multiprocess

#: this module's own name prefix (see tests/test_slurm_faults.py)
PREFIX = os.environ.get("LG_SLURM_ELASTIC_PREFIX", "tse")
TEMPLATE = ROOT / "recipes/imagenet/slurm/digits_cpu_elastic.sbatch"
EPOCHS, VICTIM = 40, 3
"""40 epochs (about 2 s each here): the fit outlasts the loss's detection, the relaunch delay
and the replacement's start (at 10 epochs it ended first, 5 Dec 2026)."""
EVENTS = {"lost": f"elastic fit: rank(s) {VICTIM} lost",
          "relaunch": f"task {VICTIM}: training process failed (attempt 1), relaunching",
          "joined": f"elastic fit: rank(s) {VICTIM} joined"}


@pytest.fixture(scope="module")
def slurm_available() -> None:
    reason = slurm_cluster.check_available(PREFIX)
    if reason:
        pytest.skip(f"real SLURM unavailable here: {reason}")


def _task_pid(netns: str, procid: int) -> int | None:
    """The training process (``python -m recipes.imagenet fit``) of task ``procid``."""
    for pid in cluster_net.namespace_pids(netns):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"recipes.imagenet" in cmd and b"fit" in cmd and b"python" in cmd[0]
                and f"SLURM_PROCID={procid}".encode() in env):
            return pid
    return None


def _cluster() -> slurm_cluster.SlurmCluster:
    """The emulated 2-node cluster of these tests (the digits data and the log folder ready)."""
    slurm_jobs.digits_data()
    (ROOT / "logs").mkdir(exist_ok=True)
    return slurm_cluster.SlurmCluster(2, 200, cpus=2, prefix=PREFIX)


def _submit(cluster: slurm_cluster.SlurmCluster, export: str) -> tuple[str, Path, Path]:
    """Submit the elastic digits template with ``export`` (``NAME=value,...``) on ``cluster``:
    the job, its output file and its run folder."""
    job = cluster.submit(TEMPLATE, args=[f"--export=ALL,EPOCHS={EPOCHS},{export}", "--time=30"],
                         cwd=ROOT, env=cluster.client_env(base_env()))
    return job, ROOT / "logs" / f"digits-elastic-{job}.out", ROOT / "runs" / f"digits-elastic-{job}"


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.usefixtures("slurm_available")
@pytest.mark.parametrize(("strategy", "hierarchical"), [("adpsgd", False), ("dpsgd", False),
                                                        ("adpsgd", True), ("dpsgd", True)])
def test_a_killed_rank_is_relaunched_and_joins(strategy: str, hierarchical: bool) -> None:
    """Hierarchical: rank 3's node-mate, rank 2, leaves with it (``RankExcluded``), both tasks
    relaunch their processes and the node rejoins whole."""
    cluster = _cluster()
    killed: dict = {}
    events = {**EVENTS, "lost": "elastic fit: rank(s) 2, 3 lost",
              "joined": "elastic fit: rank(s) 2, 3 joined"} if hierarchical else EVENTS
    extra = ",EXTRA_ARGS=--trainer.strategy.hierarchical=true" if hierarchical else ""
    with cluster:
        start = time.monotonic()
        job, out_path, run_dir = _submit(cluster, f"STRATEGY={strategy}{extra}")

        def on_poll(now: float, w: slurm_jobs.Watch) -> None:
            if "kill" not in w.seen and list(run_dir.rglob("last.ckpt")):  # an epoch done
                pid = _task_pid(cluster.net.members[1].netns, VICTIM)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    w.seen["kill"], killed["pid"] = now, pid

        w = slurm_jobs.watch_job(cluster, job, out_path, events, on_poll, timeout_s=1800,
                                 start=start)
    info, seen, text = w.info, w.seen, w.text
    print(f"\n{strategy} (hierarchical={hierarchical}): job {job} events (s after sbatch) "
          f"{seen}; killed {killed}; {info.get('JobState')}")
    for line in text.splitlines():
        if "elastic fit:" in line or "relaunching" in line:
            print(line[:300])
    assert killed, text[-6000:]
    assert info.get("JobState") == "COMPLETED", (info, text[-6000:])
    assert {"kill", "lost", "relaunch", "joined"} <= set(seen), (seen, text[-6000:])
    assert seen["kill"] < seen["lost"] < seen["joined"], seen
    assert not list(run_dir.rglob("emergency-*.ckpt")), text[-6000:]
    import torch

    last = torch.load(sorted(run_dir.rglob("last.ckpt"))[0], map_location="cpu",
                      weights_only=False)
    assert last["epoch"] == EPOCHS - 1, last["epoch"]


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.usefixtures("slurm_available")
def test_a_late_task_joins_a_fit_started_without_it() -> None:
    """``START_TIMEOUT=20`` (``adpsgd``): task 3's training process is stopped (``SIGSTOP``) as
    soon as it appears, in its imports, and woken 45 s later, as a task that a node starts late:
    the other three found the fit once the 20 s passed and train; task 3 then finds the fit
    running and joins it; the job completes every epoch, without a relaunch or an emergency
    checkpoint."""
    cluster = _cluster()
    held: dict = {}
    with cluster:
        start = time.monotonic()
        job, out_path, run_dir = _submit(cluster, "STRATEGY=adpsgd,START_TIMEOUT=20")

        def on_poll(now: float, w: slurm_jobs.Watch) -> None:
            if "stopped" not in w.seen:
                pid = _task_pid(cluster.net.members[1].netns, VICTIM)
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)
                    w.seen["stopped"], held["pid"] = now, pid
            elif "woken" not in w.seen and now > w.seen["stopped"] + 45:
                os.kill(held["pid"], signal.SIGCONT)
                w.seen["woken"] = now

        w = slurm_jobs.watch_job(cluster, job, out_path, {"joined": EVENTS["joined"],
                                                          "relaunch": EVENTS["relaunch"]},
                                 on_poll, timeout_s=1800, poll_s=0.3, start=start)
    info, seen, text = w.info, w.seen, w.text
    print(f"\nlate task: job {job} events (s after sbatch) {seen}; {info.get('JobState')}")
    for line in text.splitlines():
        if "elastic fit:" in line:
            print(line[:300])
    assert info.get("JobState") == "COMPLETED", (info, text[-6000:])
    assert {"stopped", "woken", "joined"} <= set(seen) and "relaunch" not in seen, (
        seen, text[-6000:])
    assert seen["stopped"] < seen["woken"] < seen["joined"], seen
    assert not list(run_dir.rglob("emergency-*.ckpt")), text[-6000:]
