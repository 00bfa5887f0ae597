"""The gossip phases of :class:`~lightning_gossip.strategies.ADPSGDStrategy`, owned by it as
``strategy.phases`` (:class:`Phases`, built from values and callables; each fit's values, its
session and survivors among them, come with :meth:`Phases.begin_fit`): the trainer settings a
phase cannot support, the barrier that opens a phase, what Lightning's collectives do mid-phase
(values stay local), and the epoch-end meeting that closes it (agreeing on stopping, the
periodic global average, consensus logging); :class:`_PhaseCallback` opens and closes the
phases at the epoch boundaries."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gossip import _compat
from lightning_gossip.async_gossip import AsyncGossip
from lightning_gossip.errors import NonFiniteReplica
from lightning_gossip.strategies.collectives import Watched, batches_mark, share_epoch_values

if TYPE_CHECKING:
    from lightning_gossip.strategies.fit import Fit

__all__ = ["Phases"]

T = TypeVar("T")


class Phases:
    """Trainer checks, phase start and epoch-end meeting of :class:`ADPSGDStrategy`.

    Built from the owner's option values and small callables; each fit's values (its session,
    whose step and engine the phases read when they act, its survivors, replicas, rank, device,
    trainer) come with :meth:`begin_fit`.

    Args:
        shared_cursor: the training batches come from the shared cursor (validation only at
            epoch ends).
        global_average_every_n_steps: the periodic global average (``None``: never).
        watched: the owner's watched wait
            (:meth:`~lightning_gossip.strategies.parallel.ProcessGroupStrategy.watched`).
        requeue_together: writes the requeue checkpoint with every rank, then stops
            (:meth:`~.resilience.Resilience.requeue_together`).
        log_consensus: measures and logs the consensus distance at every epoch end (``None``:
            not measured).
    """

    def __init__(self, *, shared_cursor: bool, global_average_every_n_steps: int | None,
                 watched: Watched, requeue_together: Callable[[], None],
                 log_consensus: Callable[[], object] | None) -> None:
        self.shared_cursor = shared_cursor
        self.global_average_every_n_steps = global_average_every_n_steps
        self.watched = watched
        self.requeue_together = requeue_together
        self.log_consensus = log_consensus
        #: the current fit's values (``None`` outside a fit)
        self.fit: Fit | None = None
        #: multiples of ``global_average_every_n_steps`` averaged so far
        self.global_averages = 0
        #: the warning that mid-phase values stay local was given
        self.warned_local_reduce = False
        #: this rank validates late (:meth:`end_epoch`): its validation's meeting was held
        self.met_for_validation = False
        #: batches this rank trained in the epoch; whether the fit resumed at an epoch's end
        #: (Lightning's epoch-end work follows an epoch's last batch, which a rank that the
        #: shared cursor left no batch never has: :meth:`end_epoch` catches up)
        self.batches_in_epoch, self.epoch_end_restored = 0, False

    def _survive(self, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``operation(*args, **kwargs)``; in an elastic fit run again over the survivors after
        a loss (:meth:`~lightning_gossip.elastic.survivors.Survivors.retry`)."""
        survivors = self.fit.survivors if self.fit is not None else None
        if survivors is None:
            return operation(*args, **kwargs)
        return survivors.retry(operation, *args, **kwargs)

    def _step(self) -> int:
        """The fit's current optimizer step (its session's)."""
        assert self.fit is not None
        return self.fit.session.step

    def begin_fit(self, fit: Fit) -> None:
        """A new fit: its engine (``None``: nothing to gossip with), replicas and trainer, and
        :class:`_PhaseCallback` first in the trainer's callbacks (once)."""
        self.fit, self.batches_in_epoch = fit, 0
        trainer = fit.trainer
        if not any(isinstance(cb, _PhaseCallback) for cb in trainer.callbacks):
            trainer.callbacks.insert(0, _PhaseCallback(self))

    def end_fit(self) -> None:
        """The fit's gossip stopped: forget its values (no phase is open any more)."""
        self.fit = None

    @property
    def engine(self) -> AsyncGossip | None:
        """The fit's engine (``None`` outside a fit or with nothing to gossip with)."""
        engine = self.fit.session.engine if self.fit is not None else None
        assert engine is None or isinstance(engine, AsyncGossip)
        return engine

    @property
    def in_phase(self) -> bool:
        """A gossip phase is open (mid-epoch: the ranks are at different steps)."""
        engine = self.engine
        return engine is not None and engine.in_phase

    def check_trainer(self, trainer: pl.Trainer, sync_batchnorm: bool) -> None:
        """Raise ``ValueError`` for trainer settings that a phase cannot support
        (``sync_batchnorm``: the strategy has Lightning's ``LayerSync`` plugin)."""
        if sync_batchnorm:
            raise ValueError(
                "adpsgd does not support sync_batchnorm: ranks run different numbers of steps, "
                "so a per-step collective would deadlock. BatchNorm statistics are gossiped "
                "with the weights instead."
            )
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and _compat.checkpoints_within_epoch(cb):
                raise ValueError(
                    "adpsgd checkpoints at epoch ends and validations only (all ranks meet "
                    "there); ModelCheckpoint(every_n_train_steps / train_time_interval) is not "
                    "supported."
                )
        if self.shared_cursor and trainer.val_check_interval != 1.0:
            raise ValueError(
                "adpsgd with shared_cursor=True validates at epoch ends only (ranks run "
                "different numbers of batches); got "
                f"val_check_interval={trainer.val_check_interval}. "
                "Use check_val_every_n_epoch, or ADPSGDStrategy(shared_cursor=False)."
            )

    def begin(self) -> None:
        """All ranks start training together (a barrier), then gossip may flow."""
        engine = self.engine
        if engine is not None and not engine.in_phase:
            assert self.fit is not None
            device = self.fit.device
            kwargs: dict[str, Any] = {}
            if dist.get_backend() == "nccl" and device.type == "cuda":
                kwargs["device_ids"] = [device.index]
            self._survive(self.watched, dist.barrier, what="waiting for every rank at the "
                          "barrier that opens a gossip phase", **kwargs)
            engine = self.engine  # the survivors' after a loss (its phase is open)
            if engine is not None:
                engine.before_step(self._step())

    def wait_at_end(self) -> None:
        """At every poll of this rank's wait at an epoch's end for its peers (an elastic fit's
        shared cursor): the survivors look for losses and joins, then keep gossip going
        (:meth:`~lightning_gossip.async_gossip.AsyncGossip.idle`): a passive peer still
        training may wait on this rank's exchanges."""
        if self.fit is not None and self.fit.survivors is not None:
            self.fit.survivors.poll_at_end()
        self._survive(self._idle)

    def _idle(self) -> None:
        """The engine's :meth:`~lightning_gossip.async_gossip.AsyncGossip.idle` (none: nothing)."""
        if self.engine is not None:
            self.engine.idle()

    def after_step(self, step: int) -> None:
        """The local optimizer step ``step`` is done: signal the engine (after a loss, the
        survivors' engine)."""
        self._survive(self._after_step, step)

    def _after_step(self, step: int) -> None:
        if self.engine is not None:
            self.engine.after_step(step)

    def quiesce(self) -> None:
        """Finish the engine's in-flight exchanges and close its phase (after a loss, the
        survivors' engine)."""
        self._survive(self._quiesce)

    def _quiesce(self) -> None:
        if self.engine is not None:
            self.engine.quiesce()

    def resumed(self, at_epoch_end: bool) -> None:
        """The fit starts; ``at_epoch_end``: from a checkpoint written at an epoch's end (its
        last batch trained)."""
        self.epoch_end_restored = at_epoch_end

    def open_epoch(self, epoch: int) -> None:
        """Training epoch ``epoch`` starts on this rank: count its batches, tell the survivors
        (the elastic cursor's claims), open a gossip phase."""
        self.batches_in_epoch, self.epoch_end_restored = 0, False
        if self.fit is not None and self.fit.survivors is not None:
            self.fit.survivors.epoch_opened(epoch)
        self.begin()

    def batch_trained(self, epoch: int) -> None:
        """This rank trained one more batch of ``epoch`` (the elastic cursor counts them)."""
        self.batches_in_epoch += 1
        if self.fit is not None and self.fit.survivors is not None:
            self.fit.survivors.batch_trained(epoch)

    def before_requeue(self) -> None:
        """This rank takes the requeue signal at its batch start: it meets every rank in the
        epoch-end meeting's collective first, so that a rank already at its epoch end (at the
        validation or the meeting, waiting there for the others) joins the requeue checkpoint
        instead of meeting it in another collective."""
        engine = self.engine
        if engine is None:
            return
        engine.quiesce()
        self._log_requeue_steps(self.meet(stop=False, requeue=True))

    def warn_local_reduce(self) -> None:
        """Mid-phase values logged with ``sync_dist=True`` stay local: say so once."""
        if not self.warned_local_reduce:
            self.warned_local_reduce = True
            rank_zero_warn(
                "adpsgd: values logged with sync_dist=True during training steps are not "
                "reduced across ranks (ranks run at different speeds); epoch-level and "
                "validation values are.")

    def _log_requeue_steps(self, met: torch.Tensor) -> None:
        assert self.fit is not None
        world = self.fit.world_size
        steps = [int(x) for x in met[3 + world:3 + 2 * world].tolist()]
        rank_zero_info(f"adpsgd requeue: the ranks' steps at the requeue checkpoint: {steps} "
                       f"(sum {sum(steps)})")

    def meet(self, stop: bool, requeue: bool, validating: bool = False) -> torch.Tensor:
        """The meeting of every rank (epoch end, or a requeue): one all-reduce (max) of
        ``[stop?, steps, requeue?, non-finite replica on rank r..., steps of rank r...,
        a rank without a batch in the epoch?, the lowest rank with one (``batches_mark``),
        validating?]``; raises :class:`NonFiniteReplica` on every rank when a replica holds
        NaN/Inf."""
        assert self.fit is not None
        fit = self.fit
        world, rank, step = fit.world_size, fit.rank, self._step()
        met = torch.zeros(6 + 2 * world, device=fit.device)
        met[0], met[1], met[2] = float(stop), float(step), float(requeue)
        met[3 + 2 * world:5 + 2 * world] = torch.tensor(
            batches_mark(self.batches_in_epoch > 0, rank, world))
        met[5 + 2 * world] = float(validating)
        met[3 + world + rank] = float(step)
        met[3 + rank] = float(not bool(torch.isfinite(fit.replicas.flat.pack().sum())))
        self.watched(dist.all_reduce, met, op=dist.ReduceOp.MAX,
                     what="waiting for every rank at the epoch-end meeting (agreeing on "
                     "whether to stop or requeue)")
        bad = [r for r in range(world) if met[3 + r].item() > 0]
        if bad:
            raise NonFiniteReplica(
                f"rank {rank}: at the end of the epoch the replica of rank(s) "
                f"{', '.join(map(str, bad))} holds NaN/Inf (its training diverged: check its "
                "learning rate, loss scaling and data); stopping every rank before it is "
                "averaged in", bad)
        return met

    def _quiet_meeting(self, stop: bool, validating: bool = False) -> torch.Tensor:
        """Quiet the network, then :meth:`meet` (after a loss: the survivors' engine)."""
        if self.engine is not None:
            self.engine.quiesce()
        return self.meet(stop=stop, requeue=False, validating=validating)

    def join_requeue(self, met: torch.Tensor) -> None:
        """After a meeting: when some rank came to it to requeue, write the requeue checkpoint
        with every rank and stop (Lightning's ``SIGTERMException``, exit 0)."""
        if met[2].item() > 0:
            self._log_requeue_steps(met)
            self.requeue_together()
            raise SIGTERMException()

    def before_validation(self) -> None:
        """A validation during ``fit`` (at the epoch end, before :meth:`end_epoch`): every rank
        meets first, so that a requeue begun by ranks at their batch start is joined here
        (:meth:`before_requeue`). A late validation (:meth:`end_epoch`) held its meeting."""
        engine = self.engine
        if engine is None:
            return
        assert self.fit is not None
        trainer = self.fit.trainer
        if self.met_for_validation:
            self.met_for_validation = False
        elif trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.join_requeue(self._survive(self._quiet_meeting, stop=False, validating=True))

    def end_epoch(self, trainer: pl.Trainer) -> None:
        """Epoch end on this rank: quiet the network, agree on stopping, log consensus.

        When another rank took SLURM's requeue signal at its batch start meanwhile, it meets
        this one here (:meth:`before_requeue`; or at the validation before, when there is one):
        this rank then writes the requeue checkpoint with every rank and stops.

        Lightning steps the epoch's schedulers and validates after an epoch's last batch, so a
        rank whose epoch had no batch (a newcomer admitted as the shared cursor ran out, a rank
        resumed with nothing left to claim) steps them here, and when it finds the others at
        their validation's meeting, validates with them (its meeting held), then meets them
        again here; and it takes part in the epoch-end reductions of the values the others
        logged (:func:`~.collectives.share_epoch_values`).
        """
        engine = self.engine
        if engine is None:
            return
        assert self.fit is not None
        if self.batches_in_epoch == 0 and not self.epoch_end_restored:
            _compat.end_epoch_without_batches(trainer)
        stop = self._meet_at_epoch_end(trainer)
        if stop[-1].item() > 0:
            self.met_for_validation = True
            _compat.validate_now(trainer)
            self.met_for_validation = False  # (a validation that ran no hook)
            stop = self._meet_at_epoch_end(trainer)
        world = self.fit.world_size  # a rank without a batch takes part in the reductions
        share_epoch_values(trainer, self.batches_in_epoch > 0, self.watched,
                           stop[3 + 2 * world:5 + 2 * world].tolist())
        if stop[0].item() > 0:
            trainer.should_stop = True
        n = self.global_average_every_n_steps
        if n is not None and int(stop[1].item()) // n > self.global_averages:
            # Gossip-PGA at the next meeting: some rank passed a multiple of n since the last
            # global average, so every replica becomes the exact average (one all-reduce).
            self.global_averages = int(stop[1].item()) // n
            self.fit.replicas.become_average("for the periodic global average",
                                              self.fit.outer)
        if self.log_consensus is not None:
            self.log_consensus()

    def _meet_at_epoch_end(self, trainer: pl.Trainer) -> torch.Tensor:
        """The epoch-end meeting (after a requeue's: the requeue checkpoint, then stop)."""
        # Ranks stop independently (max_steps counts local steps): if any rank stops, all do.
        local_stop = trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
        met = self._survive(self._quiet_meeting, stop=bool(local_stop))
        self.join_requeue(met)
        return met


class _PhaseCallback(Callback):
    """Inserted by :class:`~lightning_gossip.strategies.ADPSGDStrategy`: opens a gossip phase
    at every epoch start and closes it at every epoch end (the points where all ranks meet)."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Whether the fit resumed at an epoch's end (its last batch trained)."""
        self.phases.resumed(_compat.epoch_end_restored(trainer))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open a gossip phase."""
        self.phases.open_epoch(trainer.current_epoch)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """One more batch trained (:meth:`Phases.batch_trained`)."""
        self.phases.batch_trained(trainer.current_epoch)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the gossip phase (see :meth:`Phases.end_epoch`)."""
        self.phases.end_epoch(trainer)
