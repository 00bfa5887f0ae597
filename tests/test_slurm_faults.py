"""A node lost under the real SLURM (``make test-slow``): the digits CPU template on 2 nodes x 2
tasks, node 1's two ranks SIGKILLed mid-epoch.

The survivors (node 0's ranks) name the lost ranks within ``heartbeat_timeout`` + about 10 s,
write the emergency checkpoint (``emergency-step=<s>-rank=0.ckpt``, the survivors' average) and
fail; the ``srun`` step ends, and the template's retry loop runs a new step that resumes from the
newest checkpoint (the emergency one) and finishes the epochs. Needs root, network namespaces and
SLURM (see ``tests/test_slurm_cluster.py``). Times are printed, never asserted; the waits only
bound a hang.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from benchmarks.launch import ROOT, base_env
from tests.test_slurm_cluster import PREFIX, N, S, _digits_data, slurm_available  # noqa: F401

pytestmark = pytest.mark.multiprocess

LOST_EPOCHS = 4
HEARTBEAT_TIMEOUT_S = 20.0
EVENTS = {"emergency": "wrote the emergency checkpoint",
          "retry": "attempt 1 failed: restarting from the newest checkpoint",
          "restored": "Restored all states from the checkpoint"}
#: rank 0's progress bar: ``0: Epoch 1:  45%|...| 5/11`` (``5/?`` or ``5it`` without a length)
PROGRESS = re.compile(r"Epoch (\d+):\s*(?:(?:\d+%)?\|[^|]*\|\s*)?(\d+)(?:/(\d+|\?)|it)")


def _fit_pids(netns: str) -> list[int]:
    """The training tasks (``python -m recipes.imagenet fit``) in a node's namespace."""
    pids = []
    for pid in N.namespace_pids(netns):
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


@pytest.mark.slow
@pytest.mark.timeout(4000)
@pytest.mark.usefixtures("slurm_available")
@pytest.mark.parametrize("strategy", ["dpsgd", "adpsgd"])
def test_lost_node_restarts_from_the_emergency_checkpoint(strategy: str) -> None:
    """Node 1's ranks SIGKILLed in the second epoch: the survivors write the emergency
    checkpoint, the template's retry loop resumes from it, the job completes all epochs
    (``COMPLETED``, not requeued). Prints the measured times (s after ``sbatch``) and steps."""
    import torch

    _digits_data()
    (ROOT / "logs").mkdir(exist_ok=True)
    script = ROOT / "recipes/imagenet/slurm/digits_cpu.sbatch"
    cluster = S.SlurmCluster(2, 200, cpus=2, prefix=PREFIX)
    seen: dict[str, float] = {}
    at_kill: tuple[int, int, str] | None = None
    killed: list[int] = []
    with cluster:
        start, wall_start = time.monotonic(), time.time()
        env = cluster.client_env(base_env(
            EXTRA_ARGS=f"--trainer.strategy.heartbeat_timeout={HEARTBEAT_TIMEOUT_S}"))
        export = f"--export=ALL,STRATEGY={strategy},EPOCHS={LOST_EPOCHS}"
        job = cluster.submit(script, args=[export, "--time=90"], cwd=ROOT, env=env)
        out_path = ROOT / "logs" / f"digits-gossip-{job}.out"
        run_dir = ROOT / "runs" / f"digits-{job}"
        info: dict[str, str] = {}
        while time.monotonic() - start < 3600:
            info = cluster.job(job) or info
            text = out_path.read_text(errors="replace") if out_path.exists() else ""
            now = round(time.monotonic() - start, 1)
            for name, marker in EVENTS.items():
                if marker in text and name not in seen:
                    seen[name] = now
            progress = _last_progress(text)
            if "epoch0" not in seen and list(run_dir.rglob("last.ckpt")):
                seen["epoch0"] = now
            if "kill" not in seen and "epoch0" in seen and (
                    (progress and progress[0] >= 1 and progress[1] >= 3)
                    or now > seen["epoch0"] + 60):
                # mid-way through the second epoch: node 1's ranks die at once
                killed = _fit_pids(cluster.net.members[1].netns)
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
                seen["kill"], at_kill = now, progress
            if info.get("JobState") in S.TERMINAL_STATES:
                break
            time.sleep(1)
    text = out_path.read_text(errors="replace") if out_path.exists() else ""
    print(f"\n{strategy}: events (s after sbatch) {seen}; killed pids {killed}; rank 0 at "
          f"(epoch, batch, of) {at_kill} then; {info.get('JobState')} "
          f"Restarts={info.get('Restarts')}")
    assert killed, text[-6000:]
    assert info.get("JobState") == "COMPLETED", (info, text[-6000:])
    assert int(info.get("Restarts", "0")) == 0, info  # a lost rank is not a requeue
    emergency = sorted(run_dir.rglob("emergency-step=*.ckpt"))
    assert emergency, text[-6000:]
    ckpt = torch.load(emergency[0], map_location="cpu", weights_only=False)
    meta = ckpt["lightning_gossip_emergency"]
    print(f"{strategy}: {emergency[0].name}: global_step {ckpt['global_step']}, epoch "
          f"{ckpt['epoch']}, {meta}; written {emergency[0].stat().st_mtime - wall_start:.1f} s "
          "after sbatch")
    for line in text.splitlines():
        if EVENTS["emergency"] in line or "PeerSilent" in line[:300]:
            print(line[:400])
    assert meta["averaged"] and meta["survivors"] == [0, 1], meta
    assert {"emergency", "retry", "restored", "kill"} <= set(seen), seen
    restored = [ln for ln in text.splitlines() if EVENTS["restored"] in ln]
    assert restored and emergency[-1].name in restored[-1], (restored, text[-6000:])
    lasts = sorted(run_dir.rglob("last.ckpt"))
    last = torch.load(lasts[0], map_location="cpu", weights_only=False)
    assert last["epoch"] == LOST_EPOCHS - 1, last["epoch"]  # all epochs, counted from 0
