"""Lightning Fabric strategies: D-PSGD and AD-PSGD for a Fabric loop.

``Fabric(strategy="dpsgd")`` / ``"adpsgd"`` / ``"adpsgd_random"`` after ``import
lightning_gossip``, or the classes with their options. Each strategy is Fabric's own
``DDPStrategy`` (process group, launcher, collectives, samplers) without the DDP wrapper: the
module is set up as it is, and every ``optimizer.step()`` of the Fabric-wrapped optimizer is a
gossip step, driven through the same engines as the Trainer strategies
(:class:`~lightning_gossip.plain_loop.Gossip`). The optimizer step is wrapped in the strategy,
not hooked on the optimizer, so a step that AMP's loss scaler skips is still a gossip step on
every rank.

The loop's sync points (every rank together): ``fabric.strategy.consensus()`` (a block in which
the model holds the exact average of the replicas, for evaluation), ``fabric.strategy.quiesce()``,
``fabric.strategy.average()`` (every replica becomes the average) and
``fabric.strategy.finish()`` (the same, then gossip stops: the end of training).
``fabric.save`` writes the average too: the module's state dict is the consensus (a collective on
every rank, which ``fabric.save`` already is).

``hierarchical=True`` (super-learners, as under the Trainer): the P ranks of a node of
``Fabric(devices=P, num_nodes=N)`` average their gradients over the node in ``fabric.backward``
(after it, or bucket by bucket during it with ``node_allreduce="overlapped"``;
``fabric.no_backward_sync`` skips it for the micro-batches of a gradient accumulation, as under
DDP) and their floating buffers after every optimizer step, and gossip runs between the N
nodes.

``elastic=True`` (``heartbeat_timeout`` on by default): a lost rank does not end the loop; the
survivors go on without it (:mod:`lightning_gossip.elastic.loop`, the recovery of the Trainer
strategies), at the next optimizer step or sync point. ``fabric.barrier``, ``fabric.all_reduce``
and ``fabric.broadcast`` (given no group) then run over the live ranks; ``fabric.barrier`` (also
the one in ``fabric.save``) is a sync point that survives a loss during it, the other two do not
(a loss during one of them fails it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, ClassVar, Literal, get_args

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_gossip import _compat
from lightning_gossip.budget import GossipPeriod, check_gossip_every_n_steps
from lightning_gossip.elastic.loop import check_loop_options, check_no_joins
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.overlapped_allreduce import NodeAllreduce
from lightning_gossip.plain_loop import Gossip, check_gossip_options
from lightning_gossip.topology import Topology

__all__ = ["FabricADPSGDStrategy", "FabricDPSGDStrategy", "FabricGossipStrategy"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class _NodeSync(_compat.backward_sync_control_base()):  # type: ignore[misc]
    """``fabric.no_backward_sync``: the backward calls inside the block skip the node's gradient
    all-reduce of hierarchical gossip (the micro-batches of a gradient accumulation; the last
    backward, outside the block, averages the accumulated gradients). Flat gossip has no
    gradient all-reduce: there the block changes nothing."""

    def __init__(self) -> None:
        #: inside an enabled ``no_backward_sync`` block
        self.blocked = False

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Skip the node's gradient all-reduce inside the block when ``enabled``."""
        return self._blocked() if enabled else nullcontext()

    @contextlib.contextmanager
    def _blocked(self) -> Iterator[None]:
        before, self.blocked = self.blocked, True
        try:
            yield
        finally:
            self.blocked = before


