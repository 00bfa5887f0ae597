"""A node lost under the real SLURM (``make test-slow``): the digits CPU template on 2 nodes x 2
tasks, flat or hierarchical (node 1 a whole learner), ``dpsgd`` or ``adpsgd``, node 1's two ranks
SIGKILLed mid-epoch.

The survivors (node 0's ranks) name the lost ranks within ``heartbeat_timeout`` + about 10 s,
write the emergency checkpoint (``emergency-step=<s>-rank=0.ckpt``, the survivors' average) and
fail; the ``srun`` step ends, and the template's retry loop runs a new step that resumes from the
newest checkpoint (the emergency one) and finishes the epochs. Needs root, network namespaces and
SLURM (see ``tests/test_slurm_cluster.py``). Times are printed, never asserted; the waits only
bound a hang. Every rank logs its claims of the shared cursor and its trained batches
(``tests/scripts/claim_log.py``), so the test also prints what the restart trained again.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from testbed import cluster_net, slurm_cluster
from testbed.launch import ROOT, base_env
from tests import slurm_jobs

pytestmark = pytest.mark.multiprocess

#: this module's own name prefix (not an extension of another test's or a benchmark's, so no
#: ``--cleanup`` of theirs removes its clusters); LG_SLURM_FAULTS_PREFIX overrides it
PREFIX = os.environ.get("LG_SLURM_FAULTS_PREFIX", "tsf")

LOST_EPOCHS = 4
HEARTBEAT_TIMEOUT_S = 20.0
EVENTS = {"emergency": "wrote the emergency checkpoint",
          "survivors_exited": "srun: error: node0: task",  # srun saw node 0's tasks end
          "retry": "attempt 1 failed: restarting from the newest checkpoint",
          "restored": "Restored all states from the checkpoint"}
#: rank 0's progress bar: ``0: Epoch 1:  45%|...| 5/11`` (``5/?`` or ``5it`` without a length)
PROGRESS = re.compile(r"Epoch (\d+):\s*(?:(?:\d+%)?\|[^|]*\|\s*)?(\d+)(?:/(\d+|\?)|it)")


def _fit_pids(netns: str) -> list[int]:
    """The training tasks (``python -m recipes.imagenet fit``) in a node's namespace."""
    pids = []
    for pid in cluster_net.namespace_pids(netns):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"recipes.imagenet" in cmd and b"fit" in cmd and b"python" in cmd[0]:
            pids.append(pid)
    return pids


def _last_progress(text: str) -> tuple[int, int, str] | None:
    """Rank 0's last ``(epoch, batch, total)`` on its progress bar."""
    found = PROGRESS.findall(text)
    return (int(found[-1][0]), int(found[-1][1]), found[-1][2]) if found else None


@pytest.fixture(scope="module")
def slurm_available() -> None:
    reason = slurm_cluster.check_available(PREFIX)
    if reason:
        pytest.skip(f"real SLURM unavailable here: {reason}")


def _kill_node1_on_poll(cluster: slurm_cluster.SlurmCluster, run_dir: Path, killed: list[int],
                        at_kill: dict):
    """SIGKILLs node 1's training tasks once rank 0 is 3 batches into the second epoch (or
    60 s after the first epoch's checkpoint)."""
    def on_poll(now: float, w: slurm_jobs.Watch) -> None:
        progress = _last_progress(w.text)
        if "epoch0" not in w.seen and list(run_dir.rglob("last.ckpt")):
            w.seen["epoch0"] = now
        if "kill" not in w.seen and "epoch0" in w.seen and (
                (progress and progress[0] >= 1 and progress[1] >= 3)
                or now > w.seen["epoch0"] + 60):
            # mid-way through the second epoch: node 1's ranks die at once
            killed[:] = _fit_pids(cluster.net.members[1].netns)
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            w.seen["kill"] = now
            at_kill.update(progress=progress, t=time.time())
    return on_poll


def _lost_work(run_dir: Path, kill_t: float, ckpt: dict) -> dict:
    """From the claim logs: the ranks' last trained step (and how long before the kill) in the
    first step, the restarted step's first steps, the interrupted epoch's units claimed in
    both steps (``adpsgd``: the emergency checkpoint holds the shared cursor's position;
    the measured runs of docs/slurm.md, which predate it, read their epoch again) and the gap
    in training."""
    steps = slurm_jobs.attempts(slurm_jobs.read_claims(run_dir), 4)
    before, after = steps[0], [r for s in steps[1:] for r in s]
    last = {}
    for rank in sorted({r["rank"] for r in before}):
        mine = slurm_jobs.trained([r for r in before if r["rank"] == rank])
        if mine:
            last[rank] = (mine[-1]["step"], round(kill_t - mine[-1]["t"], 1))
    report = slurm_jobs.cursor_resume_report(before, after, ckpt["epoch"])
    # the survivors' ending, s after the kill: fit failed, callbacks torn down, interpreter exit
    ending = {f"rank{r['rank']}_{r['kind']}": round(r["t"] - kill_t, 1) for r in before
              if r["kind"] in ("exception", "teardown", "exit") and r["t"] >= kill_t}
    return {"attempts": len(steps), "last_step_and_s_before_kill": last, "ending": ending,
            "ckpt_global_step": ckpt["global_step"], **report}


