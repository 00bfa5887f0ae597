"""Preemption under SLURM's auto-requeue: the requeue signal (``SIGUSR1``) reaches the ranks at
different steps, and every rank writes the requeue checkpoint at a point all of them reach.

Lightning's own handler writes ``hpc_ckpt_<n>.ckpt`` inside the signal handler, wherever each
rank is; under ``dpsgd`` that hung under a real SLURM (three ranks in the checkpoint's average,
one waiting for its gossip round). One launch of ``tests/scripts/preempt_ranks.py`` (3 tasks
started as ``srun`` would, a fake ``scontrol`` on ``PATH``) runs a ``dpsgd`` fit, then an
``adpsgd`` fit, in the same processes; rank ``r`` signals itself after step ``3 + 2 r``. A third
and a fourth (``adpsgd``) have rank 0 at its epoch end (at the meeting; at the validation
before it) when the others take the signal. A last
``adpsgd`` fit of the same launch freezes rank 2: its survivors' emergency checkpoint is checked
as in ``tests/test_emergency_checkpoint.py``.

The real-SLURM scenario (``--signal=SIGUSR1@N``, requeue, resume) is in
``tests/test_slurm_cluster.py`` (``slow``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gossip.cursor.resume import CURSOR_KEY
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.sync_gossip import StopAgreement
from lightning_gossip.topology import build
from testbed.launch import ROOT, base_env, check, free_port, launch_processes, run_fake_slurm
from tests.test_emergency_checkpoint import check_emergency

SCRIPT = ROOT / "tests/scripts/preempt_ranks.py"
N, SIGNAL_STEP, SPREAD = 3, 3, 2


def _agreement(n: int) -> StopAgreement:
    """The agreement's arithmetic for a flat ``DPSGDStrategy()`` (random ring, seed 0)."""
    return StopAgreement(build("random_ring", n, 0), NodeLayout(n, 1, 0, 0))


def _load_ckpt(folder: Path) -> dict:
    files = sorted(folder.glob("hpc_ckpt_*.ckpt"))
    assert [f.name for f in files] == ["hpc_ckpt_1.ckpt"], files
    return torch.load(files[0], map_location="cpu", weights_only=False)


def _weights(ckpt: dict) -> np.ndarray:
    state = ckpt["state_dict"]
    return np.concatenate([state["net.weight"].numpy().ravel(), state["net.bias"].numpy()])


