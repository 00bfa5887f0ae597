"""Asynchronous decentralized parallel SGD (AD-PSGD, Lian et al. 2018): each rank trains
without waiting for communication; a background thread averages its replica with one peer at a
time, the change applied at the next step boundary; faster ranks process more of each epoch."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gossip import _compat
from lightning_gossip.async_gossip import AsyncGossip
from lightning_gossip.budget import GossipPeriod, resolve_gossip_every_n_steps
from lightning_gossip.compression import WireDtype
from lightning_gossip.cursor.resume import CursorResume
from lightning_gossip.elastic.engines import PairwiseEngines, node_retries
from lightning_gossip.elastic.parts import ElasticParts
from lightning_gossip.hierarchy import NodeGroups, NodeLayout, make_async_groups
from lightning_gossip.overlapped_allreduce import NodeAllreduce
from lightning_gossip.pairing import ColumnPairing, Pairing, PairingName, RankPairing
from lightning_gossip.strategies.adpsgd_phases import Phases
from lightning_gossip.strategies.fit import Fit
from lightning_gossip.strategies.gossip import GossipStrategy
from lightning_gossip.strategies.options import Backend, Evaluate, SharedCursor, check_adpsgd
from lightning_gossip.strategies.shared_loader import shared_training_loader

__all__ = ["ADPSGDStrategy"]

_fits = [0]  # fits in this process, counted the same way on every rank (a newcomer's next: 0)


class ADPSGDStrategy(GossipStrategy):
    """AD-PSGD: background pairwise averaging, bounded staleness, straggler-resilient data.

    Other keyword arguments: :class:`~.gossip.GossipStrategy`'s. Owned parts besides the base's:
    :attr:`engine` (:class:`~lightning_gossip.async_gossip.AsyncGossip`), :attr:`phases`,
    :attr:`cursor`, :attr:`survivors`.

    Args:
        pairing: ``"ring"`` (default: an active rank alternates between its ring neighbours)
            or ``"random"`` (any passive rank; ``"adpsgd_random"``): :class:`~.pairing.Pairing`.
        seed: seeds the random peer choice and the shared data permutation.
        max_staleness: wait when more than this many steps are not gossiped (``None``: never).
        gossip_every_n_steps: local optimizer steps per exchange (default 1): an active rank
            starts an exchange at most once every ``n`` steps, and ``max_staleness`` counts
            exchanges (``docs/strategies.md``, Communication budget). Not with ``elastic``.
        delay_by_one: apply each exchange's result one step boundary later.
        shared_cursor: draw training batches through one shared counter, so faster ranks take
            more and every sample is used once per epoch (validation at epoch ends only);
            ``"balanced"``: slower ranks also leave an epoch's last batches (:mod:`~.end_balance`).
        global_average_every_n_steps: the exact average of all replicas at the first epoch end
            after any rank passed a multiple of this many steps; ``None`` (default) never.
        hierarchical: a node's ranks are one learner (gradients averaged inside the node) and
            AD-PSGD runs between nodes, local rank ``l`` gossiping slice ``l`` of the replica
            (``docs/strategies.md``, Multi-node).
        wire_dtype: what gossip sends, ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``; the two
            deltas of an exchange still cancel exactly (:mod:`~lightning_gossip.compression`).
        elastic: survive lost ranks (not the store's host, rank 0): the survivors go on
            without them (:mod:`lightning_gossip.elastic`, ``docs/faults.md``; hierarchical:
            without the lost rank's node, :mod:`~lightning_gossip.elastic.nodes`). Default
            ``False``.
        start_timeout: ``elastic``: start with the ranks that came within this many seconds,
            the others join as they come (:mod:`~lightning_gossip.elastic.founders`);
            ``None``: wait for every rank.
        outer_lr, outer_momentum, outer_nesterov, node_allreduce: as for ``DPSGDStrategy``
            (the outer step is taken at the epoch-end meeting of the global average).

    Example::

        import lightning as L
        import lightning_gossip  # registers "adpsgd" and "adpsgd_random"

        trainer = L.Trainer(strategy="adpsgd", accelerator="cpu", devices=4, max_epochs=10)
        trainer = L.Trainer(strategy=lightning_gossip.ADPSGDStrategy(hierarchical=True,
                            elastic=True), accelerator="gpu", devices=8, num_nodes=16)
    """

    strategy_name = "adpsgd"
    AGREED_OPTIONS = (*GossipStrategy.AGREED_OPTIONS, "pairing_name", "max_staleness",
                      "shared_cursor", "elastic", "start_timeout", "gossip_every_n_steps")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"adpsgd"`` (ring pairing) and ``"adpsgd_random"`` (random) on import."""
        strategy_registry.register(
            cls.strategy_name, cls, override=True,
            description="Asynchronous decentralized parallel SGD (AD-PSGD), ring peer choice")
        strategy_registry.register(
            f"{cls.strategy_name}_random", cls, override=True, pairing="random",
            description="Asynchronous decentralized parallel SGD (AD-PSGD), random peer choice")

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        pairing: PairingName = "ring", seed: int = 0, max_staleness: int | None = 4,
        delay_by_one: bool = False, shared_cursor: SharedCursor = True, final_average: bool = True,
        evaluate: Evaluate = "consensus", consensus_every_n_steps: int | None = 100,
        global_average_every_n_steps: int | None = None, hierarchical: bool = False,
        wire_dtype: WireDtype = "fp32", outer_lr: float | None = None, outer_momentum: float = 0.0,
        outer_nesterov: bool = True, node_allreduce: NodeAllreduce = "after_backward",
        elastic: bool = False, start_timeout: float | None = None,
        process_group_backend: Backend | None = None, gossip_every_n_steps: GossipPeriod = 1,
        timeout: timedelta | float = default_pg_timeout, heartbeat_timeout: float | None = 60.0,
    ) -> None:
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            seed=seed, delay_by_one=delay_by_one, hierarchical=hierarchical,
            global_average_every_n_steps=global_average_every_n_steps, wire_dtype=wire_dtype,
            outer_lr=outer_lr, outer_momentum=outer_momentum, outer_nesterov=outer_nesterov,
            final_average=final_average, evaluate=evaluate, node_allreduce=node_allreduce,
            consensus_every_n_steps=consensus_every_n_steps, timeout=timeout,
            process_group_backend=process_group_backend, heartbeat_timeout=heartbeat_timeout)
        self.shared_cursor, self.gossip_every_n_steps = check_adpsgd(
            pairing, max_staleness, shared_cursor, elastic, hierarchical, heartbeat_timeout,
            start_timeout, node_allreduce, gossip_every_n_steps)
        #: the pairing's name as given; the :class:`~.pairing.Pairing` built at set-up: pairing
        self.pairing_name, self.pairing = pairing, None
        self.max_staleness, self.elastic = max_staleness, bool(elastic)
        self.start_timeout = start_timeout
        #: a newcomer's join or a founder's start, and the fit's survivors (``elastic``:
        #: :class:`~lightning_gossip.elastic.parts.ElasticParts`)
        self.elastic_parts = ElasticParts(self.timeout, heartbeat_timeout, start_timeout)
        #: this rank's place in the nodes (``hierarchical``, several processes per node)
        self.layout: NodeLayout | None = None
        self.engine = None  # (AsyncGossip, the session's)
        self._groups: NodeGroups | None = None  # node, column (flat: data as both), control
        self._run_id: int | None = None
        self._last_stats: dict[str, float] = {}
        #: the gossip phases: trainer checks, phase start, epoch-end meeting
        self.phases = Phases(
            shared_cursor=self.shared_cursor, watched=self.watched,
            global_average_every_n_steps=self.global_average_every_n_steps,
            requeue_together=self.resilience.requeue_together,
            log_consensus=None if consensus_every_n_steps is None else self.log_consensus_distance)
        #: the shared cursor's position in the requeue checkpoint
        self.cursor = CursorResume()

    @override
    def before_init(self) -> None:
        """An elastic fit: a newcomer to a running fit joins it before Lightning's init (or the
        fit starts with the ranks that came, ``start_timeout``)."""
        if self.elastic:
            self.join_running_fit(self.elastic_parts, f"run{_fits[0]}",
                                  self.rank_layout(self._sharded))

    @property
    def _sharded(self) -> bool:  # hierarchical with several processes per node
        return self.hierarchical and self.num_processes > 1

    @override
    def setup_gossip(self, trainer: pl.Trainer) -> None:
        """Check the node layout, build :attr:`pairing`, the groups, start the gossip thread."""
        self.phases.check_trainer(trainer, sync_batchnorm=_compat.layer_sync(self) is not None)
        self._run_id, _fits[0] = _fits[0], _fits[0] + 1
        nodes = self.num_nodes
        if self.hierarchical and not self.joined:  # (a newcomer's default group: the members')
            self._check_node_layout()
        if self._groups is None:
            # every rank, same order, main thread; see hierarchy.make_async_groups
            if self._sharded:
                self.layout = self.rank_layout(True)
            self._groups = self.elastic_parts.groups() or make_async_groups(
                self.layout, self.process_group_backend, self.timeout)
        assert self._flat is not None
        self.node = self._node_averager(self.layout, self._groups) if self._sharded else None
        if self._sharded and nodes == 1:
            self._warn_one_node()
            self.pairing = None
        else:
            self.pairing = Pairing(self.pairing_name, nodes if self._sharded else self.world_size,
                                   self.seed)
            self.auto_period = self._period_driver(agree=False)
            engines = self._pairwise_engines() if self.elastic else None
            membership = self.elastic_parts.membership  # (a newcomer's or founder's)
            self.engine = self._make_engine(engines.first(self.pairing, membership.live) if (
                engines and membership) else self.pairing)
            self.engine.start()
            self.survivors = None
            if engines is not None:
                self.survivors = self._make_survivors(self.elastic_parts, trainer,
                                                      f"run{self._run_id}", engines,
                                                      node=self.node)  # (joins ride on it)
                node_retries(self.node, self.survivors.retry)  # a node all-reduce, again
            self.step = self.elastic_parts.open_phase(self.engine, self.step)  # a newcomer
            if self.elastic:  # its loader draws with the survivors' claims from now on
                self.rebuild_train_loader(trainer)

    @override
    def begin_fit(self, fit: Fit) -> None:
        """The base's; the phases get the fit too, and the resilience their meeting before a
        requeue (a rank that takes the requeue signal meets the ranks at their epoch end
        first)."""
        fit = replace(fit, before_requeue=self.phases.before_requeue)
        super().begin_fit(fit)
        self.phases.begin_fit(fit)

    def _make_engine(self, pairing: Pairing | RankPairing) -> AsyncGossip:
        """The fit's first gossip engine over ranks, or nodes (sharded), on its groups."""
        assert self._groups is not None
        # an elastic pairing is over the column's ranks already; the first one over nodes
        if (layout := self.layout if self._sharded else None) and isinstance(pairing, Pairing):
            pairing = ColumnPairing(pairing, layout)
        return self._engine_factory()(pairing, control_group=self._groups.control,
                                      data_group=self._groups.column)

    def _engine_factory(self) -> partial[AsyncGossip]:
        """:class:`~lightning_gossip.async_gossip.AsyncGossip` with this fit's values, given a
        pairing and its ``control_group`` and ``data_group`` (the first engine's, or the
        survivors')."""
        assert self._flat is not None
        layout = self.layout if self._sharded else None
        return partial(
            AsyncGossip, self._flat, self.global_rank, timeout=self.timeout,
            max_staleness=self.max_staleness, delay_by_one=self.delay_by_one,
            period=resolve_gossip_every_n_steps(self.gossip_every_n_steps),
            heartbeat=self.heartbeat, wire_dtype=self._wire,
            shard=(layout.local, layout.devices) if layout else (0, 1),
            node_gather=self.node.all_gather if layout and self.node else None,
            auto=self.auto_period)  # (None when elastic: "auto" is refused there)

    def _pairwise_engines(self) -> PairwiseEngines:
        """The survivors' engines (``elastic``): a pairing over the live ranks (sharded: the
        live nodes, seen by this rank's column), the phase open at the session's step."""
        return PairwiseEngines(self.session, self.rank_layout(self._sharded),
                               (self.pairing_name, self.seed), self._engine_factory(),
                               node=self.node)

    @override
    def teardown_gossip(self) -> None:
        """Stop the gossip thread, keep its counters (:attr:`gossip_stats`), end the phases."""
        self.phases.end_fit()
        if self.survivors is not None:
            self.survivors.end()
        if self.engine is not None:
            self.engine.close()
            self._last_stats = dict(vars(self.engine.stats))
            self.engine = None

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders draw from the shared cursor (:mod:`~.shared_loader`), no other."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (not self.shared_cursor or not self.gossip_enabled or trainer is None
                or trainer.state.stage != RunningStage.TRAINING):
            return dataloader
        # the node's ranks step together: it claims (built here: set-up may not have run yet)
        node = self.rank_layout(True) if self._sharded else None
        ledger = self.survivors and self.survivors.ledger(f"run{self._run_id}/ledger",
                                                          on_wait=self.phases.wait_at_end)
        claimant = (self.node_rank, self.num_nodes) if node else (self.global_rank, self.world_size)
        return shared_training_loader(
            self.cursor, dataloader, key=f"run{self._run_id}", seed=self.seed, node=node,
            ledger=ledger, balance_as=claimant if self.shared_cursor == "balanced" else None,
            epoch=trainer.fit_loop.epoch_progress.current.processed)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The local optimizer step, then signal the gossip thread (never waits for gossip,
        except for the ``max_staleness`` bound). First, a rank that the liveness monitor found
        silent or departed is raised as ``PeerSilent`` (``docs/faults.md``)."""
        self.check_liveness(self.step)
        if self.engine is not None and not self.engine.in_phase:
            self.phases.begin()  # e.g. manual optimization outside the usual epoch hooks
        if self.node:
            closure = self.node.wrap(closure)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.node:
            self.node.average_buffers()
        self.step += 1
        self.phases.after_step(self.step - 1)
        if self.survivors is not None:  # hierarchical: the joins the node agreed on in the step
            self.survivors.admit_agreed()
        self.log_period_switches()
        return out

    @override
    def quiesce(self) -> None:
        """Finish the in-flight exchanges and close the gossip phase on every rank."""
        self.phases.quiesce()

    @property
    def gossip_stats(self) -> dict[str, float]:
        """This rank's counters (:class:`~.async_gossip.state.GossipStats`; the last fit's)."""
        return dict(vars(self.engine.stats)) if self.engine is not None else self._last_stats

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Tensor:
        """The base's, except mid-epoch, where values stay local (ranks at different steps)."""
        if self.phases.in_phase and isinstance(tensor, Tensor):
            self.phases.warn_local_reduce()
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Like :meth:`GossipStrategy.broadcast`, except mid-epoch, where ``obj`` stays local
        (``max_time``: a rank that stops ends its epoch; all stop at the meeting)."""
        if not self.phases.in_phase:
            return super().broadcast(obj, src)
        if self.node:  # hierarchical: the node's ranks step together, so they decide together
            return self.broadcast_object(obj, self.node.layout.leader, group=self.node.group)
        return obj

    @override
    def on_validation_start(self) -> None:
        """During ``fit`` every rank meets first (joining a requeue begun elsewhere,
        :meth:`Phases.before_validation <.adpsgd_phases.Phases.before_validation>`), then the
        consensus weights are swapped in."""
        self.phases.before_validation()
        super().on_validation_start()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """The requeue checkpoint also holds the shared cursor's position (mid-epoch)."""
        if self.resilience.requeue_done:
            checkpoint = self.with_restart_position(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def with_restart_position(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with the shared cursor's position in the current epoch (requeue)."""
        return self.cursor.saved(checkpoint, self.lightning_module.trainer.current_epoch)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the checkpoint; a saved cursor position starts its epoch's counter there."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.cursor.load(checkpoint)
        return checkpoint

    @override
    def teardown(self) -> None:
        """A loaded cursor position applies to the fit that loaded it only."""
        self.cursor.reset()
        super().teardown()
