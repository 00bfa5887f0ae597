"""What :class:`~lightning_gossip.strategies.GossipStrategy` does when a run is interrupted,
owned by it as ``strategy.resilience`` (:class:`Resilience`): Lightning's SLURM auto-requeue at
a batch boundary instead of inside the signal handler, the quiet exit of a stop every rank
agreed on, and the emergency checkpoint of the survivors of a lost rank.

**Requeue.** Lightning's handler of SLURM's requeue signal (``SIGUSR1`` with
``#SBATCH --signal=SIGUSR1@N``) writes ``hpc_ckpt_<n>.ckpt`` from inside the handler, wherever
each rank is; under the gossip strategies that checkpoint is a collective (the consensus
average), entered from different places on different ranks. The strategies record the signal
instead (:func:`~lightning_gossip.strategies.sigterm.make_sigterm_check_local`) and act at a
batch start: ``dpsgd`` at a step agreed through its gossip messages (:mod:`.dpsgd_stop`),
``adpsgd`` (whose ranks never share a step) at each rank's next batch start, where the ranks of
a node first agree (an all-reduce of the flag on the node group, ``hierarchical``), then meet
every rank in the epoch-end meeting's collective (a rank already at its epoch end joins the
requeue from there, :meth:`~lightning_gossip.strategies.adpsgd_phases.Phases.before_requeue`).
Every rank then writes the checkpoint (:meth:`Resilience.save_and_requeue`), rank 0 runs
``scontrol requeue``, and every rank stops (quietly, as after an agreed SIGTERM).

**Emergency checkpoint.** A rank that fails because a peer was lost (a
:class:`~lightning_gossip.errors.GossipError` naming it) first meets the other survivors
(:func:`~lightning_gossip.strategies.emergency.meet_survivors`) and writes an
``emergency-step=<s>-rank=<r>.ckpt`` next to the run's checkpoints: the survivors' average
where they can meet, otherwise one survivor's own replica (with its optimizer state).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gossip import _compat
from lightning_gossip.errors import GossipTimeout, RankExcluded
from lightning_gossip.liveness import current
from lightning_gossip.liveness.at_exit import record_exit
from lightning_gossip.strategies.collectives import Watched, broadcast_object
from lightning_gossip.strategies.sigterm import make_sigterm_check_local

if TYPE_CHECKING:
    from lightning_gossip.strategies.fit import Fit

__all__ = ["Resilience", "lost_peer", "requeue_slurm_job"]

log = logging.getLogger(__name__)


def requeue_slurm_job() -> bool:
    """``scontrol requeue`` this SLURM job (array jobs as ``<job>_<task>``), as Lightning's
    auto-requeue handler does; whether it succeeded."""
    import os

    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = (f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job is not None
           else os.environ.get("SLURM_JOB_ID", ""))
    if not job.replace("_", "").isdigit():
        log.warning("cannot requeue: no SLURM job id (SLURM_JOB_ID=%r)", job)
        return False
    try:
        result = subprocess.call(["scontrol", "requeue", job])
    except OSError as e:
        log.warning("requeuing SLURM job %s failed: %s", job, e)
        return False
    if result != 0:
        log.warning("requeuing SLURM job %s failed with error code %d", job, result)
        return False
    log.info("Requeued SLURM job: %s", job)
    return True


def lost_peer(exception: BaseException) -> GossipTimeout | None:
    """The :class:`~lightning_gossip.errors.GossipTimeout` (a peer silent, gone or not
    answering: ``PeerSilent`` is one) that ``exception`` is or was caused by, naming the
    ranks; ``None`` for anything else."""
    seen = 0
    e: BaseException | None = exception
    while e is not None and seen < 10:
        if isinstance(e, GossipTimeout) and e.ranks:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


class Resilience:
    """Requeue at a batch boundary, quiet agreed stops, emergency checkpoints.

    Built from the owner's small callables; each fit's values come with :meth:`begin_fit` (the
    current step: the fit's session's).

    Args:
        watched: the owner's watched wait (:meth:`~.parallel.ProcessGroupStrategy.watched`),
            for the broadcast of the requeue's outcome.
        stop_gossip: stops the engine's background work (idempotent).
        stop_heartbeat: ``stop_heartbeat(failed)``: tells the peers this rank leaves.
        restart_position: ``checkpoint`` plus the data position a restart needs (the emergency
            checkpoint's).
    """

    def __init__(self, *, watched: Watched,
                 stop_gossip: Callable[[], None], stop_heartbeat: Callable[[bool], None],
                 restart_position: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.watched = watched
        self.stop_gossip = stop_gossip
        self.stop_heartbeat = stop_heartbeat
        self.restart_position = restart_position
        #: the current fit's values (``None`` outside a fit)
        self.fit: Fit | None = None
        #: every rank stops at this point, agreed (SIGTERM, requeue): the exception is quiet
        self.stopping_together = False
        #: the requeue checkpoint of this fit is written (once per fit)
        self.requeue_done = False
        #: fits of this strategy object (the same on every rank)
        self.fit_index = -1

    def begin_fit(self, fit: Fit) -> None:
        """A new fit: forget the last one's stop and requeue, count it, keep its values, and
        replace Lightning's per-batch SIGTERM broadcast (a world-group collective) by a check
        of the strategy's own (:meth:`install_sigterm_check`)."""
        self.stopping_together = False
        self.requeue_done = False
        self.fit_index += 1
        self.fit = fit
        self.install_sigterm_check(fit.trainer)

    def end_fit(self) -> None:
        """The fit is over: forget its values."""
        self.fit = None

    def install_sigterm_check(self, trainer: Any) -> None:
        """Here a rank that received SIGTERM stops on its own at its next batch and its peers
        fail naming it (:func:`~.sigterm.make_sigterm_check_local`); ``AgreedStops`` stops
        every rank at the same step. Lightning's SLURM auto-requeue handler is deferred to
        :meth:`requeue_now`."""
        make_sigterm_check_local(trainer, requeue_now=self.requeue_now)

    def _current(self) -> Fit:
        assert self.fit is not None, "only during a fit"
        return self.fit

    def _step(self) -> int:
        """The fit's current optimizer step (its session's)."""
        return self._current().session.step

    def requeue_now(self, received: bool) -> bool:
        """Before every batch while Lightning's SLURM auto-requeue is on: write the requeue
        checkpoint and requeue once this rank received the signal (the ranks of a node agree
        first: they step together); whether every rank stops here (always, once written).

        Raises ``RuntimeError`` when ``scontrol requeue`` failed (the checkpoint is written;
        resume with ``ckpt_path="hpc"``): ``adpsgd``'s ranks cannot go back to training
        together from here.
        """
        if self.requeue_done:
            return False
        fit = self._current()
        if fit.node:  # hierarchical: the node's ranks step together
            import torch

            flag = torch.tensor([1.0 if received else 0.0], device=fit.device)
            fit.node.all_reduce(flag, "agreeing on the requeue (SLURM)")
            received = bool(flag.item() > 0)
        if not received:
            return False
        fit.before_requeue()
        self.requeue_together()
        return True

    def requeue_together(self) -> None:
        """Write the requeue checkpoint with every rank and requeue; then every rank stops.

        Raises ``RuntimeError`` when ``scontrol requeue`` failed (the checkpoint is written).
        """
        self.requeue_done = True
        if not self.save_and_requeue():
            raise RuntimeError(
                f"rank {self._current().rank}: the requeue checkpoint was written at step "
                f"{self._step()} but `scontrol requeue` failed: resume with ckpt_path='hpc'")
        self.stopping_together = True

    def save_and_requeue(self) -> bool:
        """Lightning's auto-requeue, at a point every rank reaches: finalize the loggers, write
        ``hpc_ckpt_<n>.ckpt`` into ``default_root_dir`` (the consensus weights, a collective),
        ``scontrol requeue`` on rank 0; whether the job was requeued (rank 0's answer,
        broadcast)."""
        fit = self._current()
        trainer = fit.trainer
        rank_zero_info(f"Handling auto-requeue signal at step {self._step()}: every rank writes "
                       "the requeue checkpoint here")
        for logger in trainer.loggers:
            logger.finalize("finished")
        trainer.save_checkpoint(_compat.hpc_save_path(trainer))
        ok = requeue_slurm_job() if fit.rank == 0 else False
        return bool(broadcast_object(ok, 0, None, fit.rank, fit.device, self.watched))

    def on_exception(self, exception: BaseException) -> None:
        """This rank failed: after a stop every rank agreed on (SIGTERM, requeue), stop gossip
        and leave quietly (the peers stop at the same point), as after an elastic fit went on
        without this rank (``RankExcluded``); after a lost peer, write the
        emergency checkpoint with the other survivors first; else stop gossip and tell the
        peers at once (heartbeat ``leave``). The exit status a ``SystemExit`` gives the
        process is recorded (:func:`~lightning_gossip.liveness.at_exit.record_exit`)."""
        record_exit(exception)
        if (isinstance(exception, SIGTERMException) and self.stopping_together
                or isinstance(exception, RankExcluded)):  # (the others went on without it:
            self.stop_gossip()  # no checkpoint to meet them for, and no mark that could
            self.stop_heartbeat(False)  # fall on a process relaunched in its slot)
            return
        lost = lost_peer(exception)
        if lost is None and (beat := current()) is not None:  # this rank's own error:
            beat.tell_error(exception)  # the peers that find it gone repeat it (before waits)
        if lost is not None and self.fit is not None:
            from lightning_gossip.strategies.emergency import write_emergency_checkpoint

            try:
                write_emergency_checkpoint(lost, self.fit, self._step(), self.fit_index,
                                           stop_gossip=self.stop_gossip,
                                           restart_position=self.restart_position)
            except Exception as e:  # noqa: BLE001 - never hide the lost rank's error
                log.warning("rank %d: no emergency checkpoint: %s", self.fit.rank, e)
        self.stop_gossip()
        self.stop_heartbeat(True)
