"""Lightning glue shared by the gossip strategies.

:class:`GossipStrategy` does what every decentralized strategy needs and nothing
algorithm-specific: process-group set-up, one replica per rank without a DDP wrapper, the
initial broadcast and the replica-shape check, consensus weights for evaluation and
checkpoints, the final average, and consensus-distance logging. Subclasses implement
:meth:`GossipStrategy.optimizer_step` (how replicas are mixed around a local step) and may
override :meth:`GossipStrategy.quiesce` (how to quiet the network before a sync point).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from functools import partial
from typing import Any, ClassVar

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_gossip import _compat
from lightning_gossip.agreement import check_agreement, plain_repr
from lightning_gossip.budget import auto_period
from lightning_gossip.compression import WireDtype, check_wire_dtype
from lightning_gossip.consensus import check_every
from lightning_gossip.elastic.newcomer import MembersSide
from lightning_gossip.elastic.parts import ElasticParts
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.elastic.survivors import Engines, Survivors
from lightning_gossip.flat import FlatState, flatten_module_
from lightning_gossip.gossip_period.auto import PeriodDriver
from lightning_gossip.hierarchy import NodeGroups, NodeLayout
from lightning_gossip.node_averaging import NodeAverager
from lightning_gossip.overlapped_allreduce import NodeAllreduce
from lightning_gossip.replicas import CONSENSUS_METRIC as CONSENSUS_METRIC
from lightning_gossip.replicas import Replicas
from lightning_gossip.strategies.collectives import sync_metrics_over
from lightning_gossip.strategies.fit import Fit
from lightning_gossip.strategies.options import EVALUATE_CHOICES as EVALUATE_CHOICES
from lightning_gossip.strategies.options import Backend, Evaluate, check_options, check_remedies
from lightning_gossip.strategies.parallel import ProcessGroupStrategy
from lightning_gossip.strategies.resilience import Resilience

log = logging.getLogger(__name__)

#: the metric of the period ``gossip_every_n_steps="auto"`` picked (logged at each decision)
PERIOD_METRIC = "gossip/period"


def members_checkpoint(replicas: Replicas, trainer: pl.Trainer, average: Tensor) -> dict[str, Any]:
    """The full Lightning checkpoint of ``trainer`` with ``average`` as the weights: what the
    lowest member of an elastic fit hands a newcomer (no collective: only this member is
    here)."""
    with replicas.weights_as_is(average):
        return _compat.dump_checkpoint(trainer)


class GossipStrategy(ProcessGroupStrategy):
    """Base class of the decentralized strategies: one replica per rank, mixed by gossip.

    It owns its parts: :attr:`replicas` (:class:`~lightning_gossip.replicas.Replicas`, after
    set-up), :attr:`resilience` (:class:`~.resilience.Resilience`: stops, requeues, emergency
    checkpoints), :attr:`node` (:class:`~.node_averaging.NodeAverager`, ``None`` when flat) and
    the subclass's ``engine``; Lightning's hooks here delegate to them.

    Args:
        seed, delay_by_one, hierarchical, global_average_every_n_steps, wire_dtype, outer_lr,
            outer_momentum, outer_nesterov, node_allreduce: the options both strategies take,
            described with each (checked and stored here, once).
        final_average: at the end of ``fit`` replace every replica by the exact average of all
            replicas (one all-reduce), so every rank holds the same model.
        evaluate: ``"consensus"`` (default) runs validation and test on the average of the
            replicas, restoring the local replicas afterwards; ``"local"`` evaluates each rank's
            own replica (metrics logged with ``sync_dist=True`` are then averaged over ranks).
        consensus_every_n_steps: log ``gossip/consensus_distance`` every this many optimizer
            steps (one all-reduce of the model each time); ``None`` disables it.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: limit for every blocking wait (process-group set-up and gossip).
        heartbeat_timeout: seconds without a heartbeat after which a peer that this rank waits
            for counts as frozen, killed or cut off: the wait fails naming it (see
            ``docs/faults.md``). ``None`` disables the heartbeat (waits then end only at
            ``timeout``).
    """

    #: The constructor options every rank must give alike, compared at set-up by
    #: :meth:`gossip_config` (with the strategy, the world and node sizes, the backend and the
    #: timeout). Each subclass lists its own; an attribute not listed here is never compared.
    AGREED_OPTIONS: ClassVar[tuple[str, ...]] = (
        "final_average", "evaluate", "consensus_every_n_steps", "heartbeat_timeout", "seed",
        "delay_by_one", "hierarchical", "global_average_every_n_steps", "wire_dtype", "outer",
        "node_allreduce")

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        seed: int = 0,
        delay_by_one: bool = False,
        hierarchical: bool = False,
        global_average_every_n_steps: int | None = None,
        wire_dtype: WireDtype = "fp32",
        outer_lr: float | None = None, outer_momentum: float = 0.0, outer_nesterov: bool = True,
        node_allreduce: NodeAllreduce = "after_backward",
        final_average: bool = True,
        evaluate: Evaluate = "consensus",
        consensus_every_n_steps: int | None = 100,
        process_group_backend: Backend | None = None,
        timeout: timedelta | float = default_pg_timeout,
        heartbeat_timeout: float | None = 60.0,
    ) -> None:
        timeout = check_options(evaluate=evaluate, consensus_every_n_steps=consensus_every_n_steps,
                                process_group_backend=process_group_backend, timeout=timeout,
                                heartbeat_timeout=heartbeat_timeout)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io,
                         precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, heartbeat_timeout=heartbeat_timeout)
        self.seed, self.hierarchical = int(seed), bool(hierarchical)
        self.delay_by_one = bool(delay_by_one)
        self.global_average_every_n_steps = check_every(
            "global_average_every_n_steps", global_average_every_n_steps)
        self._wire, self.wire_dtype = check_wire_dtype(wire_dtype), wire_dtype
        #: the outer optimizer of the periodic global average (:mod:`lightning_gossip.outer`)
        self.outer = check_remedies(outer_lr, outer_momentum, outer_nesterov, node_allreduce,
                                    self.global_average_every_n_steps, self.hierarchical)
        self.node_allreduce = node_allreduce
        self.final_average = bool(final_average)
        self.evaluate = evaluate
        self.consensus_every_n_steps = consensus_every_n_steps
        #: averaging inside the node (hierarchical gossip, after set-up); ``None`` when flat
        self.node: NodeAverager | None = None
        self._flat: FlatState | None = None
        #: flat storage (docs/architecture.md): at set-up, move the replica's parameters and
        #: floating buffers into one buffer per dtype (``flatten_module_``); ``False`` keeps
        #: them where they are (same results, per-tensor copies in every gossip step)
        self._flat_storage = True
        #: the replicas of every rank (:class:`~lightning_gossip.replicas.Replicas`, built at
        #: set-up)
        self.replicas: Replicas | None = None
        #: what the parts read when they act: the step, the engine and (elastic) the live
        #: ranks' groups (:class:`~lightning_gossip.elastic.session.ElasticSession`)
        self.session = ElasticSession()
        #: stops, requeues and emergency checkpoints (:class:`~.resilience.Resilience`)
        self.resilience: Resilience = self._make_resilience()
        #: the last measured consensus distance (``None`` before the first measurement)
        self.last_consensus_distance: float | None = None
        #: ``gossip_every_n_steps="auto"``: this fit's period driver (after set-up; ``None``
        #: with a fixed period); its ``switches`` are the decisions and where they took effect
        self.auto_period: PeriodDriver | None = None
        self._switches_logged = 0

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (the ``t`` of the mixing matrix ``W_t``): the
        session's."""
        return self.session.step

    @step.setter
    def step(self, step: int) -> None:
        self.session.move_to(step)

    @property
    def engine(self) -> Any:
        """The fit's gossip engine, the session's (``None``: none yet, or nothing to gossip
        with)."""
        return self.session.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.session.swap_engine(engine)

    def gossip_config(self) -> dict[str, Any]:
        """This rank's gossip configuration, compared between ranks at set-up
        (:func:`~lightning_gossip.agreement.check_agreement`): the options named in
        :attr:`AGREED_OPTIONS` (plain values as they are, others by their ``repr``), plus the
        strategy, world and node sizes, the backend and the timeout."""
        config: dict[str, Any] = {
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "processes_per_node": self.num_processes,
            "process_group_backend": self.process_group_backend,
            "timeout_s": self.timeout.total_seconds(),
        }
        for name in self.AGREED_OPTIONS:
            value = getattr(self, name)
            plain = value is None or isinstance(value, (bool, int, float, str))
            config[name] = value if plain else plain_repr(value)
        return config

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Move the model to its device, put its parameters and floating buffers into flat
        storage (:func:`~lightning_gossip.flat.flatten_module_`, before the optimizers are
        created; with more than one process), check the replicas match, broadcast rank 0's
        initial weights and start gossip (the last two when fitting)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = _compat.layer_sync(self)
        if fitting and layer_sync:
            self.model = layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._flat_storage and self.world_size > 1:
            # before the optimizers: they see the same Parameters, now views of the buffers
            flatten_module_(self.lightning_module)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        self._flat = FlatState(self.lightning_module)
        self.replicas = Replicas(self._flat, self.global_rank, self.world_size, self._timeout,
                                 self.watched, session=self.session)
        if self.world_size == 1:
            rank_zero_warn(
                f"{type(self).__name__} is running with a single process: it trains locally "
                "without gossip."
            )
            return
        if not self.joined:  # a newcomer to a running fit: the others did this at their start
            check_agreement(self.gossip_config(), self.global_rank, self.world_size)
            self.replicas.check_match()
        if fitting:
            if not self.joined:
                self.replicas.broadcast_initial()
            if self.outer is not None:  # the anchor: where every replica starts (or resumed)
                self.outer.start(self._flat.pack())
            self.setup_gossip(trainer)
            self.begin_fit(Fit(trainer, self.global_rank, self.world_size, self.root_device,
                               self.replicas, self.heartbeat, self.checkpoint_io, self.session,
                               node=self.node, survivors=self.survivors, outer=self.outer,
                               part_states=self.with_part_states))

    def begin_fit(self, fit: Fit) -> None:
        """Give the parts this fit's values (after :meth:`setup_gossip`; subclasses add their
        engine): the resilience also puts the SIGTERM check of its own in place (no per-batch
        collective)."""
        self.resilience.begin_fit(fit)

    def setup_gossip(self, trainer: pl.Trainer) -> None:
        """Create the subclass's process groups, buffers and threads (once per fit)."""

    @override
    def teardown(self) -> None:
        """Stop gossip and the heartbeat, end the fit's parts, then Lightning's own teardown."""
        self.teardown_gossip()
        self.stop_heartbeat()
        self.resilience.end_fit()
        super().teardown()

    def _make_resilience(self) -> Resilience:  # DPSGDStrategy: AgreedStops
        return Resilience(**self._resilience_callables())

    def _resilience_callables(self) -> dict[str, Any]:
        """What :class:`~.resilience.Resilience` is built from: small callables (the step
        comes with each fit's session)."""
        return {"watched": self.watched,
                "stop_gossip": self.teardown_gossip, "stop_heartbeat": self.stop_heartbeat,
                "restart_position": self.with_restart_position}

    def teardown_gossip(self) -> None:
        """Stop the subclass's background work (idempotent)."""

    def _make_survivors(self, parts: ElasticParts, trainer: pl.Trainer, run: str,
                        engines: Engines, *, poll_joins: bool = True,
                        node: NodeAverager | None = None) -> Survivors:
        """An elastic fit's :class:`~lightning_gossip.elastic.survivors.Survivors` (both
        strategies; ``parts``: the strategy's :class:`~lightning_gossip.elastic.parts.
        ElasticParts`; ``run``: the fit's name; ``engines``: their engines): Lightning's side of
        a loss or a join given as values: the trainer's epoch, rank 0's loggers, the module's
        metrics gathered over the new group, and the lowest member's checkpoint for a newcomer
        (with the members' exact average as its weights)."""
        assert self._flat is not None and self.replicas is not None
        hand_over = MembersSide(self.session, self._flat.pack,
                                partial(members_checkpoint, self.replicas, trainer), self.timeout)
        return parts.survivors(
            self.session, run=run, rank=self.global_rank, world_size=self.world_size,
            heartbeat=self.heartbeat, backend=self.process_group_backend or "gloo",
            engines=engines, epoch=lambda: trainer.current_epoch,
            loggers=trainer.loggers if self.is_global_zero else [], hand_over=hand_over,
            on_group=lambda group: sync_metrics_over(trainer.lightning_module, group),
            poll_joins=poll_joins, node=node)

    def _node_averager(self, layout: NodeLayout | None, groups: NodeGroups | None
                       ) -> NodeAverager:
        """The node's :class:`~.node_averaging.NodeAverager` (hierarchical, after set-up made
        ``layout`` and ``groups``)."""
        assert groups is not None and layout is not None and self._flat is not None
        return NodeAverager(self.lightning_module, self._flat, layout, groups.node, self.timeout,
                            self.heartbeat, step=self.session.current_step,
                            overlap=self.node_allreduce == "overlapped")

    def _warn_one_node(self) -> None:
        """``hierarchical=True`` on one node of several processes: nothing to gossip with."""
        rank_zero_warn(
            f"{type(self).__name__}(hierarchical=True) on one node of {self.num_processes} "
            "processes: gradients are averaged inside the node and there is nothing to gossip "
            "with (plain data parallelism).")

    def quiesce(self) -> None:
        """Finish all in-flight gossip so the replicas are stable (subclasses override)."""

    # -- stops and requeues: strategy.resilience (resilience.py) --
    @override
    def on_exception(self, exception: BaseException) -> None:
        """This rank failed: :meth:`Resilience.on_exception <.resilience.Resilience.on_exception>`
        (a quiet stop, or the emergency checkpoint and a loud one)."""
        self.resilience.on_exception(exception)

    # -- sync points: quiet the network, then use the average (strategy.replicas) --
    def average_replicas(self, why: str = "") -> Tensor:
        """The exact average of all replicas as a flat fp32 vector (a collective, watched like
        every sync point: a silent rank is named). ``why`` completes error messages."""
        assert self.replicas is not None
        return self.replicas.average(why)

    @override
    def on_train_start(self) -> None:
        """Resume the step counter ``t`` from the trainer's global step (a newcomer: the step
        its members admitted it at; their rounds may outnumber their steps)."""
        self.step = self.step if self.joined else self.lightning_module.trainer.global_step

    @override
    def on_train_end(self) -> None:
        """Quiet the network, replace every replica by the exact average (``final_average``)
        and stop gossip."""
        if self.gossip_enabled and self.replicas is not None:
            self.quiesce()
            if self.final_average:
                self.replicas.become_average("at the end of training")
        self.teardown_gossip()

    @override
    def on_validation_start(self) -> None:
        """Quiet the network; with ``evaluate="consensus"`` evaluate the average replica."""
        self._swap_in_consensus()

    @override
    def on_validation_end(self) -> None:
        """Put the local replica back."""
        if self.replicas is not None:
            self.replicas.restore_local()

    @override
    def on_test_start(self) -> None:
        """Quiet the network; with ``evaluate="consensus"`` test the average replica."""
        self._swap_in_consensus()

    @override
    def on_test_end(self) -> None:
        """Put the local replica back."""
        if self.replicas is not None:
            self.replicas.restore_local()

    def _swap_in_consensus(self) -> None:
        if not self.gossip_enabled or self.replicas is None:
            return
        self.quiesce()
        if self.evaluate == "consensus":
            self.replicas.swap_in_consensus()

    def with_restart_position(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` plus the data position a restart needs (``adpsgd``: its cursor)."""
        return checkpoint

    @override
    def checkpoint_parts(self) -> dict[str, Any]:
        """The outer optimizer (its anchor and momentum), when there is one."""
        return {self.outer.CHECKPOINT_KEY: self.outer} if self.outer is not None else {}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The consensus (rank-averaged) weights; live replicas are untouched.

        Lightning calls this on every rank before rank 0 writes a checkpoint, so the average
        is a collective here and every rank resumes from the same weights.
        """
        module = self.lightning_module
        assert module is not None
        state = module.state_dict()
        replicas = self.replicas
        if not self.gossip_enabled or replicas is None or replicas.holds_consensus:
            return state  # held: evaluation, or Replicas.weights_as_is, already swapped them in
        self.quiesce()
        return replicas.consensus_state_dict(module, state)

    # -- gossip_every_n_steps="auto" --
    def _period_driver(self, agree: bool) -> PeriodDriver | None:
        """This fit's :class:`~lightning_gossip.gossip_period.auto.PeriodDriver` for
        ``gossip_every_n_steps="auto"`` (``None`` for a fixed period): its all-reduce
        (``agree``, dpsgd) runs on the training thread's group of Lightning's collectives,
        never on the engine's own."""
        settings = auto_period(getattr(self, "gossip_every_n_steps", 1))
        self._switches_logged = 0
        if settings is None:
            return None
        return PeriodDriver(settings, agree=agree, rank=self.global_rank, timeout=self.timeout,
                            group=self.live_group, device=self.root_device,
                            heartbeat=self.heartbeat)

    def log_period_switches(self) -> None:
        """Log the period decisions taken since the last call as metrics (rank 0, at step =
        optimizer steps done): ``gossip/period``, ``gossip/comm_compute_ratio`` (R),
        ``gossip/compute_ms`` and ``gossip/exchange_ms`` (the values the policy was given), and
        ``gossip/peer_wait_ms``, rank 0's mean wait per exchange for peers that posted it later
        (kept out of the exchange time; ``PeriodSwitch.local_peer_wait_s``).
        Each rank's driver logs the decision's line on Python's ``logging`` too."""
        driver = self.auto_period
        if driver is None or len(driver.switches) <= self._switches_logged:
            return
        new, self._switches_logged = driver.switches[self._switches_logged:], len(driver.switches)
        if not self.is_global_zero:
            return
        for switch in new:
            d = switch.decision
            metrics = {PERIOD_METRIC: float(d.period), "gossip/comm_compute_ratio": d.ratio,
                       "gossip/compute_ms": d.compute_s * 1e3,
                       "gossip/exchange_ms": d.exchange_s * 1e3,
                       "gossip/peer_wait_ms": switch.local_peer_wait_s * 1e3}
            for logger in self.lightning_module.trainer.loggers:
                logger.log_metrics(metrics, step=self.step)

    # -- the consensus distance --
    def maybe_log_consensus(self) -> None:
        """Measure and log the consensus distance when this step is due (a collective)."""
        n = self.consensus_every_n_steps
        if n is None or not self.gossip_enabled or self.step % n != 0:
            return
        self.log_consensus_distance()

    def log_consensus_distance(self) -> float:
        """Measure the consensus distance now (a collective); rank 0 logs it at step = optimizer
        steps done. Also stored in :attr:`last_consensus_distance`."""
        assert self.replicas is not None
        value = self.replicas.distance(self.step)
        self.last_consensus_distance = value
        if self.is_global_zero and np.isfinite(value):
            for logger in self.lightning_module.trainer.loggers:
                logger.log_metrics({CONSENSUS_METRIC: value}, step=self.step)
        return value
