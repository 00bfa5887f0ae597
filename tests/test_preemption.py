"""Preemption under SLURM's auto-requeue: the requeue signal (``SIGUSR1``) reaches the ranks at
different steps, and every rank writes the requeue checkpoint at a point all of them reach.

Lightning's own handler writes ``hpc_ckpt_<n>.ckpt`` inside the signal handler, wherever each
rank is; under ``dpsgd`` that hung under a real SLURM (three ranks in the checkpoint's average,
one waiting for its gossip round). One launch of ``tests/scripts/preempt_ranks.py`` (3 tasks
started as ``srun`` would, a fake ``scontrol`` on ``PATH``) runs a ``dpsgd`` fit, then an
``adpsgd`` fit, in the same processes; rank ``r`` signals itself after step ``3 + 2 r``.

The real-SLURM scenario (``--signal=SIGUSR1@N``, requeue, resume) is in
``tests/test_slurm_cluster.py`` (``slow``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gossip.strategies.dpsgd_rounds import _RoundsMixin
from lightning_gossip.topology import build
from tests.launch import ROOT, run_fake_slurm

SCRIPT = ROOT / "tests/scripts/preempt_ranks.py"
N, SIGNAL_STEP, SPREAD = 3, 3, 2


class _Rounds(_RoundsMixin):
    """The agreement's arithmetic for a flat ``DPSGDStrategy()`` (random ring, seed 0)."""

    def __init__(self, n: int) -> None:
        self.world_size, self.delay_by_one = n, False
        self.topology = build("random_ring", n, 0)
        from lightning_gossip.hierarchy import NodeLayout

        self.layout = NodeLayout(n, 1, 0, 0)


def _load_ckpt(folder: Path) -> dict:
    files = sorted(folder.glob("hpc_ckpt_*.ckpt"))
    assert [f.name for f in files] == ["hpc_ckpt_1.ckpt"], files
    return torch.load(files[0], map_location="cpu", weights_only=False)


def _weights(ckpt: dict) -> np.ndarray:
    state = ckpt["state_dict"]
    return np.concatenate([state["net.weight"].numpy().ravel(), state["net.bias"].numpy()])


@pytest.mark.multiprocess
def test_requeue_signal_at_different_steps_checkpoints_together(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "devices": N, "strategies": ["dpsgd",
                                "adpsgd"], "signal_step": SIGNAL_STEP, "signal_spread": SPREAD}))
    result = run_fake_slurm(SCRIPT, str(spec), ntasks=N, timeout=400)
    text = result.stdout
    assert result.returncode == 0, text[-8000:]
    # rank 0 requeued the job once per fit, with SLURM's job id
    assert log.read_text().split("\n") == ["requeue 4242", "requeue 4242", ""], text[-4000:]

    # dpsgd: every rank wrote the checkpoint and stopped at the same agreed step
    ranks = [json.loads((tmp_path / "dpsgd" / f"rank{r}.json").read_text()) for r in range(N)]
    rounds = _Rounds(N)
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
    ckpt = _load_ckpt(tmp_path / "adpsgd")
    assert ckpt["global_step"] == ranks[0]["global_step"]
    mean = np.mean([np.asarray(res["replica"]) for res in ranks], axis=0)
    np.testing.assert_allclose(_weights(ckpt), mean, rtol=0, atol=1e-6)

    # the requeue checkpoint resumes: a fit from it starts at its step
    _resume_one_step(tmp_path / "dpsgd" / "hpc_ckpt_1.ckpt", agreed)


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