LOST = {"strategy": "adpsgd", "victim": 2, "kind": "stop", "step": 4, "heartbeat_timeout": 3.0}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, str, list[int]]:
    """The launch: ``(its folder, its output, each process's exit status)``."""
    tmp_path = tmp_path_factory.mktemp("preempt")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    spec = tmp_path / "spec.json"
    fits = ["dpsgd", "adpsgd", "adpsgd_epoch_end", "adpsgd_validation"]
    spec.write_text(json.dumps({"out": str(tmp_path), "devices": N, "strategies": fits,
                                "signal_step": SIGNAL_STEP, "signal_spread": SPREAD,
                                "lost": LOST}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        launch = launch_processes([(cmd, env) for cmd, env in fake_slurm_commands(spec)],
                                  timeout=500)
    assert not launch.timed_out, launch.stdout[-12000:]
    return tmp_path, launch.stdout, launch.returncodes


def fake_slurm_commands(spec: Path) -> list[tuple[list[str], dict[str, str]]]:
    """The ``N`` tasks as ``srun`` starts them on one node (``SLURM_*`` variables)."""
    port = str(free_port())
    return [([sys.executable, str(SCRIPT), str(spec)], base_env(
        SLURM_NTASKS=str(N), SLURM_NTASKS_PER_NODE=str(N), SLURM_PROCID=str(task),
        SLURM_LOCALID=str(task), SLURM_NODEID="0", SLURM_NNODES="1",
        SLURM_JOB_NAME="lightning-gossip-test", SLURM_JOB_ID="4242",
        SLURM_NODELIST="127.0.0.1", MASTER_PORT=port)) for task in range(N)]


@pytest.mark.multiprocess
def test_requeue_signal_at_different_steps_checkpoints_together(launched):
    tmp_path, text, _ = launched
    log = tmp_path / "scontrol.log"
    assert log.exists(), text[-8000:]
    # rank 0 requeued the job once per fit, with SLURM's job id
    assert log.read_text().split("\n") == ["requeue 4242"] * 4 + [""], text[-4000:]

    # dpsgd: every rank wrote the checkpoint and stopped at the same agreed step
    ranks = [json.loads((tmp_path / "dpsgd" / f"rank{r}.json").read_text()) for r in range(N)]
    rounds = _agreement(N)
    agreed = min(rounds.stop_step_for(r, SIGNAL_STEP + SPREAD * r) for r in range(N))
    for res in ranks:
        assert res["exception"] == "SIGTERMException", (res, text[-6000:])
        assert res["exit_code"] in (None, 0)
        assert res["global_step"] == res["strategy_step"] == agreed, ranks
    ckpt = _load_ckpt(tmp_path / "dpsgd")
    assert ckpt["global_step"] == agreed  # no step between the checkpoint and the stop
    mean = np.mean([np.asarray(res["replica"]) for res in ranks], axis=0)
    np.testing.assert_allclose(_weights(ckpt), mean, rtol=0, atol=1e-6)

    # adpsgd: each rank at its own next batch, the checkpoint the average of the replicas
    ranks = [json.loads((tmp_path / "adpsgd" / f"rank{r}.json").read_text()) for r in range(N)]
    for r, res in enumerate(ranks):
        assert res["exception"] == "SIGTERMException", (res, text[-6000:])
        assert res["global_step"] == SIGNAL_STEP + SPREAD * r, ranks
    assert "the ranks' steps at the requeue checkpoint: [3, 5, 7] (sum 15)" in text, text[-6000:]
    ckpt = _load_ckpt(tmp_path / "adpsgd")
    assert ckpt["global_step"] == ranks[0]["global_step"]
    # the shared cursor's position (#22): the 15 batches trained, and at most one more claimed
    # per rank (the loader's prefetch); the resumed epoch claims only the rest of its 24
    cursor = ckpt[CURSOR_KEY]
    assert cursor["epoch"] == 0 and 15 <= cursor["claims"] <= 15 + N, cursor
    assert _resumed_epoch_batches(tmp_path / "adpsgd" / "hpc_ckpt_1.ckpt") == 24 - cursor["claims"]
    mean = np.mean([np.asarray(res["replica"]) for res in ranks], axis=0)
    np.testing.assert_allclose(_weights(ckpt), mean, rtol=0, atol=1e-6)

    # the requeue checkpoint resumes: a fit from it starts at its step
    _resume_one_step(tmp_path / "dpsgd" / "hpc_ckpt_1.ckpt", agreed)


@pytest.mark.multiprocess
@pytest.mark.parametrize("fit", ["adpsgd_epoch_end", "adpsgd_validation"])
def test_requeue_while_a_rank_is_at_its_epoch_end(launched, fit):
    """adpsgd: rank 0 is at its epoch end (all its batches done: at the meeting, or at the
    validation that comes first) when ranks 1 and 2 take the requeue signal at their batch
    start (after step 3): the requeue meets it in the epoch-end meeting's collective, every
    rank writes the checkpoint and stops. Before, the ranks met in different collectives (the
    checkpoint's average, or the meeting, against the meeting or the validation's average):
    one rank died (no Python exception), the others failed, no checkpoint."""
    tmp_path, text, _ = launched
    out = tmp_path / fit
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(N)]
    for res in ranks:
        assert res["exception"] == "SIGTERMException", (res, text[-6000:])
        assert res.get("exit_code") in (None, 0), res
    assert ranks[0]["global_step"] == 96 // N // 4, ranks  # its whole epoch
    assert [res["global_step"] for res in ranks[1:]] == [SIGNAL_STEP] * 2, ranks
    assert text.count("the ranks' steps at the requeue checkpoint: [8, 3, 3] (sum 14)") == 2, (
        text[-6000:])
    ckpt = _load_ckpt(out)
    assert ckpt["global_step"] == ranks[0]["global_step"]
    mean = np.mean([np.asarray(res["replica"]) for res in ranks], axis=0)
    np.testing.assert_allclose(_weights(ckpt), mean, rtol=0, atol=1e-6)
    _resume_one_step(out / "hpc_ckpt_1.ckpt", ckpt["global_step"])


@pytest.mark.multiprocess
def test_survivors_of_a_frozen_adpsgd_rank_write_an_emergency_checkpoint(launched):
    """The launch's last fit: adpsgd, rank 2 of 3 frozen (SIGSTOP) after its step 4."""
    tmp_path, text, code = launched
    out = tmp_path / "lost"
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else None
               for r in range(N)]
    assert (out / "victim.json").exists(), text[-8000:]
    path, ckpt = check_emergency(out, results, LOST["victim"], text)
    # the survivors failed (PeerSilent) after writing it; the frozen victim was killed
    assert code == [3, 3, -9], (code, text[-8000:])
    # the shared cursor's position: the epoch's batches trained before the loss, and at most
    # two more claimed per rank (the step the error interrupted and the loader's prefetch); a
    # restart claims only the rest of the epoch's 64
    victim = json.loads((out / "victim.json").read_text())
    trained = victim["global_step"] + sum(r["global_step"] for r in results if r is not None)
    cursor = ckpt[CURSOR_KEY]
    assert cursor["epoch"] == ckpt["epoch"] == 0, (cursor, ckpt["epoch"])
    assert trained <= cursor["claims"] <= trained + 2 * N, (cursor, trained)
    assert _resumed_epoch_batches(path, samples=256) == 64 - cursor["claims"]