class FabricGossipStrategy(DDPStrategy):
    """Base of the Fabric gossip strategies: one replica per rank, no DDP wrapper.

    Subclasses set :attr:`kind` and pass their options to :class:`Gossip` through
    :meth:`gossip_options`. ``process_group_backend``, ``timeout`` (every gossip wait too) and
    ``start_method`` are Fabric's ``DDPStrategy``'s.
    """

    #: the engine: ``"dpsgd"`` or ``"adpsgd"``
    kind: ClassVar[str] = ""

    def __init__(self, accelerator: Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision: Precision | None = None,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: StartMethod = "popen") -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._backward_sync_control: _NodeSync = _NodeSync()
        #: the attached gossip (after ``fabric.setup(model, ...)``)
        self.gossip: Gossip | None = None

    def gossip_options(self) -> dict[str, Any]:
        """The keywords of :class:`Gossip` (subclasses)."""
        raise NotImplementedError

    def _set_common(self, global_average_every_n_steps: int | None, outer_lr: float | None,
                    outer_momentum: float, outer_nesterov: bool,
                    heartbeat_timeout: float | None, hierarchical: bool = False,
                    node_allreduce: NodeAllreduce = "after_backward",
                    elastic: bool = False, topology: object = "ring",
                    start_timeout: float | None = None) -> None:
        """Keep the options both strategies take (checked here, at construction)."""
        check_no_joins(start_timeout, owner=type(self).__name__)
        if elastic:  # (what an elastic loop cannot do: ValueError naming this class)
            check_loop_options(self.kind, topology=topology, heartbeat_timeout=heartbeat_timeout,
                               hierarchical=hierarchical,
                               global_average_every_n_steps=global_average_every_n_steps,
                               owner=type(self).__name__)
        self.elastic = bool(elastic)
        if node_allreduce not in get_args(NodeAllreduce):
            raise ValueError(f"node_allreduce must be one of {get_args(NodeAllreduce)}, got "
                             f"{node_allreduce!r}")
        if node_allreduce != "after_backward" and not hierarchical:
            raise ValueError(f"node_allreduce={node_allreduce!r} acts on the node's gradient "
                             "all-reduce of hierarchical=True: set hierarchical=True too")
        check_gossip_options(global_average_every_n_steps, outer_lr, outer_momentum,
                             outer_nesterov, heartbeat_timeout)
        self.hierarchical = bool(hierarchical)
        self.node_allreduce = node_allreduce
        self.global_average_every_n_steps = global_average_every_n_steps
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.outer_nesterov = outer_nesterov
        self.heartbeat_timeout = heartbeat_timeout

    def _common_options(self) -> dict[str, Any]:
        return {"global_average_every_n_steps": self.global_average_every_n_steps,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "outer_nesterov": self.outer_nesterov,
                "heartbeat_timeout": self.heartbeat_timeout, "hierarchical": self.hierarchical,
                "elastic": self.elastic}

    @override
    def setup_module(self, module: Module) -> Module:
        """The module as it is (no wrapper): rank 0's weights are broadcast to every replica
        and gossip is attached to it (one model per strategy); ``hierarchical``: over this
        strategy's nodes (``num_nodes`` of ``num_processes``), checked over every rank."""
        if self.gossip is not None:
            raise ValueError(f"{type(self).__name__} gossips one model: fabric.setup was "
                             "called a second time with a model")
        timeout = self._timeout if self._timeout is not None else default_pg_timeout
        layout = (NodeLayout(self.num_nodes, self.num_processes, self.node_rank, self.local_rank)
                  if self.hierarchical else None)
        self.gossip = Gossip(module, None, self.kind, timeout=timeout,
                             backend=self._process_group_backend, layout=layout,
                             node_gradients=self.node_allreduce, **self.gossip_options())
        return module

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Fabric's backward; ``hierarchical``: then the gradients averaged over the node (or
        during it, ``node_allreduce="overlapped"``), except inside ``fabric.no_backward_sync``."""
        node = self.gossip.node if self.gossip is not None else None
        if node is None or self._backward_sync_control.blocked:
            super().backward(tensor, module, *args, **kwargs)
            return
        node.wrap(functools.partial(super().backward, tensor, module, *args, **kwargs))()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The local step (through the precision plugin), then the gossip step."""
        if self.gossip is not None:
            self.gossip.before_step()
        out = super().optimizer_step(optimizer, **kwargs)
        if self.gossip is not None:
            self.gossip.after_step()
        return out

    # -- sync points ---------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Finish every exchange in flight (every rank): collectives are safe until the next
        optimizer step."""
        if self.gossip is not None:
            self.gossip.quiesce()

    @contextlib.contextmanager
    def consensus(self) -> Iterator[None]:
        """A block in which the model holds the exact average of the replicas (every rank
        enters it together); this rank's replica is put back afterwards."""
        if self.gossip is None:
            yield
            return
        with self.gossip.consensus():
            yield

    def average(self) -> None:
        """Every replica becomes the exact average of all replicas (every rank; e.g. at the
        end of training)."""
        if self.gossip is not None:
            self.gossip.become_average()

    def finish(self) -> None:
        """The end of training: every replica becomes the exact average, gossip stops."""
        if self.gossip is not None:
            self.gossip.finish()

    @property
    def gossip_stats(self) -> Any:
        """The engine's counters (``None`` before set-up or with one process)."""
        return self.gossip.stats if self.gossip is not None else None

    # -- Fabric's collectives (elastic: over the live ranks) -------------------------------------
    def _elastic_gossip(self) -> Gossip | None:
        """The attached gossip when it is elastic (``None`` otherwise)."""
        gossip = self.gossip
        return gossip if gossip is not None and gossip.elastic is not None else None

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Fabric's barrier; ``elastic``: a sync point of the live ranks that survives a loss
        (:meth:`Gossip.barrier <lightning_gossip.plain_loop.Gossip.barrier>`)."""
        gossip = self._elastic_gossip()
        if gossip is None:
            super().barrier(*args, **kwargs)
            return
        gossip.barrier()

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None,
                   reduce_op: Any | None = "mean") -> Tensor:
        """Fabric's all-reduce; ``elastic`` with no ``group``: over the live ranks."""
        gossip = self._elastic_gossip()
        if gossip is not None and group is None:
            group = gossip.live_group
        return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Fabric's broadcast; ``elastic``: over the live ranks (``src`` a global rank)."""
        gossip = self._elastic_gossip()
        if gossip is None:
            return super().broadcast(obj, src)
        box = [obj]
        dist.broadcast_object_list(box, src, group=gossip.live_group)
        return box[0]

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The consensus weights (a collective: ``fabric.save`` runs this on every rank)."""
        if self.gossip is None or self.gossip.engine is None:
            return super().get_module_state_dict(module)
        with self.gossip.consensus():
            return {k: v.clone() if isinstance(v, Tensor) else v
                    for k, v in super().get_module_state_dict(module).items()}

    @override
    def teardown(self) -> None:
        """Stop gossip, then Fabric's teardown."""
        if self.gossip is not None:
            self.gossip.close()
        super().teardown()


