"""The survivors of a lost rank write an emergency checkpoint, and a restart resumes from it.

Pure: :func:`lightning_gossip.checkpoints.newest_checkpoint`. Real ranks: one launch per strategy
of ``tests/scripts/emergency_ranks.py`` (3 tasks started as ``srun`` would): ``dpsgd`` with
rank 1 killed (``SIGKILL``) after step 4; ``adpsgd`` with rank 2 frozen (``SIGSTOP``) is the
last fit of the launch of ``tests/test_preemption.py`` (one launch less). The
two survivors meet, average their replicas and the lower one writes
``emergency-step=<s>-rank=0.ckpt`` next to the run's checkpoints; a fit resumes from it.
The fuzzed campaign (random rank, time and kind) is ``testbed/emergency_fuzz.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gossip.checkpoints import main as checkpoints_main
from lightning_gossip.checkpoints import newest_checkpoint
from testbed.emergency_fuzz import SCRIPT, N, launch_lost_rank


def test_newest_checkpoint_picks_the_latest_of_last_hpc_and_emergency(tmp_path, capsys):
    assert newest_checkpoint(tmp_path, tmp_path / "missing") is None
    names = ["ckpts/last.ckpt", "hpc_ckpt_2.ckpt", "ckpts/emergency-step=7-rank=0.ckpt",
             "ckpts/epoch=0-step=3.ckpt", "ckpts/emergency-step=9-rank=0.ckpt.part"]
    for i, name in enumerate(names):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        os.utime(path, (1000.0 + i, 1000.0 + i))
    # the epoch checkpoint and the partly written file are newer, but never resumed from
    assert newest_checkpoint(tmp_path) == str(tmp_path / names[2])
    os.utime(tmp_path / names[1], (2000.0, 2000.0))
    assert newest_checkpoint(tmp_path / "ckpts", tmp_path) == str(tmp_path / names[1])
    assert checkpoints_main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / names[1]}\n"
    assert checkpoints_main([str(tmp_path / "missing")]) == 0
    assert capsys.readouterr().out == ""


def load_module():
    spec = importlib.util.spec_from_file_location("emergency_ranks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resume(path: str, step: int) -> int:
    """Fit one more step from ``path`` in this process; the global step reached."""
    import lightning as L

    x = torch.randn(8, 5)
    data = torch.utils.data.TensorDataset(x, (x.sum(-1) > 0).long())
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=step + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(load_module().Tiny(), torch.utils.data.DataLoader(data, batch_size=4),
                ckpt_path=path)
    return trainer.global_step


def check_emergency(out: Path, results: list[dict | None], victim: int, text: str,
                    n: int = N) -> tuple[Path, dict]:
    """The survivors named the victim and met; the lowest wrote their average, with its
    optimizer state, as the newest checkpoint; a fit resumes from it. Returns the file and
    the checkpoint it holds."""
    survivors = [r for r in range(n) if r != victim]
    for r in survivors:
        res = results[r]
        assert res is not None, text[-8000:]
        assert res["lost"] == "PeerSilent", (res, text[-6000:])
        assert victim in res["ranks"], res
    files = sorted((out / "ckpts").glob("*emergency*"))
    assert len(files) == 1 and files[0].name.endswith(f"-rank={survivors[0]}.ckpt"), (
        files, text[-8000:])
    ckpt = torch.load(files[0], map_location="cpu", weights_only=False)
    info = ckpt["lightning_gossip_emergency"]
    assert info["survivors"] == survivors and info["averaged"] is True, info
    state = ckpt["state_dict"]
    weights = np.concatenate([state["net.weight"].numpy().ravel(), state["net.bias"].numpy()])
    mean = np.mean([np.asarray(results[r]["replica"]) for r in survivors], axis=0)
    np.testing.assert_allclose(weights, mean, rtol=0, atol=1e-6)
    assert files[0].name == f"emergency-step={ckpt['global_step']}-rank={survivors[0]}.ckpt"
    assert ckpt["optimizer_states"][0]["state"], "the writer's optimizer state (momentum)"
    assert newest_checkpoint(out) == str(files[0])
    assert _resume(str(files[0]), ckpt["global_step"]) == ckpt["global_step"] + 1
    return files[0], ckpt


@pytest.mark.multiprocess
def test_survivors_of_a_killed_dpsgd_rank_write_an_emergency_checkpoint(tmp_path):
    """dpsgd, rank 1 of 3 killed after step 4 (adpsgd with a frozen rank: the launch of
    tests/test_preemption.py)."""
    results, lost, text, _ = launch_lost_rank(tmp_path, "dpsgd", 1, "kill", step=4)
    assert lost, text[-8000:]
    # the survivors failed (PeerSilent) after writing it: the script's 3, never a signal
    assert json.loads((tmp_path / "returncodes.json").read_text()) == [3, -9, 3], text[-8000:]
    check_emergency(tmp_path, results, 1, text)
