"""Stopping and requeueing together under :class:`~lightning_gossip.strategies.DPSGDStrategy`:
the Lightning side of the agreed stop (the agreement itself, carried by the gossip messages, is
:class:`~lightning_gossip.sync_gossip.StopAgreement`, owned by the engine).

Two requests travel the same way: "stop at step s" (SIGTERM: every rank raises Lightning's
``SIGTERMException`` at step ``s``) and "requeue at step s" (SLURM's auto-requeue signal,
``SIGUSR1`` by default: every rank writes Lightning's ``hpc_ckpt_<n>.ckpt`` at step ``s``,
rank 0 runs ``scontrol requeue``, and once the job is requeued every rank stops at that step).
A rank that received the signal proposes
:meth:`~lightning_gossip.sync_gossip.StopAgreement.stop_step_for` of the next round it sends;
every rank acts at the first batch whose step is at least the smallest proposal it knows of,
the same batch on every rank.

Lightning's own handler would save the requeue checkpoint (a collective: the consensus average)
inside the signal handler, wherever each rank happens to be in its step: under real SLURM that
hung, three ranks in the checkpoint's average and one waiting for its gossip round.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

log = logging.getLogger(__name__)


class _StopHooksMixin:
    """The per-batch stop and requeue checks of :class:`DPSGDStrategy` (SIGTERM, SLURM
    requeue). Reads the strategy's ``engine``, ``step``, ``global_rank``, ``root_device`` and
    ``_group``; writes ``_stopping_together`` and ``_requeue_done`` (read on exceptions)."""

    def _reset_stop_hooks(self) -> None:
        self._stop_proposed = self._requeue_proposed = self._requeue_done = False
        self._stopping_together = False

    @override
    def install_sigterm_check(self, trainer: Any) -> None:
        """Replace Lightning's per-batch SIGTERM broadcast by :meth:`sigterm_stop_now`, and
        defer Lightning's SLURM auto-requeue handler to :meth:`requeue_now`."""
        from lightning_gossip.liveness.waits import make_sigterm_check_local

        self._reset_stop_hooks()
        if self.engine is not None:  # a new fit: forget the last one's proposals
            self.engine.agreement.reset()
        self._begin_fit()
        make_sigterm_check_local(trainer, stop_now=self.sigterm_stop_now,
                                 requeue_now=self.requeue_now)

    def _propose(self, kind: str) -> None:
        """Propose to stop (``kind="stop"``) or requeue at the first step every rank can know."""
        proposal = self.engine.propose_stop(kind, self.step)
        log.info("rank %d received the %s signal at step %d: proposes that every rank acts at "
                 "step %d", self.global_rank, kind, self.step, proposal)

    def _flags_all_reduce(self, received: bool, what: str) -> bool:
        """One node of several ranks (nothing to gossip): combine the flags by an all-reduce
        on the gossip group (every rank calls it before every batch)."""
        flag = torch.tensor([1 if received else 0], device=self.root_device)
        self.watched(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self._group,
                     what=f"agreeing whether to {what} at step {self.step}")
        return bool(flag.item())

    def sigterm_stop_now(self, received: bool) -> bool:
        """Called before every training batch: whether every rank stops here.

        ``received``: this rank got SIGTERM. The first time, it proposes to stop at
        :meth:`~lightning_gossip.sync_gossip.StopAgreement.stop_step_for` of the next round it
        sends; the proposal goes out with every round from then on. Every rank stops at the
        first batch whose step is at least the smallest proposal it knows of, which is the same
        batch on every rank. With ``hierarchical=True`` on a single node (nothing to gossip)
        the flags are combined by an all-reduce on the gossip group instead.
        """
        if self.engine is None:
            stop = self._flags_all_reduce(received, "stop (SIGTERM)")
        else:
            if received and not self._stop_proposed:
                self._stop_proposed = True
                self._propose("stop")
            stop = self.engine.agreement.stop_due(self.step)
        if stop:
            self._stopping_together = True
        return stop

    @override
    def requeue_now(self, received: bool) -> bool:
        """Called before every training batch when Lightning's SLURM auto-requeue is on (before
        :meth:`sigterm_stop_now`): whether every rank stops here, requeued.

        ``received``: this rank got the requeue signal. Agreed like a stop; at the agreed step
        every rank writes the requeue checkpoint and rank 0 requeues the job
        (:meth:`save_and_requeue`); once it is requeued every rank stops there, otherwise
        (``scontrol`` failed) training goes on, as with Lightning's own handler. Once per fit.
        """
        if self._requeue_done:
            return False
        if self.engine is None:
            due = self._flags_all_reduce(received, "requeue (SLURM)")
        else:
            if received and not self._requeue_proposed:
                self._requeue_proposed = True
                self._propose("requeue")
            due = self.engine.agreement.requeue_due(self.step)
        if not due:
            return False
        self._requeue_done = True
        requeued = self.save_and_requeue()
        if requeued:
            self._stopping_together = True
        return requeued