def _resumed_epoch_batches(path: Path, samples: int = 96) -> int:
    """The batches a fit resumed from ``path`` draws in the interrupted epoch (one rank alone
    on a fresh store, as after the requeue: the same ``samples`` in batches of 4)."""
    import torch.distributed as dist

    from lightning_gossip import ADPSGDStrategy
    from lightning_gossip.cursor.sampler import SharedCursorSampler

    strategy = ADPSGDStrategy()
    strategy.load_checkpoint(path)
    sampler = SharedCursorSampler(samples, chunk_size=4, store=dist.HashStore(), key="resumed")
    strategy.cursor.track(sampler.claims)
    list(sampler)
    return sampler.claimed


def _resume_one_step(path: Path, step: int) -> None:
    import lightning as L

    spec = importlib.util.spec_from_file_location("preempt_ranks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.randn(8, 5)
    data = torch.utils.data.TensorDataset(x, (x.sum(-1) > 0).long())
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=step + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module.Tiny(), torch.utils.data.DataLoader(data, batch_size=4),
                ckpt_path=str(path))
    assert trainer.global_step == step + 1


@pytest.mark.multiprocess
def test_a_resumed_fit_draws_each_sample_once(tmp_path: Path) -> None:
    """#22: an adpsgd fit (shared cursor) resumed from the checkpoint of epoch 0's end trains
    each sample of epoch 1 once. Lightning's loader prefetches its first batch before it sets
    the sampler's epoch, so without the fix the resumed fit drew that batch from epoch 0's
    counter and its whole epoch from epoch 0's permutation: 2 batches twice (one per rank)."""
    check(run_fake_slurm(ROOT / "tests/scripts/resume_epoch_ranks.py", str(tmp_path), ntasks=2,
                         timeout=300))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(s for r in ranks for s in r["first"]["0"]) == list(range(64)), ranks
    assert [r["resumed"].get("0") for r in ranks] == [None, None], ranks
    resumed = sorted(s for r in ranks for s in r["resumed"]["1"])
    assert resumed == list(range(64)), ranks
