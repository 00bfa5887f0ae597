"""Where a run's checkpoints are, and which one a restart resumes from.

A gossip run can leave three kinds of checkpoint:

* ``last.ckpt`` (and ``last-v<n>.ckpt``) of ``ModelCheckpoint(save_last=True)``: epoch ends
  or every ``every_n_train_steps``;
* ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``: written when SLURM's requeue signal arrived
  (Lightning's auto-requeue, at a batch boundary under the gossip strategies);
* ``emergency-step=<s>-rank=<r>.ckpt``: written by the survivors of a lost rank before they
  exit (``docs/faults.md``), next to the others (:func:`checkpoint_dir`).

:func:`newest_checkpoint` returns the most recently written of them, the one a restart should
resume from (``trainer.fit(ckpt_path=newest_checkpoint(run_dir))``). From a shell (a batch
script, a torchrun restart loop) ``python -m lightning_gossip.checkpoints RUN_DIR`` prints it,
or nothing when there is none yet::

    CKPT=$(python -m lightning_gossip.checkpoints "$RUN_DIR")
    srun python -m recipes.imagenet fit ... --ckpt_path="${CKPT:-last}"

This module imports neither torch nor Lightning.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["RESUME_PATTERNS", "checkpoint_dir", "newest_checkpoint"]

#: the file names a restart may resume from (``glob`` patterns, searched recursively)
RESUME_PATTERNS = ("last*.ckpt", "hpc_ckpt_*.ckpt", "*emergency*.ckpt")


def checkpoint_dir(trainer: Any) -> Path:
    """The folder of the run's checkpoints: the ``dirpath`` of the trainer's
    ``ModelCheckpoint`` (set once fitting started), else ``<default_root_dir>/checkpoints``."""
    dirpath = getattr(getattr(trainer, "checkpoint_callback", None), "dirpath", None)
    if dirpath:
        return Path(dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def newest_checkpoint(*folders: str | Path) -> str | None:
    """The most recently modified of the ``last``, ``hpc`` and ``emergency`` checkpoints under
    ``folders`` (searched recursively: a logger's ``version_<n>/checkpoints`` too), or
    ``None`` when there is none. Partly written files (``*.part``) are never returned.

    Example::

        trainer.fit(model, ckpt_path=newest_checkpoint("runs/job-42") or "last")
    """
    found: dict[Path, float] = {}
    for folder in folders:
        root = Path(folder)
        if not root.is_dir():
            continue
        for pattern in RESUME_PATTERNS:
            for path in root.rglob(pattern):
                try:
                    found[path] = path.stat().st_mtime
                except OSError:  # removed meanwhile
                    continue
    if not found:
        return None
    return str(max(found, key=lambda p: (found[p], str(p))))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_gossip.checkpoints FOLDER...``: print the newest checkpoint (or
    nothing); exit status 0 either way."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m lightning_gossip.checkpoints FOLDER... (prints the newest "
              "last / hpc / emergency checkpoint, or nothing)")
        return 0 if args else 2
    newest = newest_checkpoint(*args)
    if newest is not None:
        print(newest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