class FabricDPSGDStrategy(FabricGossipStrategy):
    """D-PSGD for Fabric: ``x_{t+1} = W_t x_t - lr g_t`` with ``W_t`` of ``topology``.

    Args:
        topology: a topology name (``lightning-gossip topologies``; default ``"ring"``) or a
            :class:`~lightning_gossip.topology.Topology`.
        seed: the seed of random topologies.
        overlap: post each round before the local step and add its change after it
            (``False``: exchange the stepped weights, blocking).
        delay_by_one: add each round's change one step later (hides it behind a whole step).
        wire_dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        gossip_every_n_steps: optimizer steps per exchange (default 1): only every n-th step
            exchanges; its round is posted at the period's first step and hides behind all of
            its steps (``docs/strategies.md``, Communication budget);
            ``"auto"`` (or an :class:`~lightning_gossip.gossip_period.AutoPeriod`): picked from
            the measured compute and exchange times, the same on every rank.
        global_average_every_n_steps: every n-th optimizer step ends with the exact average of
            all replicas (``None``: never).
        outer_lr, outer_momentum, outer_nesterov: an outer (Nesterov) momentum step at that
            periodic average (``lightning_gossip.outer``; ``None``: the plain average).
        heartbeat_timeout: seconds without a peer's heartbeat after which a wait on it fails
            naming it (``PeerSilent``; default 60, as the Trainer strategies; ``None``: off).
        hierarchical: the ranks of a node (``Fabric(devices=P, num_nodes=N)``) are one learner:
            gradients averaged over the node in ``fabric.backward``, floating buffers after
            every step (its ranks hold bit-identical replicas), and gossip between the nodes,
            ``topology`` over the N nodes; local rank ``l`` exchanges slice ``l`` of the replica
            with local rank ``l`` of the peer nodes. One node: plain data parallelism (with a
            warning).
        node_allreduce: ``hierarchical``: the node's gradient all-reduce after backward
            (``"after_backward"``, default) or bucket by bucket during it (``"overlapped"``).
        elastic: survive lost ranks: the survivors go on without them, the topology (a name)
            rebuilt over them from a step they agree on (``docs/fabric.md``, Elastic;
            :mod:`lightning_gossip.elastic.loop`). Not with ``hierarchical``,
            ``global_average_every_n_steps`` or ``gossip_every_n_steps`` other than 1.
        start_timeout: refused (``ValueError`` unless ``None``): no process joins a Fabric loop
            (the Trainer strategies offer joins and a start with the ranks that came).
        process_group_backend, timeout, start_method: Fabric's ``DDPStrategy``'s.

    Every rank must take the same number of optimizer steps between sync points (``elastic``:
    the same number of loop iterations; after a loss the ranks settle on one step at every
    sync point).
    """

    kind = "dpsgd"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"dpsgd"`` in Fabric's strategy registry."""
        strategy_registry.register("dpsgd", cls, override=True,
                                   description="Decentralized parallel SGD (D-PSGD), ring")

    def __init__(self, accelerator: Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision: Precision | None = None,
                 *, topology: str | Topology = "ring", seed: int = 0, overlap: bool = True,
                 delay_by_one: bool = False, wire_dtype: str = "fp32",
                 gossip_every_n_steps: GossipPeriod = 1,
                 global_average_every_n_steps: int | None = None,
                 outer_lr: float | None = None, outer_momentum: float = 0.0,
                 outer_nesterov: bool = True, heartbeat_timeout: float | None = 60.0,
                 hierarchical: bool = False, node_allreduce: NodeAllreduce = "after_backward",
                 elastic: bool = False, start_timeout: float | None = None,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: StartMethod = "popen") -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io,
                         precision, process_group_backend, timeout, start_method)
        self._set_common(global_average_every_n_steps, outer_lr, outer_momentum,
                         outer_nesterov, heartbeat_timeout, hierarchical, node_allreduce,
                         elastic, topology, start_timeout)
        self.topology = topology
        self.seed = int(seed)
        self.overlap = bool(overlap)
        self.delay_by_one = bool(delay_by_one)
        self.wire_dtype = wire_dtype
        self.gossip_every_n_steps = check_gossip_every_n_steps(
            gossip_every_n_steps, elastic=self.elastic, owner=type(self).__name__)

    @override
    def gossip_options(self) -> dict[str, Any]:
        """``topology``, ``seed``, ``overlap``, ``delay_by_one``, ``wire_dtype``,
        ``gossip_every_n_steps``, the periodic average's, outer optimizer's and heartbeat's
        options, ``hierarchical`` and ``elastic``."""
        return {"topology": self.topology, "seed": self.seed, "overlap": self.overlap,
                "delay_by_one": self.delay_by_one, "wire_dtype": self.wire_dtype,
                "gossip_every_n_steps": self.gossip_every_n_steps, **self._common_options()}


