"""Stopping and requeueing together under :class:`~lightning_gossip.strategies.DPSGDStrategy`:
:class:`AgreedStops`, its ``strategy.resilience``: the Lightning side of the agreed stop (the
agreement itself, carried by the gossip messages, is
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_gossip.strategies.collectives import Watched
from lightning_gossip.strategies.resilience import Resilience
from lightning_gossip.strategies.sigterm import make_sigterm_check_local
from lightning_gossip.sync_gossip import SyncGossip

if TYPE_CHECKING:
    from lightning_gossip.strategies.fit import Fit

__all__ = ["AgreedStops"]

log = logging.getLogger(__name__)


class AgreedStops(Resilience):
    """:class:`~lightning_gossip.strategies.resilience.Resilience` of
    :class:`~lightning_gossip.strategies.DPSGDStrategy`: the per-batch stop and requeue checks
    (SIGTERM, SLURM requeue) agreed through the fit's engine's
    :class:`~lightning_gossip.sync_gossip.StopAgreement` (the engine of the fit's session; ``None``
    with nothing to gossip with: the flags are then all-reduced on ``fit.group``, the gossip
    group, or after an elastic fit's loss on the survivors' group). Built as
    :class:`~lightning_gossip.strategies.resilience.Resilience` is.
    """

    def __init__(self, *, watched: Watched,
                 stop_gossip: Callable[[], None], stop_heartbeat: Callable[[bool], None],
                 restart_position: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        super().__init__(watched=watched, stop_gossip=stop_gossip,
                         stop_heartbeat=stop_heartbeat, restart_position=restart_position)
        #: this rank proposed a stop / a requeue in this fit
        self.stop_proposed = False
        self.requeue_proposed = False

    @property
    def engine(self) -> SyncGossip | None:
        """The fit's engine (``None`` outside a fit or with nothing to gossip with)."""
        engine = self.fit.session.engine if self.fit is not None else None
        assert engine is None or isinstance(engine, SyncGossip)
        return engine

    def begin_fit(self, fit: Fit) -> None:
        """A new fit: forget the last one's proposals too (the engine's agreement as well)."""
        self.stop_proposed = self.requeue_proposed = False
        super().begin_fit(fit)
        if self.engine is not None:
            self.engine.agreement.reset()

    def install_sigterm_check(self, trainer: Any) -> None:
        """Replace Lightning's per-batch SIGTERM broadcast by :meth:`sigterm_stop_now`, and
        defer Lightning's SLURM auto-requeue handler to :meth:`requeue_now`."""
        make_sigterm_check_local(trainer, stop_now=self.sigterm_stop_now,
                                 requeue_now=self.requeue_now)

    def _propose(self, kind: str) -> None:
        """Propose to stop (``kind="stop"``) or requeue at the first step every rank can know."""
        engine, step = self.engine, self._step()
        assert engine is not None
        proposal = engine.propose_stop(kind, step)
        log.info("rank %d received the %s signal at step %d: proposes that every rank acts at "
                 "step %d", engine.rank, kind, step, proposal)

    def _flags_all_reduce(self, received: bool, what: str) -> bool:
        """One node of several ranks (nothing to gossip): combine the flags by an all-reduce
        on the gossip group (every rank calls it before every batch)."""
        fit = self._current()
        flag = torch.tensor([1 if received else 0], device=fit.device)
        group = fit.session.group if fit.session.group is not None else fit.group
        self.watched(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=group,
                     what=f"agreeing whether to {what} at step {self._step()}")
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
        engine = self.engine
        if engine is None:
            stop = self._flags_all_reduce(received, "stop (SIGTERM)")
        else:
            if received and not self.stop_proposed:
                self.stop_proposed = True
                self._propose("stop")
            stop = engine.agreement.stop_due(self._step())
        if stop:
            self.stopping_together = True
        return stop

    def requeue_now(self, received: bool) -> bool:
        """Called before every training batch when Lightning's SLURM auto-requeue is on (before
        :meth:`sigterm_stop_now`): whether every rank stops here, requeued.

        ``received``: this rank got the requeue signal. Agreed like a stop; at the agreed step
        every rank writes the requeue checkpoint and rank 0 requeues the job
        (:meth:`save_and_requeue`); once it is requeued every rank stops there, otherwise
        (``scontrol`` failed) training goes on, as with Lightning's own handler. Once per fit.
        """
        if self.requeue_done:
            return False
        engine = self.engine
        if engine is None:
            due = self._flags_all_reduce(received, "requeue (SLURM)")
        else:
            if received and not self.requeue_proposed:
                self.requeue_proposed = True
                self._propose("requeue")
            due = engine.agreement.requeue_due(self._step())
        if not due:
            return False
        self.requeue_done = True
        requeued = self.save_and_requeue()
        if requeued:
            self.stopping_together = True
        return requeued
