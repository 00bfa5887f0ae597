"""The recipes' CLIs resume a fit with ``--ckpt_path last`` (what a restarted or requeued job
passes, docs/faults.md and docs/slurm.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from testbed.launch import check, run_lightning
from tests.recipes.test_imagenet_data import digits_tree

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "recipes" / "imagenet" / "configs" / "digits.yaml"
SYNTH = ROOT / "recipes" / "asr" / "configs" / "synth.yaml"


@pytest.mark.parametrize("module,config", [("recipes.asr.cli", SYNTH),
                                           ("recipes.imagenet.cli", DIGITS)])
def test_cli_accepts_ckpt_path_last(module: str, config: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={config}", "--ckpt_path=last", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "ckpt_path: last" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.timeout(2400)  # two launches of up to 900 s on a loaded machine
def test_imagenet_cli_resumes_from_last(tmp_path_factory: pytest.TempPathFactory,
                                        tmp_path: Path) -> None:
    """2 ranks, dpsgd: a 1-epoch fit, then the same command with ``--trainer.max_epochs=2``
    and ``--ckpt_path last`` trains only the second epoch, from the first one's last.ckpt."""
    digits = digits_tree(tmp_path_factory)
    ckpt = tmp_path / "ckpt"

    def fit(epochs: int) -> str:
        return check(run_lightning(
            "recipes.imagenet", "fit", f"--config={DIGITS}", f"--data.root={digits}",
            "--trainer.strategy=dpsgd", "--trainer.devices=2", f"--trainer.max_epochs={epochs}",
            "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=2",
            "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={ckpt}", "--trainer.callbacks.save_last=true",
            "--ckpt_path=last", timeout=900))

    first = fit(1)
    assert "there is no last checkpoint available" in first  # a fresh start: a warning only
    assert torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"] == 5
    second = fit(2)
    assert "Restoring states from the checkpoint path at" in second, second[-4000:]
    assert str(ckpt / "last.ckpt") in second
    state = torch.load(ckpt / "last.ckpt", weights_only=False)
    assert (state["epoch"], state["global_step"]) == (1, 10)
