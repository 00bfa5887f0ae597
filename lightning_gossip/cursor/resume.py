"""The shared cursor's position in ``adpsgd``'s requeue checkpoint (:class:`CursorResume`, owned
by :class:`~lightning_gossip.strategies.ADPSGDStrategy` as ``strategy.cursor``): a fit resumed
from ``hpc_ckpt_<n>.ckpt`` goes on with the interrupted epoch's unclaimed batches only.

The shared samplers (:mod:`~lightning_gossip.cursor.sampler`,
:mod:`~lightning_gossip.cursor.batches`) hand out an epoch's batches through a counter in the
c10d store, which a requeued job starts afresh. The requeue checkpoint is written where every
rank has stopped claiming (the ranks met, :meth:`~.Phases.before_requeue`), so the counter
is the same for all: it is saved under :data:`CURSOR_KEY` as ``{"epoch", "claims"}``, and a fit
that loads the checkpoint starts that epoch's counter there (:attr:`Claims.start
<lightning_gossip.cursor.claims.Claims.start>`). Batches a rank had claimed but not trained yet
(the loader's prefetch: one per rank without workers) are skipped, not repeated. Only the
requeue checkpoint carries it, and only mid-epoch: any other checkpoint resumes as before (its
next epoch from the start).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from lightning_gossip.cursor.claims import Claims

__all__ = ["CURSOR_KEY", "CursorResume"]

CURSOR_KEY = "lightning_gossip_cursor"
"""The checkpoint key of the shared cursor's position (requeue checkpoints, mid-epoch)."""


class CursorResume:
    """Saves the shared cursor in the requeue checkpoint and restarts it from there (no
    process group, no trainer: a test builds one directly).

    >>> resume = CursorResume()
    >>> resume.load({CURSOR_KEY: {"epoch": 2, "claims": 40}})
    >>> resume.start
    {2: 40}
    """

    def __init__(self) -> None:
        #: the training loader's claims (``None``: not drawn through the shared cursor)
        self.claims: Claims | None = None
        #: where a loaded checkpoint starts an epoch's counter (``{epoch: claims}``)
        self.start: dict[int, int] | None = None
        #: the loaded checkpoint's epoch (its fit loop's epochs processed; 0: none loaded)
        self.resume_epoch = 0

    def follow(self, loader: DataLoader, claims: Claims, epoch: int = 0) -> DataLoader:
        """``loader``, rebuilt to draw through the shared cursor by ``claims``: its claims
        tracked (:meth:`track`), its sampler started in ``epoch`` (the fit's epochs processed),
        or in the loaded checkpoint's epoch if that is later.

        Lightning sets the sampler's epoch only at the epoch start, after the loader prefetched
        its first batch, and a module whose ``configure_optimizers`` reads
        ``trainer.estimated_stepping_batches`` (the recipes) has the loader built before the
        checkpoint's loop progress is restored. Without this a resumed fit drew that batch from
        epoch 0's counter and the epoch from epoch 0's permutation.
        """
        self.track(claims)
        for sampler in (loader.sampler, loader.batch_sampler):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(max(int(epoch), self.resume_epoch))
        return loader

    def track(self, claims: Claims | None) -> None:
        """The training loader's claims (``None``: not drawn through the shared cursor)."""
        self.claims = claims
        if claims is not None and self.start:
            claims.resume(self.start)

    def position(self, epoch: int) -> dict[str, int] | None:
        """``{"epoch", "claims"}`` of ``epoch``'s shared counter; ``None`` without a shared
        cursor, or when the epoch's batches are all claimed (it resumes as today)."""
        claims = self.claims
        where = None if claims is None else claims.position(epoch)
        if where is None or where[0] >= where[1]:
            return None
        return {"epoch": int(epoch), "claims": int(where[0])}

    def saved(self, checkpoint: dict[str, Any], epoch: int) -> dict[str, Any]:
        """``checkpoint`` with the position of ``epoch``'s counter (when there is one)."""
        position = self.position(epoch)
        return checkpoint if position is None else {**checkpoint, CURSOR_KEY: position}

    def load(self, checkpoint: dict[str, Any]) -> None:
        """A saved cursor position starts its epoch's counter there."""
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
        self.resume_epoch = int(progress.get("current", {}).get("processed", 0))
        position = checkpoint.get(CURSOR_KEY)
        self.start = {int(position["epoch"]): int(position["claims"])} if position else None
        if self.claims is not None and self.start:
            self.claims.resume(self.start)

    def reset(self) -> None:
        """The position applies to the fit that loaded it only."""
        self.claims = self.start = None
        self.resume_epoch = 0
