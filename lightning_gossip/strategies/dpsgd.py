"""Synchronous decentralized parallel SGD (D-PSGD, Lian et al. 2017).

Every optimizer step, every rank averages its replica with this step's neighbours as the
topology's mixing matrix ``W_t`` says: ``x_{t+1} = W_t x_t - lr * g(x_t)``. With the default
randomized ring (RAND-PSGD, Zhang et al. 2020) each step costs two messages per rank while
replicas converge to consensus about as fast as with a fully connected graph.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gossip.budget import GossipPeriod, resolve_gossip_every_n_steps
from lightning_gossip.compression import WireDtype
from lightning_gossip.cursor.resume import CursorResume
from lightning_gossip.elastic.engines import node_retries
from lightning_gossip.elastic.parts import ElasticParts
from lightning_gossip.elastic.rounds import ElasticRounds, RoundEngines
from lightning_gossip.hierarchy import NodeGroups, NodeLayout, make_node_groups
from lightning_gossip.overlapped_allreduce import NodeAllreduce
from lightning_gossip.strategies.dpsgd_elastic import attach, training_loader
from lightning_gossip.strategies.dpsgd_stop import AgreedStops
from lightning_gossip.strategies.fit import Fit
from lightning_gossip.strategies.gossip import GossipStrategy
from lightning_gossip.strategies.options import Backend, Evaluate, check_dpsgd
from lightning_gossip.sync_gossip import SyncGossip, SyncStats
from lightning_gossip.topology import Topology, resolve_learners

__all__ = ["DPSGDStrategy"]

_fits = [0]  # the elastic fits of this process (their store keys' names; a newcomer's next: 0)


class DPSGDStrategy(GossipStrategy):
    """Synchronous D-PSGD: mix with this step's neighbours around every optimizer step.

    The keyword arguments ``final_average``, ``evaluate``, ``consensus_every_n_steps``,
    ``global_average_every_n_steps``, ``process_group_backend``, ``timeout`` and
    ``heartbeat_timeout`` are those of :class:`~lightning_gossip.strategies.gossip.GossipStrategy`.

    Args:
        topology: a name from :data:`lightning_gossip.topology.TOPOLOGIES`, a
            :class:`~lightning_gossip.topology.Topology`, or a doubly stochastic matrix.
            Default ``"random_ring"`` (RAND-PSGD).
        seed: seeds time-varying topologies; the strategy mixes with exactly
            ``topology.build(name, world_size, seed).mixing_matrix(t)`` at optimizer step ``t``.
        overlap: snapshot ``x_t`` and start the exchange before forward/backward, so it runs
            while the gradient is computed; then ``x_{t+1} = x_t' + (W_t x_t - x_t)`` where
            ``x_t'`` is the result of the local optimizer step. ``False`` exchanges after the
            local step: ``x_{t+1} = W_t x_t'`` (blocking).
        delay_by_one: apply at step ``t`` the neighbours' contribution from the exchange
            started at step ``t - 1``: ``x_{t+1} = x_t' + (W_{t-1} x_{t-1} - x_{t-1})``. Every
            exchange gets a whole step to hide behind. Implies ``overlap``.
        gossip_every_n_steps: local optimizer steps per exchange (default 1): only the last
            step ``e`` of every ``n`` exchanges, with ``W_e`` (``1/n`` of the bytes per step);
            overlapped, its round is posted at the period's first step and hides behind all
            ``n`` steps (``docs/strategies.md``, Communication budget). Not with ``elastic``.
        hierarchical: treat the ranks of a node (same ``node_rank``) as one learner: average
            gradients inside the node every step (one all-reduce on the node's group), so its
            ranks hold bit-identical weights, and gossip only between nodes, following
            ``topology.build(name, num_nodes, seed).mixing_matrix(t)`` over nodes. Local rank
            ``l`` exchanges slice ``l`` of the replica with local rank ``l`` of the peer nodes,
            then the node all-gathers the mixed slices. One process per node: the same as
            ``False``; one node: plain data parallelism (with a warning).
        wire_dtype: what gossip sends, ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (half the
            bytes). Compressed values are mixed in the mean-preserving form
            ``x_i += sum_j W_ij (Q(x_j) - Q(x_i))`` (:mod:`lightning_gossip.compression`), so
            the mean of the replicas is kept to fp32 rounding.
        outer_lr: an outer optimizer on the periodic global average (SlowMo / DiLoCo, see
            ``docs/remedies.md`` and :mod:`lightning_gossip.outer`): each global average moves
            every replica from the previous one (the anchor) by ``outer_lr`` times the
            (Nesterov) momentum of the average's move. Needs
            ``global_average_every_n_steps``; ``None`` (default): the plain average.
            ``outer_lr=1`` with ``outer_momentum=0`` is the plain average bit for bit.
        outer_momentum: the outer momentum in ``[0, 1)`` (default 0).
        outer_nesterov: Nesterov outer momentum (default) or heavy ball.
        node_allreduce: when the node's gradient all-reduce runs (``hierarchical``):
            ``"after_backward"`` (default: one flat all-reduce once backward is done) or
            ``"overlapped"`` (buckets of gradients all-reduced as backward produces them, the
            way ``DistributedDataParallel`` does; the same gradients).
        elastic: survive lost ranks (not rank 0, the store's host; hierarchical: nodes,
            :mod:`~lightning_gossip.elastic.nodes`): the survivors rebuild the topology (by
            name) over themselves at an agreed step; batches come from a shared cursor; a
            replacement with a lost rank's environment joins
            (:mod:`~lightning_gossip.elastic.rounds`). Default ``False``.
        start_timeout: ``elastic``: start with the ranks that came within this many seconds,
            the others join as they come (:mod:`~lightning_gossip.elastic.founders`);
            ``None``: wait for every rank.

    SIGTERM (a scheduler's time limit, preemption) and SLURM's auto-requeue signal are agreed
    through the gossip messages, without a per-step collective on the world group: every rank
    stops, or writes the requeue checkpoint, at the same step (:mod:`~.dpsgd_stop`).

    Example::

        import lightning as L
        import lightning_gossip  # registers "dpsgd"

        trainer = L.Trainer(strategy="dpsgd", accelerator="cpu", devices=4)
        trainer = L.Trainer(
            strategy=lightning_gossip.DPSGDStrategy(topology="exponential", overlap=False),
            accelerator="gpu", devices=8, num_nodes=4,
        )
    """

    strategy_name = "dpsgd"
    resilience: AgreedStops
    AGREED_OPTIONS = (*GossipStrategy.AGREED_OPTIONS, "topology_spec", "overlap", "elastic",
                      "start_timeout", "gossip_every_n_steps")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"dpsgd"`` in Lightning's ``StrategyRegistry`` (on import)."""
        strategy_registry.register(
            cls.strategy_name, cls, override=True,
            description="Synchronous decentralized parallel SGD (D-PSGD) on a randomized ring")

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        topology: str | Topology | np.ndarray | list = "random_ring", seed: int = 0,
        overlap: bool = True, delay_by_one: bool = False, hierarchical: bool = False,
        wire_dtype: WireDtype = "fp32", outer_lr: float | None = None, outer_momentum: float = 0.0,
        outer_nesterov: bool = True, node_allreduce: NodeAllreduce = "after_backward",
        elastic: bool = False, start_timeout: float | None = None, final_average: bool = True,
        evaluate: Evaluate = "consensus", consensus_every_n_steps: int | None = 100,
        global_average_every_n_steps: int | None = None, gossip_every_n_steps: GossipPeriod = 1,
        process_group_backend: Backend | None = None,
        timeout: timedelta | float = default_pg_timeout, heartbeat_timeout: float | None = 60.0,
    ) -> None:
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            seed=seed, delay_by_one=delay_by_one, hierarchical=hierarchical,
            global_average_every_n_steps=global_average_every_n_steps, wire_dtype=wire_dtype,
            outer_lr=outer_lr, outer_momentum=outer_momentum, outer_nesterov=outer_nesterov,
            node_allreduce=node_allreduce, final_average=final_average, evaluate=evaluate,
            consensus_every_n_steps=consensus_every_n_steps, timeout=timeout,
            process_group_backend=process_group_backend, heartbeat_timeout=heartbeat_timeout)
        self.gossip_every_n_steps = check_dpsgd(topology, elastic, hierarchical, heartbeat_timeout,
                                                start_timeout, node_allreduce, gossip_every_n_steps)
        self.topology_spec = topology
        self.overlap = bool(overlap) or self.delay_by_one
        #: the built topology: over nodes with ``hierarchical=True`` (after set-up)
        self.topology: Topology | None = None
        #: this rank's place in the nodes (the sharded / compressed exchange), after set-up
        self.layout: NodeLayout | None = None
        #: the engine (:class:`~lightning_gossip.sync_gossip.SyncGossip`, the session's; after
        #: set-up; ``None`` with nothing to gossip with: one hierarchical node)
        self.engine = None
        #: this rank's node and column groups (flat: the gossip group as both); the engine's
        #: process group over every rank (created once, at the first set-up)
        self._groups: NodeGroups | None = None
        self.gossip_group: dist.ProcessGroup | None = None
        self._stats = SyncStats()  # over every fit of this process
        self.elastic, self.start_timeout = bool(elastic), start_timeout
        #: an elastic fit's rounds (:class:`~lightning_gossip.elastic.rounds.ElasticRounds`;
        #: their Lightning side: :mod:`~.dpsgd_elastic`) and its training loader's shared cursor
        self.elastic_rounds: ElasticRounds | None = None
        self.cursor = CursorResume()
        #: a newcomer's join or a founder's start, and the survivors
        #: (:class:`~lightning_gossip.elastic.parts.ElasticParts`)
        self.elastic_parts = ElasticParts(self.timeout, heartbeat_timeout, start_timeout,
                                          synchronous=True)

    @override
    def before_init(self) -> None:
        """An elastic fit: a newcomer to a running fit joins it before Lightning's init (or the
        fit starts with the ranks that came, ``start_timeout``)."""
        if self.elastic:
            self.join_running_fit(self.elastic_parts, f"dpsgd{_fits[0]}",
                                  self.rank_layout(self.hierarchical))

    @override
    def collectives_local(self) -> bool:
        """Mid-epoch of an elastic fit (a newcomer: from its start), where the ranks may train
        different numbers of batches."""
        return self.elastic_rounds.in_epoch if self.elastic_rounds else self.joined

    @override
    def _make_resilience(self) -> AgreedStops:
        """Stops and requeues agreed through the gossip messages (:mod:`.dpsgd_stop`)."""
        return AgreedStops(**self._resilience_callables())

    @override
    def begin_fit(self, fit: Fit) -> None:
        """The base's, with the gossip group (the agreed stops' all-reduce)."""
        super().begin_fit(replace(fit, group=self.gossip_group))

    @override
    def setup_gossip(self, trainer: pl.Trainer) -> None:
        """Check the node layout (``hierarchical``), build :attr:`topology` (over ranks, or over
        nodes) and the gossip process groups. Bad input fails here on every rank."""
        nodes, devices = self.num_nodes, self.num_processes
        hierarchical = self.hierarchical and devices > 1
        if self.hierarchical and not self.joined:  # (a newcomer's default group: the members')
            self._check_node_layout()
        exchanging = not (hierarchical and nodes == 1)
        if not exchanging:
            self._warn_one_node()
        else:
            self.topology = self.resolve_topology(nodes, devices)
        first = self.elastic_parts.first  # (its groups are its generation's, built by name)
        if self.gossip_group is None:  # its own group, apart from Lightning's collectives
            self.gossip_group = first.groups.gossip if first else dist.new_group(
                backend=self.process_group_backend, timeout=self.timeout)
            layout = self.rank_layout(hierarchical)
            if hierarchical:
                # the communication thread's own node group for the sharded rounds' all-gather;
                # none with NCCL, where the training thread all-gathers (sync_gossip)
                self._groups = self.elastic_parts.groups() or make_node_groups(
                    layout, self.process_group_backend, self.timeout,
                    gossip_node_group=self._gather_on_worker())
            else:
                self._groups = NodeGroups(node=self.gossip_group, column=self.gossip_group)
            self.layout = layout
        self.node = self._node_averager(self.layout, self._groups) if hierarchical else None
        self.engine = None
        engine = partial(SyncGossip, self._flat, self.global_rank, timeout=self.timeout,
                         overlap=self.overlap, delay_by_one=self.delay_by_one,
                         wire_dtype=self._wire, layout=self.layout, heartbeat=self.heartbeat,
                         stats=self._stats,  # the survivors' too (an elastic fit)
                         period=resolve_gossip_every_n_steps(self.gossip_every_n_steps))
        self.auto_period = self._period_driver(agree=True) if exchanging else None
        if exchanging and first is None:
            assert self.topology is not None
            self.engine = engine(self.topology, self.gossip_group,
                                 groups=self._groups if hierarchical else None,
                                 node_gather=self.node.all_gather if self.node else None,
                                 auto=self.auto_period)
            self.engine.start()
        if self.elastic and (self.engine is not None or first):
            self._setup_elastic(trainer, engine)

    def _setup_elastic(self, trainer: pl.Trainer, engine: partial[SyncGossip]) -> None:
        """An elastic fit's survivors (their engines: the topology rebuilt over them from an
        agreed step, :class:`~lightning_gossip.elastic.rounds.RoundEngines`; ``engine``: the
        fit's engine with its values) and rounds; a newcomer's or founder's first engine."""
        parts = self.elastic_parts
        run, _fits[0] = f"dpsgd{_fits[0]}", _fits[0] + 1
        engines = RoundEngines(self.session, self.rank_layout(self.hierarchical),
                               (str(self.topology_spec), self.seed), engine, node=self.node,
                               gather_on_worker=self._gather_on_worker())
        self.survivors = self._make_survivors(parts, trainer, run, engines, poll_joins=False)
        self.elastic_rounds = ElasticRounds(
            self.session, self.survivors, engines, run=run, rank=self.global_rank,
            world_size=self.world_size, timeout=self.timeout, end_round=self._end_round)
        self.cursor = CursorResume()
        attach(self.elastic_rounds, trainer, self.watched)
        node_retries(self.node, self.survivors.retry)  # a node all-reduce a loss interrupted
        if parts.newcomer:  # the members' topology, from the step they admitted it at
            self.engine = self.elastic_rounds.enter(parts.newcomer.step,
                                                    parts.newcomer.membership.live)
        elif parts.founders:  # the topology over the founders, from step 0
            self.engine = self.elastic_rounds.found(parts.founders.founded)
        self.rebuild_train_loader(trainer)  # through the shared cursor from now on

    def _gather_on_worker(self) -> bool:
        """Whether the communication thread all-gathers sharded rounds on a node group of its
        own (not with NCCL: no progress promised for two threads' communicators)."""
        backend = self.process_group_backend or dist.get_backend()
        return "nccl" not in str(backend)

    def resolve_topology(self, nodes: int, devices: int) -> Topology:
        """The topology gossip follows (:func:`~lightning_gossip.topology.resolve_learners`)."""
        return resolve_learners(self.topology_spec, nodes, devices, self.seed, self.hierarchical)

    @override
    def teardown_gossip(self) -> None:
        """Drop in-flight exchanges and buffers, and stop the communication thread."""
        if self.survivors is not None:
            self.survivors.end()
        if self.engine is not None:
            self.engine.close()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """An elastic fit's training loaders draw from the shared cursor (``dpsgd_elastic``)."""
        rounds, module = self.elastic_rounds, self.lightning_module
        node = self.node.layout if self.node else None  # (hierarchical: the node claims)
        return training_loader(rounds, self.cursor, dataloader, module.trainer, self.seed,
                               node) if rounds is not None and module is not None else dataloader

    # ------------------------------------------------------------------------------------------
    # The step
    # ------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Start this step's exchange (``overlap``), so it runs during forward/backward."""
        # Under gradient accumulation only the first micro-batch starts one (x_t does not
        # change). Elastic: a lost peer is survived; a lone survivor still looks for joins.
        if self.gossip_enabled and (rounds := self.elastic_rounds or self.engine) is not None:
            rounds.before_step(self.step)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The local optimizer step (forward/backward run inside it), then mix as the
        topology's ``W_t`` says; every rank takes part even when AMP skips the step."""
        if not self.gossip_enabled:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            self.step += 1
            return out
        self.check_liveness(self.step)  # elastic: the survivors may go on at another step
        if (rounds := self.elastic_rounds or self.engine) is not None:  # manual optimization
            rounds.before_step(self.step)
        t, engine = self.step, self.engine
        if self.node:
            closure = self.node.wrap(closure)
        # The local step runs whatever happens (also when AMP skips it): every rank must
        # take part in every exchange, or its peers would wait for it.
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.node:
            self.node.average_buffers()
        if self.elastic_rounds is not None:  # a round failed on a loss: the survivors go on
            self.elastic_rounds.finish(t, engine)
        else:
            if engine is not None:
                engine.after_step(t)
            self._end_round(t)
            self.log_period_switches()
        return out

    def _end_round(self, t: int) -> None:
        """Step ``t``'s round is done: count it, then the periodic collectives."""
        self.step = t + 1
        n = self.global_average_every_n_steps
        if n is not None and self.step % n == 0:
            self.global_average()
        self.maybe_log_consensus()

    def global_average(self) -> None:
        """This replica becomes the exact average of all (a collective; rounds stay in flight)."""
        assert self.replicas is not None
        self.replicas.become_average("for the periodic global average", self.outer)

    @override
    def quiesce(self) -> None:
        """Finish in-flight exchanges. Their deltas are applied, so no mixing is lost."""
        if self.engine is not None:
            self.engine.quiesce()

    @property
    def gossip_stats(self) -> dict[str, float]:
        """What this rank's gossip sent in this process: ``sent_bytes`` (replica messages' payload,
        not the node's collectives), ``messages`` and ``exchanges`` (rounds started)."""
        return self._stats.as_dict()
