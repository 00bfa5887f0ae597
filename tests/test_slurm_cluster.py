"""A real SLURM on the emulated cluster (``testbed/slurm_cluster.py``): one ``sbatch`` job.

Needs root, network namespaces and SLURM (installed with apt when missing); skips with the
reason elsewhere. Brings up munged, slurmctld and two slurmd's (one per emulated node), runs one
batch job of 2 nodes x 2 tasks whose tasks print the SLURM task numbers and the ranks Lightning's
``SLURMEnvironment`` derives from them, and checks that everything the cluster made is gone after
``close()``. A second test kills the process that owns a cluster (SIGKILL, no clean-up) and checks
that :func:`slurm_cluster.remove_leftovers` (``cluster.py --cleanup``) removes what it left.
Timings are never asserted; the waits only bound a hang.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testbed import cluster_net, slurm_cluster
from testbed.launch import ROOT, base_env
from tests import slurm_jobs

pytestmark = pytest.mark.multiprocess

#: this module's own name prefix, no extension of a benchmark's or another test's (see
#: ``tests/test_cluster_smoke.py``); LG_SLURM_TEST_PREFIX overrides it where several sessions
#: bring up clusters on one machine (each its own prefix, none an extension of another)
PREFIX = os.environ.get("LG_SLURM_TEST_PREFIX", "tsj")
JOB_TIMEOUT_S = 600.0  # only bounds a hang: 4 Python processes importing Lightning on 2 cores

RANKS_SCRIPT = """\
import json, os, socket
from lightning.pytorch.plugins.environments import SLURMEnvironment as E
e = E()
print("RANKS " + json.dumps({
    "host": socket.gethostname(), "detected": E.detect(),
    "procid": int(os.environ["SLURM_PROCID"]), "localid": int(os.environ["SLURM_LOCALID"]),
    "nodeid": int(os.environ["SLURM_NODEID"]), "global_rank": e.global_rank(),
    "local_rank": e.local_rank(), "node_rank": e.node_rank(), "world_size": e.world_size(),
    "main_address": e.main_address, "master_resolves_to": socket.gethostbyname(e.main_address),
    "own_address": socket.gethostbyname(socket.gethostname())}), flush=True)
