"""The gossip phases of :class:`~lightning_gossip.strategies.ADPSGDStrategy`, as a mixin: the
trainer settings a phase cannot support, the barrier that opens a phase, what Lightning's
collectives do mid-phase (values stay local), and the epoch-end meeting that closes it (agreeing
on stopping, the periodic global average, consensus logging); :class:`_PhaseCallback` opens and
closes the phases at the epoch boundaries."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_gossip import _compat
from lightning_gossip.errors import NonFiniteReplica


class _PhasesMixin:
    """Trainer checks, phase start and epoch-end meeting of :class:`ADPSGDStrategy`."""

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        if _compat.layer_sync(self) is not None:
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

    def begin_phase(self) -> None:
        """All ranks start training together (a barrier), then gossip may flow."""
        if self.engine is not None and not self.engine.in_phase:
            kwargs: dict[str, Any] = {}
            if dist.get_backend() == "nccl" and self.root_device.type == "cuda":
                kwargs["device_ids"] = [self.root_device.index]
            self.watched(dist.barrier, what="waiting for every rank at the barrier that opens "
                         "a gossip phase", **kwargs)
            self.engine.begin_phase()

    @override
    def before_requeue(self) -> None:
        """This rank takes the requeue signal at its batch start: it meets every rank in the
        epoch-end meeting's collective first, so that a rank already at its epoch end (at the
        validation or the meeting, waiting there for the others) joins the requeue checkpoint
        instead of meeting it in another collective."""
        if self.engine is None:
            return
        self.quiesce()
        self._log_requeue_steps(self._meet(stop=False, requeue=True))

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor:
        """Like :meth:`GossipStrategy.reduce`, except mid-epoch, where values stay local."""
        if self.engine is not None and self.engine.in_phase and isinstance(tensor, Tensor):
            # Mid-epoch the ranks are at different steps: a collective here would pair up
            # unrelated calls. Per-step values stay local; epoch-level ones are reduced.
            if not self._warned_local_reduce:
                self._warned_local_reduce = True
                rank_zero_warn(
                    "adpsgd: values logged with sync_dist=True during training steps are not "
                    "reduced across ranks (ranks run at different speeds); epoch-level and "
                    "validation values are.")
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Like :meth:`GossipStrategy.broadcast`, except mid-epoch, where ``obj`` stays local.

        Lightning's ``Timer`` (``Trainer(max_time=...)``) broadcasts its decision after every
        batch. Mid-epoch the ranks are at different steps, so each rank decides on its own;
        a rank that stops ends its epoch, and at the epoch-end meeting all ranks stop together
        (see ``docs/faults.md``).
        """
        if self.engine is not None and self.engine.in_phase:
            if self.node:
                # hierarchical: the node's ranks step together, so they decide together
                first = self.node.layout.node_ranks(self.node.layout.node)[0]
                return self.broadcast_object(obj, first, group=self.node.group)
            return obj
        return super().broadcast(obj, src)

    def _log_requeue_steps(self, met: torch.Tensor) -> None:
        steps = [int(x) for x in met[3 + self.world_size:].tolist()]
        rank_zero_info(f"adpsgd requeue: the ranks' steps at the requeue checkpoint: {steps} "
                       f"(sum {sum(steps)})")

    def _meet(self, stop: bool, requeue: bool) -> torch.Tensor:
        """The meeting of every rank (epoch end, or a requeue): one all-reduce (max) of
        ``[stop?, steps, requeue?, non-finite replica on rank r..., steps of rank r...]``;
        raises :class:`NonFiniteReplica` on every rank when a replica holds NaN/Inf."""
        assert self._flat is not None
        met = torch.zeros(3 + 2 * self.world_size, device=self.root_device)
        met[0], met[1], met[2] = float(stop), float(self.step), float(requeue)
        met[3 + self.world_size + self.global_rank] = float(self.step)
        met[3 + self.global_rank] = float(not bool(torch.isfinite(self._flat.pack().sum())))
        self.watched(dist.all_reduce, met, op=dist.ReduceOp.MAX,
                     what="waiting for every rank at the epoch-end meeting (agreeing on whether "
                     "to stop or requeue)")
        bad = [r for r in range(self.world_size) if met[3 + r].item() > 0]
        if bad:
            raise NonFiniteReplica(
                f"rank {self.global_rank}: at the end of the epoch the replica of rank(s) "
                f"{', '.join(map(str, bad))} holds NaN/Inf (its training diverged: check its "
                "learning rate, loss scaling and data); stopping every rank before it is "
                "averaged in", bad)
        return met

    def _join_requeue(self, met: torch.Tensor) -> None:
        """After a meeting: when some rank came to it to requeue, write the requeue checkpoint
        with every rank and stop (Lightning's ``SIGTERMException``, exit 0)."""
        if met[2].item() > 0:
            self._log_requeue_steps(met)
            self.requeue_together()  # type: ignore[attr-defined]
            raise SIGTERMException()

    @override
    def on_validation_start(self) -> None:
        """A validation during ``fit`` (at the epoch end, before :meth:`end_epoch`): every rank
        meets first, so that a requeue begun by ranks at their batch start is joined here
        (:meth:`before_requeue`), then the consensus weights are swapped in."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if self.engine is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.quiesce()
            self._join_requeue(self._meet(stop=False, requeue=False))
        super().on_validation_start()  # type: ignore[misc]

    def end_epoch(self, trainer: pl.Trainer) -> None:
        """Epoch end on this rank: quiet the network, agree on stopping, log consensus.

        When another rank took SLURM's requeue signal at its batch start meanwhile, it meets
        this one here (:meth:`before_requeue`; or at the validation before, when there is one):
        this rank then writes the requeue checkpoint with every rank and stops.
        """
        if self.engine is None:
            return
        self.quiesce()
        # Ranks stop independently (max_steps counts local steps): if any rank stops, all do.
        local_stop = trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
        stop = self._meet(stop=bool(local_stop), requeue=False)
        self._join_requeue(stop)
        if stop[0].item() > 0:
            trainer.should_stop = True
        n = self.global_average_every_n_steps
        if n is not None and int(stop[1].item()) // n > self._global_averages:
            # Gossip-PGA at the next meeting: some rank passed a multiple of n since the last
            # global average, so every replica becomes the exact average (one all-reduce).
            self._global_averages = int(stop[1].item()) // n
            assert self._flat is not None
            self._flat.copy_(self.average_replicas("for the periodic global average"))
        if self.consensus_every_n_steps is not None:
            self.log_consensus_distance()


class _PhaseCallback(Callback):
    """Inserted by :class:`~lightning_gossip.strategies.ADPSGDStrategy`: opens a gossip phase
    at every epoch start and closes it at every epoch end (the points where all ranks meet)."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open a gossip phase."""
        strategy = trainer.strategy
        if isinstance(strategy, _PhasesMixin):
            strategy.begin_phase()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the gossip phase (see :meth:`_PhasesMixin.end_epoch`)."""
        strategy = trainer.strategy
        if isinstance(strategy, _PhasesMixin):
            strategy.end_epoch(trainer)