@pytest.mark.slow
@pytest.mark.timeout(4000)
@pytest.mark.usefixtures("slurm_available")
@pytest.mark.parametrize("strategy", ["dpsgd", "adpsgd", "adpsgd-hierarchical",
                                      "dpsgd-hierarchical"])
def test_lost_node_restarts_from_the_emergency_checkpoint(strategy: str) -> None:
    """Node 1's ranks SIGKILLed in the second epoch: the survivors write the emergency
    checkpoint, the template's retry loop resumes from it, the job completes all epochs
    (``COMPLETED``, not requeued). Hierarchical: node 1 is a whole learner. Prints the measured
    times (s after ``sbatch``), steps and claims."""
    import torch

    slurm_jobs.digits_data()
    (ROOT / "logs").mkdir(exist_ok=True)
    cluster = slurm_cluster.SlurmCluster(2, 200, cpus=2, prefix=PREFIX)
    killed: list[int] = []
    at_kill: dict = {}
    with cluster:
        start, wall_start = time.monotonic(), time.time()
        env = cluster.client_env(base_env(
            EXTRA_ARGS=f"--trainer.strategy.heartbeat_timeout={HEARTBEAT_TIMEOUT_S} "
                       + slurm_jobs.CLAIM_LOG))
        name, _, hierarchical = strategy.partition("-")
        export = (f"--export=ALL,STRATEGY={name},EPOCHS={LOST_EPOCHS},"
                  f"HIERARCHICAL={'true' if hierarchical else 'false'}")
        job = cluster.submit(slurm_jobs.DIGITS_TEMPLATE, args=[export, "--time=90"], cwd=ROOT,
                             env=env)
        out_path = ROOT / "logs" / f"digits-gossip-{job}.out"
        run_dir = ROOT / "runs" / f"digits-{job}"
        w = slurm_jobs.watch_job(cluster, job, out_path, EVENTS,
                                 _kill_node1_on_poll(cluster, run_dir, killed, at_kill),
                                 timeout_s=3600, start=start)
    info, seen, text = w.info, w.seen, w.text
    print(f"\n{strategy}: job {job} events (s after sbatch) {seen}; killed pids {killed}; "
          f"rank 0 at (epoch, batch, of) {at_kill.get('progress')} then; "
          f"{info.get('JobState')} Restarts={info.get('Restarts')}")
    assert killed, text[-6000:]
    assert info.get("JobState") == "COMPLETED", (info, text[-6000:])
    assert int(info.get("Restarts", "0")) == 0, info  # a lost rank is not a requeue
    emergency = sorted(run_dir.rglob("emergency-step=*.ckpt"))
    assert emergency, text[-6000:]
    ckpt = torch.load(emergency[0], map_location="cpu", weights_only=False)
    meta = ckpt["lightning_gossip_emergency"]
    print(f"{strategy}: {emergency[0].name}: global_step {ckpt['global_step']}, epoch "
          f"{ckpt['epoch']}, {meta}; written {emergency[0].stat().st_mtime - wall_start:.1f} s "
          f"after sbatch, {emergency[0].stat().st_mtime - at_kill['t']:.1f} s after the kill")
    for line in text.splitlines():
        if EVENTS["emergency"] in line or "PeerSilent" in line[:300]:
            print(line[:400])
    print(f"{strategy}: work: {_lost_work(run_dir, at_kill['t'], ckpt)}")
    assert meta["averaged"] and meta["survivors"] == [0, 1], meta
    assert {"emergency", "retry", "restored", "kill"} <= set(seen), seen
    restored = [ln for ln in text.splitlines() if EVENTS["restored"] in ln]
    assert restored and emergency[-1].name in restored[-1], (restored, text[-6000:])
    lasts = sorted(run_dir.rglob("last.ckpt"))
    last = torch.load(lasts[0], map_location="cpu", weights_only=False)
    assert last["epoch"] == LOST_EPOCHS - 1, last["epoch"]  # all epochs, counted from 0