"""


@pytest.fixture(scope="module")
def slurm_available() -> None:
    reason = slurm_cluster.check_available(PREFIX)
    if reason:
        pytest.skip(f"real SLURM unavailable here: {reason}")


def _remains(cluster_suffix: str) -> list[str]:
    """What of the run ``cluster_suffix`` still exists (namespaces, links, folders)."""
    left = (cluster_net.leftovers(f"{PREFIX}-{cluster_suffix}-")
            + cluster_net.leftovers(f"{PREFIX}{cluster_suffix}"))
    left += [str(p) for p in slurm_cluster.ETC_NETNS.glob(f"{PREFIX}-{cluster_suffix}-*")]
    left += [str(p) for p in Path("/tmp").glob(f"{PREFIX}-slurm-{cluster_suffix}")]
    return left


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not slurm_cluster._is_zombie(pid)


def test_sbatch_two_nodes_ranks(slurm_available: None, tmp_path: Path) -> None:
    """sbatch on 2 nodes x 2 tasks: SLURM_PROCID/LOCALID/NODEID = Lightning's ranks."""
    (tmp_path / "ranks.py").write_text(RANKS_SCRIPT)
    script = tmp_path / "ranks.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name=lg-ranks
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=2
        #SBATCH --output={tmp_path}/%x-%j.out
        set -euo pipefail
        srun {sys.executable} {tmp_path}/ranks.py
        """))
    cluster = slurm_cluster.SlurmCluster(2, 200, cpus=2, prefix=PREFIX)
    with cluster:
        pids = [p.pid for p in cluster.daemons] + [cluster.munged.pid]
        assert cluster.client(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split() == [
            "node0", "idle", "node1", "idle"]
        job = cluster.submit(script, cwd=tmp_path, env=cluster.client_env(base_env()))
        info = cluster.wait(job, JOB_TIMEOUT_S)
    out = Path(info.get("StdOut", "")).read_text() if info.get("StdOut") else ""
    assert info.get("JobState") == "COMPLETED", (info, out)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
             if line.startswith("RANKS ")]
    assert sorted(r["procid"] for r in ranks) == [0, 1, 2, 3], out
    for r in ranks:
        assert r["detected"] is True
        assert (r["global_rank"], r["local_rank"], r["node_rank"]) == (
            r["procid"], r["localid"], r["nodeid"]), r
        assert r["procid"] == 2 * r["nodeid"] + r["localid"], r
        assert r["host"] == f"node{r['nodeid']}", r  # each slurmd in its node's UTS namespace
        assert r["world_size"] == 4 and r["main_address"] == "node0", r
        # node names resolve inside the namespaces, to the node's own address on its link
        assert r["own_address"] == cluster.net.members[r["nodeid"]].address, r
        assert r["master_resolves_to"] == cluster.net.members[0].address, r
    assert sorted((r["nodeid"], r["localid"]) for r in ranks) == list(
        itertools.product(range(2), range(2)))
    assert _remains(cluster.net.suffix) == []
    assert [p for p in pids if _alive(p)] == []


def test_cleanup_after_a_killed_run(slurm_available: None, tmp_path: Path) -> None:
    """The owner of a running SLURM cluster is SIGKILLed: remove_leftovers removes the rest."""
    code = textwrap.dedent(f"""\
        import time
        from testbed import slurm_cluster
        c = slurm_cluster.SlurmCluster(2, 100, prefix={PREFIX!r}).start()
        print(c.net.suffix, *[p.pid for p in c.daemons], c.munged.pid, flush=True)
        time.sleep(600)
        """)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT, env=base_env(), start_new_session=True)
    try:
        line = owner.stdout.readline().split()
        assert line, "the cluster did not come up"
        suffix, pids = line[0], [int(p) for p in line[1:]]
        assert all(_alive(p) for p in pids)
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
    assert _remains(suffix) != []  # nothing cleaned up after a SIGKILL ...
    removed = slurm_cluster.remove_leftovers(PREFIX)
    assert any(suffix in r for r in removed), removed
    assert _remains(suffix) == []  # ... until --cleanup
    assert [p for p in pids if _alive(p)] == []


# ----------------------------------------------------------------------------------------------
# Preemption under the real SLURM (make test-slow): the digits CPU template with a time limit
# ----------------------------------------------------------------------------------------------
#: a time limit far away at first; once an epoch is done the test brings it to 3 minutes from
#: now (``scontrol update TimeLimit``), so SLURM's ``SIGUSR1@120`` falls in the training (Python's
#: start-up time varies too much on a busy machine to place it with a fixed limit), and puts it
#: back once the job is requeued
PREEMPT_ARGS = ["--time=60", "--signal=SIGUSR1@120"]
PREEMPT_EPOCHS = 6
#: every training batch lasts at least 2.5 s until the requeue: the signal (within about 90 s
#: of the limit's change, SLURM checking limits every 30 s) then falls in the 5 epochs left,
#: which on an idle machine would otherwise take well under a minute
PACE = "--trainer.callbacks.pace_s=2.5"
#: the requeue checkpoint's key of the shared cursor's position (``cursor_resume.CURSOR_KEY``)
CURSOR_KEY = "lightning_gossip_cursor"
EVENTS = {"signal": "Handling auto-requeue signal at step",
          "requeued": "DUE TO JOB REQUEUE",  # slurmstepd, as the requeue ends the step
          "restored": "Restored all states from the checkpoint"}


def _preempt_on_poll(cluster: slurm_cluster.SlurmCluster, job: str, run_dir: Path):
    """Brings the time limit near once the first epoch is done, back once requeued."""
    def on_poll(now: float, w: slurm_jobs.Watch) -> None:
        if "limit" not in w.seen and list(run_dir.rglob("last.ckpt")):
            minutes = slurm_jobs.seconds(w.info.get("RunTime", "0:0:0")) // 60 + 3
            cluster.client(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"])
            w.seen["limit"] = now
        if int(w.info.get("Restarts", "0") or 0) >= 1 and "unlimit" not in w.seen:
            cluster.client(["scontrol", "update", f"JobId={job}", "TimeLimit=60"])
            w.seen["unlimit"] = now
    return on_poll


def check_cursor_resume(run_dir: Path, ckpt: dict, world: int, devices: int) -> dict:
    """The claim logs of a requeued adpsgd run against its requeue checkpoint ``ckpt``: the
    ranks claimed exactly the cursor position's units of the interrupted epoch before the
    requeue and nothing of a later epoch; the resumed step claimed the rest, so that every
    unit of the epoch was claimed as often as in an uninterrupted epoch of the same run (once;
    a hierarchical node's last claim pads with the epoch's first unit), each from the epoch's
    own permutation: each sample once in the epoch across the requeue (those prefetched but
    not trained before it are skipped). What it measured."""
    position = ckpt.get(CURSOR_KEY)
    assert position is not None, "the requeue checkpoint holds no cursor position"
    steps = slurm_jobs.attempts(slurm_jobs.read_claims(run_dir), world)
    assert len(steps) == 2, [len(s) for s in steps]  # the step before the requeue, and after
    before, after = steps
    assert {r["restart"] for r in before} == {0} and {r["restart"] for r in after} == {1}
    report = slurm_jobs.cursor_resume_report(before, after, position["epoch"])
    assert report["claimed_before"] == position["claims"] * devices, (report, position)
    assert report["claims_of_later_epochs_before"] == 0, report
    assert report["union_is_one_epoch"], report
    # ... and from that epoch's permutation: every pass over the sampler drew the epoch it
    # claimed in (a resumed fit's first pass began at epoch 0 before the fix of #22)
    assert report["off_epoch_claims"] == 0 and report["claims_of_earlier_epochs_after"] == 0, (
        report)
    if devices == 1:  # every rank claims alone: the units are the counter's values
        assert report["claimed_in_both"] == [], report
    return report


@pytest.mark.slow
@pytest.mark.timeout(4000)
@pytest.mark.parametrize("strategy", ["dpsgd", "adpsgd", "adpsgd-hierarchical"])
def test_preemption_requeues_and_resumes(slurm_available: None, strategy: str) -> None:
    """``--signal=SIGUSR1@120`` near a time limit on the digits CPU template (2 nodes x 2
    tasks, 6 epochs): the requeue checkpoint is written at one step on every rank (the ranks
    stop there: no step is repeated beyond it), the job is requeued, resumes from it and
    finishes the 6 epochs. Under ``adpsgd`` the checkpoint holds the shared cursor's position
    and the resumed epoch claims exactly the units not yet claimed (every rank's claims, from
    the claim logs of ``tests/scripts/claim_log.py``). Prints the measured times (s after
    ``sbatch``) and claims."""
    slurm_jobs.digits_data()
    (ROOT / "logs").mkdir(exist_ok=True)
    cluster = slurm_cluster.SlurmCluster(2, 200, cpus=2, prefix=PREFIX)
    with cluster:
        start = time.monotonic()
        env = cluster.client_env(base_env(EXTRA_ARGS=f"{slurm_jobs.CLAIM_LOG} {PACE}"))
        name, _, hierarchical = strategy.partition("-")
        export = (f"--export=ALL,STRATEGY={name},EPOCHS={PREEMPT_EPOCHS},"
                  f"HIERARCHICAL={'true' if hierarchical else 'false'}")
        job = cluster.submit(slurm_jobs.DIGITS_TEMPLATE, args=[export, *PREEMPT_ARGS], cwd=ROOT,
                             env=env)
        out_path = ROOT / "logs" / f"digits-gossip-{job}.out"
        run_dir = ROOT / "runs" / f"digits-{job}"
        w = slurm_jobs.watch_job(cluster, job, out_path, EVENTS,
                                 _preempt_on_poll(cluster, job, run_dir), timeout_s=3600,
                                 poll_s=2, start=start)
    info, seen, text = w.info, w.seen, w.text
    print(f"\n{strategy}: job {job} events (s after sbatch) {seen}; {info.get('JobState')} "
          f"Restarts={info.get('Restarts')}")
    assert info.get("JobState") == "COMPLETED", (info, text[-6000:])
    assert int(info.get("Restarts", "0")) >= 1, info
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
    assert hpc, text[-6000:]
    import torch

    ckpt = torch.load(hpc[0], map_location="cpu", weights_only=False)
    step = int(text.split(EVENTS["signal"], 1)[1].split(":", 1)[0])
    print(f"{strategy}: hpc checkpoint at global step {ckpt['global_step']}, epoch "
          f"{ckpt['epoch']}, cursor {ckpt.get(CURSOR_KEY)}; rank 0 was at step {step} when "
          "every rank wrote it")
    # rank 0's step: dpsgd's ranks all stopped there (nothing repeated beyond it); adpsgd's
    # stopped at their own steps, all in the checkpoint's average (logged, printed here)
    assert ckpt["global_step"] == step
    steps = [ln for ln in text.splitlines() if "steps at the requeue checkpoint" in ln]
    print(f"{strategy}: {steps[0] if steps else 'no per-rank steps logged'}")
    restored = [ln for ln in text.splitlines() if EVENTS["restored"] in ln]
    assert restored and hpc[-1].name in restored[0], (restored, text[-6000:])
    lasts = sorted(run_dir.rglob("last.ckpt"))
    last = torch.load(lasts[0], map_location="cpu", weights_only=False)
    assert last["epoch"] == PREEMPT_EPOCHS - 1, last["epoch"]  # all epochs, counted from 0
    if strategy.startswith("adpsgd"):
        assert steps, text[-6000:]
        report = check_cursor_resume(run_dir, ckpt, world=4, devices=2 if hierarchical else 1)
        print(f"{strategy}: claims of the interrupted epoch {report}")
