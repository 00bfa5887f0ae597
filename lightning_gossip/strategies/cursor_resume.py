"""The shared cursor's position in ``adpsgd``'s requeue checkpoint, as a mixin: a fit resumed
from ``hpc_ckpt_<n>.ckpt`` goes on with the interrupted epoch's unclaimed batches only.

The shared samplers (:mod:`~lightning_gossip.shared_cursor`,
:mod:`~lightning_gossip.shared_batches`) hand out an epoch's batches through a counter in the
c10d store, which a requeued job starts afresh. The requeue checkpoint is written where every
rank has stopped claiming (the ranks met, :meth:`~._PhasesMixin.before_requeue`), so the counter
is the same for all: it is saved under :data:`CURSOR_KEY` as ``{"epoch", "claims"}``, and a fit
that loads the checkpoint starts that epoch's counter there (:attr:`Claims.start
<lightning_gossip.node_claims.Claims.start>`). Batches a rank had claimed but not trained yet
(the loader's prefetch: one per rank without workers) are skipped, not repeated. Only the
requeue checkpoint carries it, and only mid-epoch: any other checkpoint resumes as before (its
next epoch from the start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_gossip.node_claims import Claims

__all__ = ["CURSOR_KEY"]

#: the checkpoint key of the shared cursor's position (requeue checkpoints, mid-epoch)
CURSOR_KEY = "lightning_gossip_cursor"


class _CursorResumeMixin:
    """Saves the shared cursor in the requeue checkpoint and restarts it from there."""

    _cursor_claims: Claims | None = None
    _cursor_start: dict[int, int] | None = None
    _resume_epoch = 0  # the loaded checkpoint's epoch (its fit loop's epochs processed)

    def cursor_epoch(self) -> int:
        """The epoch the training loader's shared sampler starts in: Lightning sets it only at
        the epoch start, after its loader prefetched a batch (built before the checkpoint's
        loop progress is restored when ``configure_optimizers`` reads
        ``estimated_stepping_batches``), so a resumed fit would draw that batch from epoch 0's
        counter and the whole epoch from epoch 0's permutation."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        return max(int(trainer.fit_loop.epoch_progress.current.processed), self._resume_epoch)

    def track_cursor(self, claims: Claims | None) -> None:
        """The training loader's claims (``None``: not drawn through the shared cursor)."""
        self._cursor_claims = claims
        if claims is not None and self._cursor_start:
            claims.start = self._cursor_start

    def cursor_position(self) -> dict[str, int] | None:
        """``{"epoch", "claims"}`` of the current epoch's shared counter; ``None`` without a
        shared cursor, or when the epoch's batches are all claimed (it resumes as today)."""
        claims = self._cursor_claims
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        epoch = trainer.current_epoch
        where = None if claims is None else claims.position(epoch)
        if where is None or where[0] >= where[1]:
            return None
        return {"epoch": int(epoch), "claims": int(where[0])}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """The requeue checkpoint also holds the shared cursor's position (mid-epoch)."""
        if self._requeue_done:  # type: ignore[attr-defined]
            position = self.cursor_position()
            if position is not None:
                checkpoint = {**checkpoint, CURSOR_KEY: position}
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    @override
    def load_checkpoint(self, checkpoint_path: str | Path,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the checkpoint; a saved cursor position starts its epoch's counter there."""
        checkpoint = super().load_checkpoint(  # type: ignore[misc]
            checkpoint_path, weights_only=weights_only)
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
        self._resume_epoch = int(progress.get("current", {}).get("processed", 0))
        position = checkpoint.get(CURSOR_KEY)
        self._cursor_start = ({int(position["epoch"]): int(position["claims"])}
                              if position else None)
        if self._cursor_claims is not None and self._cursor_start:
            self._cursor_claims.start = self._cursor_start
        return checkpoint

    @override
    def teardown(self) -> None:
        """The position applies to the fit that loaded it only."""
        self._cursor_claims = self._cursor_start = None
        self._resume_epoch = 0
        super().teardown()  # type: ignore[misc]
