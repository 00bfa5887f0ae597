"""The elastic parts of a ``DPSGDStrategy(elastic=True)`` fit: :class:`ElasticRounds`, owned by
the strategy as ``strategy.elastic_rounds`` and built from values and small callables, and its
Lightning side, :class:`EpochHooks` (put first in the trainer's callbacks by :func:`attach`).

Synchronous gossip couples every rank to this round's peers, so a lost rank stops its peers'
rounds, and theirs stop the next ones: every survivor meets the loss within a heartbeat
timeout, as a failed round (:class:`~lightning_gossip.errors.PeerSilent`) or the liveness
monitor's finding at a step boundary. Each survivor then (:class:`~.elastic.Survivors`, the
``adpsgd`` recovery, with this module's engine):

1. drops its rounds in flight unapplied (:meth:`~lightning_gossip.sync_gossip.SyncGossip.
   abandon`): that round's mixing is lost, the local step before it is kept;
2. agrees with the others on the live ranks, builds the new groups and returns the lost rank's
   claimed, untrained batches to the shared cursor;
3. agrees on the step the rounds go on from (the largest of the survivors' next steps: they may
   be a step or two apart), and builds the topology's graph over the survivors
   (:class:`~lightning_gossip.topology.MemberTopology`, the topology re-drawn for their number
   with the membership's generation added to the seed), numbered from that step.

Data: the training loader draws from the shared cursor (as under ``adpsgd``), so the survivors
take over the rest of the epoch. Ranks may then claim different numbers of batches; a rank that
finds the epoch's batches all taken keeps running gossip-only rounds while it waits for the
others there (:class:`~lightning_gossip.claim_ledger.ClaimLedger`), and before validation or the
epoch's end every rank settles on the same step (:class:`~lightning_gossip.even_rounds.
EvenRounds`). Mid-epoch, Lightning's collectives stay local (the ranks' batch counts may differ
by one at an epoch's end), as under ``adpsgd``.

Hierarchical (:mod:`~.elastic_nodes`): a lost rank's node leaves; the step is agreed over the
column, then over the node; the topology is built over the live nodes; a node's ranks wait at an
epoch's end in lockstep (each gossip-only round is a node collective,
:class:`~lightning_gossip.node_claims.NodeShare`); a node joins whole (the requests are
all-reduced over the columns, then the nodes).

Joins: once a rank was lost, a replacement started with its environment asks for the free slot
(:func:`~.newcomer.join_running_fit`, as under ``adpsgd``). Rounds couple the members, so they
must admit it at the same step: every :data:`JOIN_CHECK_EVERY` steps each member reads the
requests from the store and the members all-reduce what they saw (a maximum over one flag per
rank slot, on the survivors' gloo group); a request any member saw is admitted by all, at that
step's start (:meth:`~.elastic.Survivors.admit`: the members' exact average and the lowest
member's checkpoint handed over). The newcomer builds the same topology over the new members
(:meth:`ElasticRounds.enter`) and its first round is that step's. No member admits while any
is in its meeting before validation or at an epoch's end (one more flag in the all-reduce): the
lowest member's checkpoint would say that the epoch's last batch is done, and the newcomer could
not tell whether the members validate next; the request waits for the next look.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lightning_gossip import _compat
from lightning_gossip.errors import NewcomersAdmitted
from lightning_gossip.even_rounds import EvenRounds
from lightning_gossip.hierarchy import NodeGroups
from lightning_gossip.liveness import Heartbeat
from lightning_gossip.membership import Membership
from lightning_gossip.node_claims import NodeShare
from lightning_gossip.shared_cursor import default_store
from lightning_gossip.strategies.collectives import Watched, share_epoch_values, sync_metrics_over
from lightning_gossip.strategies.cursor_resume import CursorResume
from lightning_gossip.strategies.elastic import Survivors
from lightning_gossip.strategies.elastic_joins import JOIN_CHECK_EVERY
from lightning_gossip.strategies.elastic_nodes import RANKS, NodeUnits
from lightning_gossip.strategies.node_averaging import NodeAverager
from lightning_gossip.sync_gossip import SyncGossip
from lightning_gossip.topology import MemberTopology, build

__all__ = ["JOIN_CHECK_EVERY", "ElasticRounds", "EpochHooks", "attach"]


class ElasticRounds:
    """The survivors of an elastic ``dpsgd`` fit and its end-of-epoch meetings.

    Args:
        run: the fit's name, the same on every rank.
        rank, world_size, timeout, heartbeat, backend, step, epoch, loggers: as for
            :class:`~.elastic.Survivors`.
        topology: the topology's name (rebuilt over the survivors, or their nodes) and its seed.
        make_engine: ``(topology, group, **kw)``: a synchronous engine over the survivors'
            data group (hierarchical: their column's; ``kw``: ``groups``, ``node_gather``).
        engine: the fit's engine (``None``: a lone survivor).
        set_engine: makes an engine the fit's; returns the old one.
        set_step: sets the strategy's step (the next round).
        end_round: ``(step)``: what follows a round in the strategy's step: the step counted
            and its periodic collectives (global average, consensus distance); also after a
            gossip-only round, so that every rank runs the same collectives.
        membership, hand_over, on_group: as for :class:`~.elastic.Survivors` (a newcomer's
            membership; the members' side of a join, ``None``: joins refused; told the new
            group of Lightning's collectives).
        watched: the strategy's watched wait (the epoch-end collectives of
            :func:`~.collectives.share_epoch_values`).
        node: hierarchical (:mod:`~.elastic_nodes`): this rank's node averaging (its layout,
            the all-gather; given each new node group); ``None``: flat.
        gather_on_worker: hierarchical: the communication thread all-gathers a sharded round
            (on the survivors' gloo node group; ``False``: NCCL, the training thread).
    """

    def __init__(self, run: str, rank: int, world_size: int, timeout: timedelta, *,
                 heartbeat: Heartbeat | None, backend: str, topology: tuple[str, int],
                 make_engine: Callable[..., SyncGossip],
                 engine: Callable[[], SyncGossip | None],
                 set_engine: Callable[[SyncGossip | None], SyncGossip | None],
                 step: Callable[[], int], set_step: Callable[[int], None],
                 end_round: Callable[[int], None], epoch: Callable[[], int],
                 loggers: Sequence[Any] = (), membership: Membership | None = None,
                 hand_over: Callable[[Any, Any, list[int], bool], None] | None = None,
                 on_group: Callable[[Any], None] = lambda group: None,
                 watched: Watched, node: NodeAverager | None = None,
                 gather_on_worker: bool = True) -> None:
        self.run, self.world_size, self.topology = run, world_size, topology
        self.node, self.gather_on_worker = node, gather_on_worker
        layout = node.layout if node else None
        #: what leaves together (a node: the step is agreed over the node too); this rank's
        #: place in its node's claims (the node's ranks wait at an epoch's end in lockstep)
        self.units = NodeUnits(layout.devices, synchronous=True) if layout else RANKS
        self.share = layout and NodeShare(layout.node, layout.local, layout.devices, True,
                                          membership.generation if membership else 0)
        self.make_engine, self.engine, self.set_engine = make_engine, engine, set_engine
        self.watched = watched
        self.step, self.set_step, self.end_round = step, set_step, end_round
        self.survivors = Survivors(run, rank, world_size, timeout, heartbeat=heartbeat,
                                   backend=backend, make_engine=self._engine_over,
                                   set_engine=set_engine, step=step, epoch=epoch,
                                   loggers=loggers, membership=membership,
                                   hand_over=hand_over, poll_joins=False, on_group=on_group,
                                   units=self.units)
        self.rounds = EvenRounds(default_store(), f"elastic/{run}/rounds", rank,
                                 live=lambda: self.survivors.live,
                                 timeout_s=timeout.total_seconds())
        #: whether this rank trains in an epoch that has not settled yet; the epoch's batches
        #: it trained; whether the fit resumed at an epoch's end (its last batch trained)
        self.in_epoch, self.batches, self.epoch_end_restored = False, 0, False
        self.cursor = CursorResume()  # the training loader's shared cursor
        self.settling = False  # in the meeting before validation or at the epoch's end
        #: the survivors' gloo groups (after a loss: the joins' all-reduce): the column's (flat:
        #: every live rank's), the node's (hierarchical); the step last checked for joins
        self.control: Any = None
        self.node_control: Any = None
        self._checked = -1

    @classmethod
    def of_fit(cls, trainer: pl.Trainer, rank: int, world_size: int, timeout: timedelta, *,
               run: int, **values: Any) -> ElasticRounds:
        """The rounds of ``trainer``'s fit (the ``run``-th elastic fit of this process),
        attached to it (:meth:`attach`); ``values``: the constructor's other arguments."""
        rounds = cls(f"dpsgd{run}", rank, world_size, timeout,
                     epoch=lambda: trainer.current_epoch, on_group=lambda group:
                     sync_metrics_over(trainer.lightning_module, group), **values)
        attach(rounds, trainer)
        if rounds.node is not None:  # a node all-reduce interrupted by a loss is issued again
            rounds.node.retry = rounds.survivors.retry
        return rounds

    def training_loader(self, dataloader: object, trainer: pl.Trainer, seed: int) -> object:
        """A training loader rebuilt to draw from the shared cursor, its claims tracked so that
        a lost rank's untrained batches go back (as ``adpsgd``'s); others as they are."""
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        ledger = self.survivors.ledger(f"{self.run}/ledger", on_wait=self.wait_round)
        return self.cursor.shared_loader(
            dataloader, key=f"{self.run}/cursor", seed=seed, node=self.share, ledger=ledger,
            epoch=trainer.fit_loop.epoch_progress.current.processed)

    def _engine_over(self, live: Sequence[int], _group: Any, control: Any, data: Any,
                     node: Any = None, node_control: Any = None,
                     rounds: Any = None) -> SyncGossip | None:
        """The survivors' engine: the step agreed (the largest next step), the topology over
        ``live`` (hierarchical: over the live nodes; the groups of
        :meth:`~.elastic_nodes.NodeUnits.groups`) numbered from it."""
        self.control, self.node_control = control, node_control
        # (hierarchical: a node's ranks may have failed a step apart)
        common = int(self._max_over_survivors(torch.tensor([self.step()])).item())
        self.set_step(common)
        d, kw = self.units.devices, {}
        if self.node is not None:  # hierarchical
            self.node.group = node
            kw = {"node_gather": self.node.all_gather, "groups": NodeGroups(
                node, data, node_gossip=node_control if self.gather_on_worker else None)}
        units = sorted({r // d for r in live})  # the live ranks, or nodes
        if len(units) < 2:
            return None
        name, seed = self.topology
        base = build(name, len(units), seed + self.survivors.membership.generation)
        engine = self.make_engine(MemberTopology(base, units, self.world_size // d, common),
                                  rounds or data, **kw)
        engine.start()
        return engine

    def before_step(self, step: int) -> None:
        """The engine's :meth:`~lightning_gossip.sync_gossip.SyncGossip.before_step` (start
        ``step``'s round), except that a lost peer (posting to it fails at once) makes the
        survivors go on first; the round then starts at the step they agree on, on the next
        call (the strategy's ``optimizer_step`` makes it)."""
        try:
            self.admit_joins(step)
            engine = self.engine()
            if engine is not None:
                engine.before_step(step)
        except Exception as e:
            self.survivors.survive(e)

    def _max_over_survivors(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (int64, CPU) become their maximum over the survivors: on the gloo control
        group (flat: every live rank; hierarchical: the column's, then the node's)."""
        for group in (self.control, self.node_control):
            if group is not None:
                dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        return values

    def admit_joins(self, step: int) -> bool:
        """At the start of ``step`` (a multiple of :data:`JOIN_CHECK_EVERY`, once a rank was
        lost, once per step): admit the processes any member found asking to join (see the
        module docstring); whether some were."""
        survivors = self.survivors
        if (survivors.hand_over is None or self.control is None or step == self._checked
                or step % JOIN_CHECK_EVERY):
            return False
        self._checked = step
        asked = survivors.asked_to_join() or ()
        flags = torch.zeros(self.world_size + 1, dtype=torch.int64)
        flags[list(asked)] = 1
        flags[-1] = self.settling  # a member at its epoch-end meeting: not now (the docstring)
        self._max_over_survivors(flags)
        if flags[-1]:
            return False
        joined = self.units.complete(flags[:-1].nonzero().flatten().tolist())  # whole nodes
        if joined:
            survivors.retry(lambda: survivors.admit(joined))
        return bool(joined)

    def enter(self, step: int, live: Sequence[int], *groups: Any) -> SyncGossip | None:
        """A newcomer's engine, handed ``step`` by the lowest member: the topology over ``live``
        (``groups``: of its generation, Lightning's left out) numbered from the step agreed
        with the members (in their :meth:`admit_joins`); that step's round is its first (the
        members looked for joins at it already)."""
        self.set_step(step)
        engine = self._engine_over(live, None, *groups)
        self._checked, self.in_epoch = self.step(), True  # it joins mid-epoch
        return engine

    def found(self, live: Sequence[int], control: Any, data: Any) -> SyncGossip | None:
        """A founder's engine (a fit started with the ranks that came, :mod:`~.founders`):
        the topology over ``live`` from the founders' common step (0)."""
        return self._engine_over(live, None, control, data)

    def finish(self, step: int, engine: SyncGossip | None) -> None:
        """After the local step of ``step``: its round (``engine``'s), then :attr:`end_round`.
        When either fails on a lost rank, the step is counted and the survivors go on without
        it, at a step they agree on; other errors are raised."""
        try:
            if engine is not None:
                engine.after_step(step)
        except Exception as e:
            self.set_step(step + 1)  # the round's mixing is lost, the local step kept
            self.survivors.survive(e)
            return
        try:
            self.end_round(step)
        except Exception as e:  # a periodic collective (each survivor meets the loss)
            self.survivors.survive(e)

    def pad(self, step: int) -> int:
        """One gossip-only round at ``step`` (the replica mixed, no gradient); returns the next
        step. A lost peer raises, the step counted (callers recover through
        :meth:`~.elastic.Survivors.retry`, which runs their operation again). Newcomers admitted
        at ``step``'s start raise :class:`NewcomersAdmitted` (the step's round not run yet)."""
        if self.admit_joins(step):
            raise NewcomersAdmitted
        engine = self.engine()
        if engine is not None:
            engine.before_step(step)
            try:
                engine.after_step(step)
            except BaseException:
                self.set_step(step + 1)
                raise
        self.end_round(step)
        return self.step()

    def wait_round(self) -> None:
        """The shared cursor's wait at an epoch's end: a gossip-only round, so that the ranks
        still training find this rank in their rounds (first, a loss the liveness monitor
        found is recovered from)."""
        self.survivors.poll()
        try:
            self.survivors.retry(lambda: self.pad(self.step()))
        except NewcomersAdmitted:
            pass  # the round runs at the next wait, with the new members

    def resumed(self, at_epoch_end: bool) -> None:
        """The fit starts; ``at_epoch_end``: from a checkpoint written at an epoch's end (its
        last batch trained)."""
        self.epoch_end_restored = at_epoch_end

    def open_epoch(self, epoch: int) -> None:
        """Training epoch ``epoch`` starts on this rank."""
        self.in_epoch, self.batches, self.epoch_end_restored = True, 0, False
        self.survivors.epoch_opened(epoch)

    def batch_trained(self, epoch: int) -> None:
        """This rank trained one more batch of ``epoch``."""
        self.batches += 1
        self.survivors.batch_trained(epoch)

    def interrupted(self) -> None:
        """The fit ended in an exception: a later validate or test meets the others without
        settling the epoch."""
        self.in_epoch = False

    def settle(self, epoch: int) -> None:
        """Before validation and at the epoch's end: leave ``epoch`` at the same step as every
        live rank (:class:`~lightning_gossip.even_rounds.EvenRounds`); once per epoch."""
        if not self.in_epoch:
            return
        membership, self.settling = self.survivors.membership, True
        try:  # named by the generation: a loss begins a new meeting (joins wait: admit_joins)
            self.survivors.retry(lambda: self.rounds.settle(
                f"epoch{epoch}/gen{membership.generation}", self.step(), self.pad))
        finally:
            self.settling = False
        self.in_epoch = False

    def end_epoch(self, trainer: pl.Trainer) -> None:
        """At the epoch's end: :meth:`settle`. Lightning steps the epoch's schedulers and
        validates after an epoch's last batch, so a rank whose epoch had none (fewer batches
        left than ranks, a newcomer admitted as the shared cursor ran out) does both here: the
        others validate after settling with it. Then every rank: a rank without a batch takes
        part in the epoch-end reductions of what the others logged
        (:func:`~.collectives.share_epoch_values`)."""
        self.settle(trainer.current_epoch)
        if not (self.batches or self.epoch_end_restored):
            _compat.end_epoch_without_batches(trainer)
            if _compat.validation_due(trainer):
                _compat.validate_now(trainer)
        share_epoch_values(trainer, self.batches > 0, self.watched)


def attach(rounds: ElasticRounds, trainer: pl.Trainer) -> None:
    """Check the trainer (``ValueError`` for what an elastic ``dpsgd`` fit cannot support)
    and put ``rounds``' :class:`EpochHooks` first in its callbacks (once)."""
    if trainer.val_check_interval != 1.0:
        raise ValueError(
            "DPSGDStrategy(elastic=True) validates at epoch ends only (the ranks share the "
            "epoch's batches, so they may train different numbers of them); got "
            f"val_check_interval={trainer.val_check_interval}. Use "
            "check_val_every_n_epoch.")
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and _compat.checkpoints_within_epoch(cb):
            raise ValueError(
                "DPSGDStrategy(elastic=True) checkpoints at epoch ends and validations only; "
                "ModelCheckpoint(every_n_train_steps / train_time_interval) is not supported.")
    if not any(isinstance(cb, EpochHooks) for cb in trainer.callbacks):
        trainer.callbacks.insert(0, EpochHooks(rounds))


class EpochHooks(Callback):
    """Lightning's side of :class:`ElasticRounds`: an epoch opens, a batch is trained, the
    ranks settle before validation during ``fit`` and at the epoch's end."""

    def __init__(self, rounds: ElasticRounds) -> None:
        self.rounds = rounds

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.resumed(_compat.epoch_end_restored(trainer))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.open_epoch(trainer.current_epoch)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.rounds.batch_trained(trainer.current_epoch)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.rounds.settle(trainer.current_epoch)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.end_epoch(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self.rounds.interrupted()
