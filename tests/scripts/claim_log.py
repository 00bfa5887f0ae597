"""A callback for the real-SLURM tests: every rank logs the shared cursor's claims it really
made and the batches it really trained, so a test can check what a requeue repeats or skips.

Added to the digits template's fit with ``EXTRA_ARGS=--trainer.callbacks+=
tests.scripts.claim_log.ClaimLog`` (the template runs from the repository root, so ``tests``
imports). At ``setup`` (before Lightning builds the training loader's iterator, whose prefetch
already claims) it wraps, in this process, :meth:`Claims.next
<lightning_gossip.cursor.claims.Claims.next>` and the iteration of
:class:`~lightning_gossip.cursor.sampler.SharedCursorSampler` and
:class:`~lightning_gossip.cursor.batches.SharedBatchSampler`: the real methods run, and what
they did is appended to ``<default_root_dir>/claims/rank<r>-<pid>.jsonl``, one JSON object per
line:

* ``{"kind": "iter", "epoch"}``: a pass over the sampler began; ``epoch`` is the sampler's epoch
  then, whose permutation (or list of batches) the pass draws from;
* ``{"kind": "claim", "epoch", "unit"}``: a unit (a chunk of ``batch_size`` samples, or a
  listed batch) of ``epoch``'s counter this rank took (``unit`` is ``null`` when the epoch had
  none left);
* ``{"kind": "trained", "epoch", "batch", "step"}``: a training batch done (Lightning's
  ``batch_idx`` in the epoch, the trainer's ``global_step`` after it);

* ``{"kind": "exception", "type"}``, ``{"kind": "teardown"}`` and ``{"kind": "exit"}``: the fit
  failed (Lightning's ``on_exception``), the callbacks' teardown, and the interpreter's exit
  (an ``atexit`` hook: after non-daemon threads are joined, before the modules are torn down),
  so a test can tell how long a failing rank takes to end;

each with ``rank``, ``pid``, ``restart`` (``SLURM_RESTART_COUNT``: 0 before the first requeue)
and ``t`` (``time.time()``). Each unit is one batch (``chunk_size`` = the loader's batch size),
so a rank's first ``n`` claims of an epoch are its ``n`` trained batches and the rest were
prefetched by the loader.

``pace_s`` (``--trainer.callbacks.pace_s=2.5`` right after it) makes every training batch last
at least that long until the job is first requeued (``SLURM_RESTART_COUNT`` unset or 0), so
that a time limit's signal placed a minute or two ahead falls in the training however fast the
machine is (on an idle machine the digits fit runs an epoch in seconds).
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


class ClaimLog(Callback):
    """Logs the claims and trained batches of this rank (see the module docstring)."""

    def __init__(self, pace_s: float = 0.0) -> None:
        self.pace_s = float(pace_s)
        self._file: Any = None
        self._trainer: Any = None
        self._undo: list[tuple[type, str, Any]] = []
        self._batch_start = 0.0

    def _write(self, **record: Any) -> None:
        trainer = self._trainer
        if self._file is None:
            folder = Path(trainer.default_root_dir) / "claims"
            folder.mkdir(parents=True, exist_ok=True)
            self._file = open(folder / f"rank{trainer.global_rank}-{os.getpid()}.jsonl", "a")
        record.update(rank=trainer.global_rank, pid=os.getpid(),
                      restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                      t=round(time.time(), 3))
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def _observe(self) -> None:
        from lightning_gossip.cursor.batches import SharedBatchSampler
        from lightning_gossip.cursor.claims import Claims
        from lightning_gossip.cursor.sampler import SharedCursorSampler

        log = self
        real_next = Claims.next

        def next_(claims: Any, epoch: int, units: int) -> int | None:
            unit = real_next(claims, epoch, units)
            log._write(kind="claim", epoch=int(epoch), unit=unit)
            return unit

        self._undo.append((Claims, "next", real_next))
        Claims.next = next_
        for cls in (SharedCursorSampler, SharedBatchSampler):
            real_iter = cls.__iter__

            def iter_(sampler: Any, _real: Any = real_iter) -> Any:
                log._write(kind="iter", epoch=int(sampler.epoch))
                yield from _real(sampler)

            self._undo.append((cls, "__iter__", real_iter))
            cls.__iter__ = iter_

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._trainer is None:
            atexit.register(self._write, kind="exit")
        self._trainer = trainer
        if stage == "fit" and not self._undo:
            self._observe()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._write(kind="exception", type=type(exception).__name__)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.monotonic()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._write(kind="trained", epoch=int(trainer.current_epoch), batch=int(batch_idx),
                    step=int(trainer.global_step))
        if self.pace_s > 0 and os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
            time.sleep(max(0.0, self._batch_start + self.pace_s - time.monotonic()))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._write(kind="teardown")
        for cls, name, real in reversed(self._undo):
            setattr(cls, name, real)
        self._undo = []
        if self._file is not None:
            self._file.close()
            self._file = None