class FabricADPSGDStrategy(FabricGossipStrategy):
    """AD-PSGD for Fabric: pairwise averages in a background thread, never waiting for them
    (except for the ``max_staleness`` bound).

    Args:
        pairing: ``"ring"`` (default) or ``"random"``.
        seed: the seed of the random pairing.
        max_staleness: the training thread waits while more than this many of its steps are
            not yet gossiped (``None``: never).
        delay_by_one: apply each exchange's delta one step later.
        wire_dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        gossip_every_n_steps: optimizer steps per exchange (default 1): an active rank starts
            an exchange at most once every n steps; ``max_staleness`` then counts exchanges
            (``docs/strategies.md``, Communication budget);
            ``"auto"`` (or an :class:`~lightning_gossip.gossip_period.AutoPeriod`): each rank
            picks it from its measured compute and exchange times.
        global_average_every_n_steps: every n-th optimizer step ends with the exact average of
            all replicas, a sync point (``None``: never); then every rank must take the same
            number of steps.
        outer_lr, outer_momentum, outer_nesterov: an outer (Nesterov) momentum step at that
            periodic average (``lightning_gossip.outer``; ``None``: the plain average).
        heartbeat_timeout: seconds without a peer's heartbeat after which a wait on it fails
            naming it (``PeerSilent``; default 60, as the Trainer strategies; ``None``: off).
        hierarchical: the ranks of a node (``Fabric(devices=P, num_nodes=N)``) are one learner
            (H-ADPSGD): gradients averaged over the node in ``fabric.backward``, floating
            buffers after every step, and AD-PSGD between the nodes, ``pairing`` over the N
            nodes; local rank ``l`` gossips slice ``l`` of the replica with local rank ``l`` of
            the partner node, and the node's ranks add the same gathered deltas every step.
            The node's ranks step together. One node: plain data parallelism (with a warning).
        node_allreduce: ``hierarchical``: the node's gradient all-reduce after backward
            (``"after_backward"``, default) or bucket by bucket during it (``"overlapped"``).
        elastic: survive lost ranks: the survivors go on without them, ``pairing`` over them
            (``docs/fabric.md``, Elastic; :mod:`lightning_gossip.elastic.loop`). Not with
            ``hierarchical``, ``global_average_every_n_steps`` or ``gossip_every_n_steps``
            other than 1.
        start_timeout: refused (``ValueError`` unless ``None``): no process joins a Fabric loop
            (the Trainer strategies offer joins and a start with the ranks that came).
        process_group_backend, timeout, start_method: Fabric's ``DDPStrategy``'s.

    Ranks may take different numbers of steps (hierarchical: nodes; the ranks of one node take
    the same); a phase of gossip opens at the first step after a sync point (after a meeting of
    all ranks) and ends at the next sync point.
    """

    kind = "adpsgd"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"adpsgd"`` (ring) and ``"adpsgd_random"`` in Fabric's registry."""
        strategy_registry.register("adpsgd", cls, override=True,
                                   description="Asynchronous decentralized parallel SGD "
                                               "(AD-PSGD), ring peer choice")
        strategy_registry.register("adpsgd_random", cls, override=True, pairing="random",
                                   description="Asynchronous decentralized parallel SGD "
                                               "(AD-PSGD), random peer choice")

    def __init__(self, accelerator: Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision: Precision | None = None,
                 *, pairing: str = "ring", seed: int = 0, max_staleness: int | None = 4,
                 delay_by_one: bool = False, wire_dtype: str = "fp32",
                 gossip_every_n_steps: GossipPeriod = 1,
                 global_average_every_n_steps: int | None = None,
                 outer_lr: float | None = None, outer_momentum: float = 0.0,
                 outer_nesterov: bool = True, heartbeat_timeout: float | None = 60.0,
                 hierarchical: bool = False, node_allreduce: NodeAllreduce = "after_backward",
                 elastic: bool = False, start_timeout: float | None = None,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: StartMethod = "popen") -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io,
                         precision, process_group_backend, timeout, start_method)
        self._set_common(global_average_every_n_steps, outer_lr, outer_momentum,
                         outer_nesterov, heartbeat_timeout, hierarchical, node_allreduce,
                         elastic, start_timeout=start_timeout)
        self.pairing = pairing
        self.seed = int(seed)
        self.max_staleness = max_staleness
        self.delay_by_one = bool(delay_by_one)
        self.wire_dtype = wire_dtype
        self.gossip_every_n_steps = check_gossip_every_n_steps(
            gossip_every_n_steps, elastic=self.elastic, owner=type(self).__name__)

    @override
    def gossip_options(self) -> dict[str, Any]:
        """``pairing``, ``seed``, ``max_staleness``, ``delay_by_one``, ``wire_dtype``,
        ``gossip_every_n_steps``, the periodic average's, outer optimizer's and heartbeat's
        options, ``hierarchical`` and ``elastic``."""
        return {"pairing": self.pairing, "seed": self.seed,
                "max_staleness": self.max_staleness, "delay_by_one": self.delay_by_one,
                "wire_dtype": self.wire_dtype,
                "gossip_every_n_steps": self.gossip_every_n_steps, **self._common_options()}
