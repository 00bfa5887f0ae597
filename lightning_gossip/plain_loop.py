"""Gossip for a plain PyTorch loop in one call: :func:`attach`.

``attach(model, optimizer, strategy="adpsgd")`` builds everything the engines need (the replica
as one vector, the engine's own process groups, the topology or pairing), broadcasts rank 0's
weights, starts the engine and registers two hooks on the optimizer
(``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``, the way torchft's
``LocalSGD`` attaches), so the loop itself changes by at most three lines::

    gossip = lightning_gossip.attach(model, optimizer, strategy="adpsgd")   # 1: start
    for x, y in loader:                                                      # unchanged
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
    gossip.finish()                  # 2: every rank now holds the exact average of the replicas

Mid-training evaluation of the average (a sync point every rank reaches)::

    with gossip.consensus():         # the exact average swapped in, the replica restored after
        evaluate(model)

Every rank must call the same sequence: :func:`attach`, the same number of optimizer steps
between two sync points for ``"dpsgd"`` (any number for ``"adpsgd"``), and the sync points
(:meth:`Gossip.consensus`, :meth:`Gossip.quiesce`, :meth:`Gossip.finish`) together. With
``global_average_every_n_steps=n`` every n-th optimizer step is a sync point too (the exact
average of all replicas, or with ``outer_lr`` the outer optimizer's step from it), so then
every rank takes the same number of steps under ``"adpsgd"`` as well.

With ``heartbeat_timeout`` (seconds) every rank beats in the rendezvous store from a thread of
its own and every gossip wait watches the peers' beats: a frozen or killed peer is named by a
:class:`~lightning_gossip.errors.PeerSilent` within about that time instead of the ``timeout``
(docs/faults.md). ``Gossip.state_dict()`` holds the step count and the outer optimizer's
state, so ``fabric.save(path, {"model": model, "optimizer": optimizer, "gossip": gossip})``
and ``fabric.load`` carry them across a restart.

What the hooks do: before ``optimizer.step()`` the engine's ``before_step(t)`` (D-PSGD:
snapshot ``x_t`` and post the round; AD-PSGD: open a gossip phase after a meeting of all ranks
if none is open), after it ``after_step(t)`` (mix / apply the peers' deltas). The gradient was
computed at ``x_t``, so the D-PSGD round posted at the pre-step hook mixes exactly what
``DPSGDStrategy`` mixes; only the overlap is shorter (``delay_by_one=True`` hides a round behind
a whole step). An optimizer step that is skipped (``torch.amp.GradScaler`` after an overflow)
runs no hook, so under ``"dpsgd"`` a skipped step on one rank only leaves the ranks a round
apart: use the Trainer or Fabric strategies with fp16 loss scaling.

Hierarchical gossip (``hierarchical=True``, super-learners): the ranks of a node act as one
learner and gossip runs between nodes, as under the Trainer strategies: the pre-step hook first
averages the gradients over the node (one all-reduce on the node's group), the post-step hook
averages the floating buffers over it, so the node's ranks hold bit-identical replicas; the
engine then mixes the node replicas, local rank ``l`` exchanging slice ``l`` with local rank
``l`` of the peer nodes. The layout comes from torchrun's environment (``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``LOCAL_RANK``) or from ``layout=``, and is checked over every rank.

Elastic gossip (``elastic=True``, with a ``heartbeat_timeout``): a rank that is lost (killed,
frozen past the heartbeat timeout, cut off) does not end the loop; the survivors go on
without it, as the Trainer strategies' survivors do (:mod:`lightning_gossip.elastic.loop`).
They find the loss at a step boundary (the hooks) or at a sync point, agree on the live ranks
in the rendezvous store, build new groups over them and a new engine (``dpsgd``: the
topology, by its name, over the survivors; ``adpsgd``: the pairing over them), and the loop's
next ``optimizer.step()`` gossips among them; sync points average over the live ranks
(:attr:`Gossip.live`). Rank 0 warns, naming the lost ranks and the step. Limits: the rank that
hosts the rendezvous store must live (rank 0 unless torchrun's agent hosts it), and every
rank must be started so that the others survive its loss (one process per launcher task, or
one torchrun agent per rank: torchrun's agent stops every worker it started when one dies);
the lost rank's data is not trained by the others; no process joins a running loop (the
Trainer strategies offer joins); the user's own collectives run on :attr:`Gossip.live_group`.

This module imports no Lightning.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gossip import _compat
from lightning_gossip.async_gossip import AsyncGossip
from lightning_gossip.budget import (
    GossipPeriod,
    auto_period,
    check_gossip_every_n_steps,
    resolve_gossip_every_n_steps,
)
from lightning_gossip.compression import check_wire_dtype
from lightning_gossip.consensus import all_average, check_every
from lightning_gossip.elastic.engines import PairwiseEngines
from lightning_gossip.elastic.loop import (
    ElasticLoop,
    check_loop_options,
    check_no_joins,
    next_run,
)
from lightning_gossip.elastic.nodes import ElasticGroups
from lightning_gossip.elastic.rounds import RoundEngines
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.flat import FlatState
from lightning_gossip.gossip_period.auto import PeriodDriver
from lightning_gossip.hierarchy import NodeGroups, NodeLayout, make_async_groups, make_node_groups
from lightning_gossip.liveness import Heartbeat, watched_collective
from lightning_gossip.node_averaging import NodeAverager, node_layout
from lightning_gossip.outer import OuterOptimizer, check_outer
from lightning_gossip.pairing import ColumnPairing, Pairing
from lightning_gossip.sync_gossip import SyncGossip, SyncStats
from lightning_gossip.topology import Topology, build, resolve_learners

__all__ = ["NODE_GRADIENTS", "STRATEGIES", "Gossip", "attach"]

#: the names :func:`attach` accepts
STRATEGIES = ("dpsgd", "adpsgd")
#: ``node_gradients``: where the node's gradient all-reduce of hierarchical gossip runs
NODE_GRADIENTS = ("at_step", "after_backward", "overlapped")


class Gossip:
    """Gossip attached to one model and (optionally) its optimizer; built by :func:`attach`.

    Args:
        model: the replica (every parameter and floating buffer is gossiped).
        optimizer: the optimizer whose steps are the gossip steps; ``None`` registers no hooks
            (the owner calls :meth:`before_step` / :meth:`after_step` itself, as the Fabric
            strategies do).
        strategy: ``"dpsgd"`` (synchronous, every rank steps the same number of times) or
            ``"adpsgd"`` (asynchronous pairwise averages in a background thread).
        topology: ``"dpsgd"``: a topology name (``lightning-gossip topologies``) or a
            :class:`~lightning_gossip.topology.Topology`.
        pairing: ``"adpsgd"``: ``"ring"`` or ``"random"``.
        seed: the seed of random topologies and pairings (the same on every rank).
        max_staleness: ``"adpsgd"``: the training thread waits while more than this many of its
            steps (exchanges, with ``gossip_every_n_steps``) are not yet gossiped (``None``:
            never).
        overlap: ``"dpsgd"``: post the round at the pre-step hook and add its change after the
            step (``False``: exchange the stepped weights, blocking).
        delay_by_one: apply each round's (exchange's) change one step later, so it hides behind
            a whole step.
        wire_dtype: what is sent: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        gossip_every_n_steps: optimizer steps per exchange (default 1): ``"dpsgd"`` exchanges
            at every n-th step only (a round posted at the pre-step hook of a period's first
            step hides behind all of its steps); an ``"adpsgd"`` active rank starts an exchange
            at most once every n steps (``docs/strategies.md``, Communication budget).
            ``"auto"`` (or its settings, an :class:`~lightning_gossip.gossip_period.AutoPeriod`)
            starts at 1 and picks the period from the measured compute and exchange times
            (:attr:`auto`; ``"dpsgd"`` agrees on it with one all-reduce on the meeting group).
        timeout: limit of every blocking wait (seconds or a ``timedelta``).
        backend: the backend of the engine's data group; default ``"nccl"`` for CUDA models,
            ``"gloo"`` otherwise.
        broadcast: start every replica from rank 0's weights (one broadcast now).
        global_average_every_n_steps: every n-th optimizer step ends with the exact average of
            all replicas on every rank (a sync point; ``None``: never).
        outer_lr: an outer optimizer on that periodic average (SlowMo / DiLoCo,
            :class:`~lightning_gossip.outer.OuterOptimizer`): each global average moves the
            replicas from the previous one by ``outer_lr`` times the (momentum of the) move of
            the average; ``outer_lr=1, outer_momentum=0`` is the plain average bit for bit.
            Needs ``global_average_every_n_steps``.
        outer_momentum: the outer momentum in ``[0, 1)``.
        outer_nesterov: Nesterov outer momentum (default) or heavy ball.
        heartbeat_timeout: seconds without a peer's heartbeat after which a wait on it fails
            naming it (``None``, default: no heartbeat; the Trainer strategies default to 60).
        hierarchical: the ranks of a node are one learner (super-learner): their gradients are
            averaged over the node every step and their floating buffers after it, so they
            hold bit-identical replicas, and gossip runs between nodes (``"dpsgd"``:
            ``topology`` over the nodes; ``"adpsgd"``: ``pairing`` over the nodes), local rank
            ``l`` exchanging slice ``l`` of the replica with local rank ``l`` of its peer
            nodes. Start every rank of a node from the same weights (the broadcast does). One
            process per node: the same as ``False``; one node: plain data parallelism (with a
            warning).
        layout: ``hierarchical``: this rank's place in the nodes
            (:class:`~lightning_gossip.hierarchy.NodeLayout`); default: torchrun's environment
            (:func:`~lightning_gossip.node_averaging.node_layout`). Checked over every rank (a
            collective): global ranks must be ``node * processes_per_node + local``.
        node_gradients: ``hierarchical``: where the node's gradient all-reduce runs:
            ``"at_step"`` (default: in :meth:`before_step`, i.e. the optimizer's pre-step hook)
            or, for an owner that runs every backward through :attr:`node`'s
            :meth:`~lightning_gossip.node_averaging.NodeAverager.wrap` (the Fabric strategies),
            ``"after_backward"`` (one all-reduce after it) or ``"overlapped"`` (bucket by bucket
            during it); :meth:`before_step` then averages nothing.
        elastic: survive lost ranks (the module docstring, :mod:`lightning_gossip.elastic.loop`):
            the survivors go on without them. Needs ``heartbeat_timeout``; ``dpsgd`` needs a
            topology name; not with ``hierarchical``, ``global_average_every_n_steps`` or
            ``gossip_every_n_steps`` other than 1 (``ValueError``).
        start_timeout: refused (``ValueError`` unless ``None``): a plain loop's processes start
            together and none joins a running loop (the Trainer strategies offer both).

    The step count and the engine are the :attr:`session`'s
    (:class:`~lightning_gossip.elastic.session.ElasticSession`), which an elastic loop's
    survivors change after a loss.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 strategy: str = "adpsgd", *, topology: str | Topology = "ring",
                 pairing: str = "ring", seed: int = 0, max_staleness: int | None = 4,
                 overlap: bool = True, delay_by_one: bool = False, wire_dtype: str = "fp32",
                 gossip_every_n_steps: GossipPeriod = 1, timeout: timedelta | float = 60.0,
                 backend: str | None = None, broadcast: bool = True,
                 global_average_every_n_steps: int | None = None,
                 outer_lr: float | None = None, outer_momentum: float = 0.0,
                 outer_nesterov: bool = True, heartbeat_timeout: float | None = None,
                 hierarchical: bool = False, layout: NodeLayout | None = None,
                 node_gradients: str = "at_step", elastic: bool = False,
                 start_timeout: float | None = None) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if node_gradients not in NODE_GRADIENTS:
            raise ValueError(f"node_gradients must be one of {NODE_GRADIENTS}, got "
                             f"{node_gradients!r}")
        #: the outer optimizer of the periodic global average (``None``: the plain average)
        self.outer = check_gossip_options(global_average_every_n_steps, outer_lr, outer_momentum,
                                          outer_nesterov, heartbeat_timeout)
        check_no_joins(start_timeout)
        if elastic:  # (before any collective: every rank raises the same error)
            check_loop_options(strategy, topology=topology, heartbeat_timeout=heartbeat_timeout,
                               hierarchical=hierarchical,
                               global_average_every_n_steps=global_average_every_n_steps)
            check_gossip_every_n_steps(gossip_every_n_steps, elastic=True, owner="attach")
        self.global_average_every_n_steps = global_average_every_n_steps
        period = resolve_gossip_every_n_steps(gossip_every_n_steps)  # ("auto": 1 at first)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("lightning_gossip.attach needs an initialised default process "
                               "group: call torch.distributed.init_process_group() first "
                               "(torchrun sets its environment)")
        self.model = model
        self.algorithm = strategy  #: "dpsgd" or "adpsgd"
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        #: the step count and the engine (an elastic loop's survivors change both after a
        #: loss, and its membership and groups): every part reads them here when it acts
        self.session = ElasticSession()
        #: ``hierarchical`` with several processes per node: this rank's place in the nodes
        #: (``None``: flat, also with one process per node)
        self.layout: NodeLayout | None = None
        if hierarchical and self.world_size > 1:
            found = node_layout(self.rank, self.world_size, layout)  # (checked on every rank)
            self.layout = found if found.devices > 1 else None
        self.flat = FlatState(model)
        device = self.flat.device
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        wire = check_wire_dtype(wire_dtype)
        self._handles: list[Any] = []
        if broadcast and self.world_size > 1:
            start = self.flat.pack()
            dist.broadcast(start, src=0)
            self.flat.copy_(start)
        if self.outer is not None:
            self.outer.start(self.flat.pack())  # the anchor: where every replica starts
        #: this rank's heartbeat (``heartbeat_timeout``; ``None`` without, or alone)
        self.heartbeat: Heartbeat | None = None
        if heartbeat_timeout is not None and self.world_size > 1:
            self.heartbeat = Heartbeat.connect(self.rank, self.world_size, heartbeat_timeout,
                                               fallback=_compat.default_store())
            self.heartbeat.start()
        # The engine's groups, created on every rank in the same order. ``meet`` (gloo) is the
        # training thread's: the meeting before an AD-PSGD phase and the exact averages.
        self._meet = dist.new_group(backend="gloo", timeout=self.timeout)
        settings = auto_period(gossip_every_n_steps)
        #: ``gossip_every_n_steps="auto"``: the period's driver (``None``: a fixed period, or a
        #: single process); its ``switches`` are the decisions and where they took effect
        self.auto: PeriodDriver | None = None
        if settings is not None and self.world_size > 1:  # dpsgd: all-reduce on ``meet``
            self.auto = PeriodDriver(settings, agree=strategy == "dpsgd", rank=self.rank,
                                     timeout=self.timeout, group=self._meet,
                                     heartbeat=self.heartbeat)
        #: ``hierarchical``: the averaging over this rank's node (``None`` when flat)
        self.node: NodeAverager | None = None
        #: ``elastic``: the recovery from lost ranks (``None``: not elastic, or alone)
        self.elastic: ElasticLoop | None = None
        self._gradients_at_step = node_gradients == "at_step"
        self._average_group = self._meet if device.type == "cpu" else None
        self._sync_stats = SyncStats()  # an elastic dpsgd loop's, over its engines
        lay = self.layout
        exchanging = self.world_size > 1 and not (lay is not None and lay.num_nodes == 1)
        if lay is not None and lay.num_nodes == 1:
            warnings.warn(f"hierarchical gossip on one node of {lay.devices} processes: "
                          "gradients are averaged inside the node and there is nothing to "
                          "gossip with (plain data parallelism)", stacklevel=3)
        engine: SyncGossip | AsyncGossip | None = None
        if self.world_size > 1 and strategy == "dpsgd":
            group = dist.new_group(backend=backend, timeout=self.timeout)
            groups: NodeGroups | None = None
            if lay is not None:  # the worker all-gathers on a node group of its own (not NCCL)
                groups = make_node_groups(lay, backend, self.timeout,
                                          gossip_node_group="nccl" not in backend)
                self.node = self._node_averager(groups, node_gradients)
            if elastic:  # the survivors' engines: the topology over them, by its name
                assert isinstance(topology, str)
                rounds = partial(SyncGossip, self.flat, self.rank, timeout=self.timeout,
                                 overlap=overlap, delay_by_one=delay_by_one,
                                 heartbeat=self.heartbeat, wire_dtype=wire,
                                 stats=self._sync_stats)
                engine = rounds(build(topology, self.world_size, seed=seed), group)
                self.elastic = self._elastic(strategy, RoundEngines(
                    self.session, NodeLayout.flat(self.world_size, self.rank), (topology, seed),
                    rounds),
                    ElasticGroups(lightning=self._average_group, control=None, data=group), backend)
            elif exchanging:
                topo = (resolve_learners(topology, lay.num_nodes, lay.devices, seed, True)
                        if lay is not None else topology if isinstance(topology, Topology)
                        else build(topology, self.world_size, seed=seed))
                engine = SyncGossip(
                    self.flat, self.rank, topo, group, self.timeout, overlap=overlap,
                    delay_by_one=delay_by_one, heartbeat=self.heartbeat, wire_dtype=wire,
                    period=period, auto=self.auto, layout=lay, groups=groups,
                    node_gather=self.node.all_gather if self.node is not None else None)
        elif self.world_size > 1:
            groups = make_async_groups(lay, backend, self.timeout)  # flat: control, data
            if lay is not None:
                self.node = self._node_averager(groups, node_gradients)
            if elastic:  # the survivors' engines: the pairing over them
                pairs = partial(AsyncGossip, self.flat, self.rank, timeout=self.timeout,
                                max_staleness=max_staleness, delay_by_one=delay_by_one,
                                heartbeat=self.heartbeat, wire_dtype=wire)
                engine = pairs(Pairing(pairing, self.world_size, seed),
                               control_group=groups.control, data_group=groups.column)
                self.elastic = self._elastic(strategy, PairwiseEngines(
                    self.session, NodeLayout.flat(self.world_size, self.rank), (pairing, seed),
                    pairs),
                    ElasticGroups(lightning=self._average_group, control=groups.control,
                                  data=groups.column), backend)
            elif exchanging:
                over = Pairing(pairing, lay.num_nodes if lay is not None else self.world_size,
                               seed)
                assert groups.control is not None
                engine = AsyncGossip(
                    self.flat, self.rank, ColumnPairing(over, lay) if lay is not None else over,
                    control_group=groups.control, data_group=groups.column,
                    timeout=self.timeout, max_staleness=max_staleness,
                    delay_by_one=delay_by_one, heartbeat=self.heartbeat, wire_dtype=wire,
                    period=period, auto=self.auto,
                    shard=(lay.local, lay.devices) if lay is not None else (0, 1),
                    node_gather=self.node.all_gather if self.node is not None else None)
        self.session.swap_engine(engine)
        if engine is not None:
            engine.start()
        self._closed = False
        if optimizer is not None:
            self._handles = [optimizer.register_step_pre_hook(self._pre_hook),
                             optimizer.register_step_post_hook(self._post_hook)]

    def _elastic(self, kind: str, engines: RoundEngines | PairwiseEngines, start: ElasticGroups,
                 backend: str) -> ElasticLoop:
        """The elastic loop's recovery (``start``: the groups the loop starts with; the sync
        points' first)."""
        return ElasticLoop(self.session, kind, run=next_run(), rank=self.rank,
                           world_size=self.world_size, timeout=self.timeout,
                           heartbeat=self.heartbeat, backend=backend, engines=engines,
                           start=start)

    def _node_averager(self, groups: NodeGroups, node_gradients: str) -> NodeAverager:
        """The averaging over this rank's node (``hierarchical``), on the node's group."""
        assert self.layout is not None
        return NodeAverager(self.model, self.flat, self.layout, groups.node, self.timeout,
                            self.heartbeat, step=self.session.current_step,
                            overlap=node_gradients == "overlapped")

    @property
    def step(self) -> int:
        """Optimizer steps seen so far (the ``t`` of ``W_t``; an elastic ``dpsgd`` loop's
        survivors may move it to the step they agreed on): the :attr:`session`'s."""
        return self.session.step

    @step.setter
    def step(self, step: int) -> None:
        self.session.move_to(step)

    @property
    def engine(self) -> SyncGossip | AsyncGossip | None:
        """The engine (``None`` with a single process, the loop then trains locally, on one
        hierarchical node, where there is nothing to gossip with, or for the lone survivor of
        an elastic loop): the :attr:`session`'s (after a loss, the survivors')."""
        return self.session.engine

    @property
    def live(self) -> tuple[int, ...]:
        """The live ranks: every rank, except those an elastic loop lost."""
        return self.elastic.live if self.elastic is not None else tuple(range(self.world_size))

    @property
    def live_group(self) -> Any:
        """The group of the live ranks for the loop's own collectives: ``None`` (the default
        group) unless elastic (its sync points' group: the survivors' after a loss)."""
        return self.elastic.group if self.elastic is not None else None

    @property
    def losses(self) -> list[tuple[int, tuple[int, ...], float, float]]:
        """An elastic loop's losses survived: ``(step, lost ranks, wall time the recovery
        began, seconds it took)`` each (empty otherwise)."""
        return list(self.elastic.survivors.losses) if self.elastic is not None else []

    # -- the step: called by the optimizer's hooks (or by an owner that drives it) ------------
    def before_step(self) -> None:
        """Before ``optimizer.step()`` (after backward): average the gradients over the node
        (``hierarchical``, ``node_gradients="at_step"``), then start step :attr:`step`'s
        gossip (``elastic``: first recover from a loss found meanwhile)."""
        if self.elastic is not None:
            self.elastic.before_step()
            return
        if self.heartbeat is not None and self.heartbeat.has_finding:
            self.heartbeat.check(f"rank {self.rank} at step {self.step}")
        if self.node is not None and self._gradients_at_step:
            self.node.average_gradients()
        engine = self.engine
        if isinstance(engine, AsyncGossip) and not engine.in_phase:
            dist.barrier(group=self._meet)  # every rank opens the phase together
        if engine is not None:
            engine.before_step(self.step)

    def after_step(self) -> None:
        """After ``optimizer.step()``: average the floating buffers over the node
        (``hierarchical``), then mix (D-PSGD) or apply the peers' deltas (AD-PSGD)."""
        if self.elastic is not None:
            self.elastic.after_step()
            return
        if self.node is not None:
            self.node.average_buffers()
        if self.engine is not None:
            self.engine.after_step(self.step)
        self.step += 1
        n = self.global_average_every_n_steps
        if n is not None and self.step % n == 0:
            self.become_average()

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.before_step()

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.after_step()

    # -- sync points ---------------------------------------------------------------------------
    @property
    def stats(self) -> Any:
        """The engine's counters (``SyncStats`` or ``GossipStats``; ``None`` without one; an
        elastic ``dpsgd`` loop: over all its engines)."""
        if self.elastic is not None and self.algorithm == "dpsgd":
            return self._sync_stats
        return self.engine.stats if self.engine is not None else None

    def quiesce(self) -> None:
        """A sync point on every rank: finish every exchange in flight and apply it; until the
        next optimizer step nothing is sent, so collectives of the loop are safe."""
        if self.elastic is not None:
            self.elastic.quiesce()
        elif self.engine is not None:
            self.engine.quiesce()

    def barrier(self) -> None:
        """A sync point: every live rank meets (on :attr:`live_group`, a watched wait:
        a silent rank is named within about the heartbeat timeout; ``elastic``: a loss is
        survived)."""
        if self.elastic is not None:
            self.elastic.barrier()
            return
        watched_collective(dist.barrier, what=f"rank {self.rank}: waiting at a barrier",
                           timeout=self.timeout, group=self._meet, heartbeat=self.heartbeat)

    def average(self) -> torch.Tensor:
        """:meth:`quiesce`, then the exact average of all replicas as one fp32 vector (a
        collective: every rank calls it); the replicas are left as they are (``elastic``:
        of the live ranks, over their group)."""
        if self.elastic is not None:
            return self.elastic.sync(self._average_now)
        self.quiesce()
        return all_average(self.flat.pack(), self._average_group, timeout=self.timeout,
                           what="averaging the replicas")

    def _average_now(self) -> torch.Tensor:
        """An elastic loop's average (under its sync, again after a loss): quiesce the
        session's engine, then average over the live ranks' group."""
        assert self.elastic is not None
        self.elastic.quiesce_engine()
        return all_average(self.flat.pack(), self.elastic.group, timeout=self.timeout,
                           what=f"rank {self.rank}: averaging the replicas of the live ranks")

    @contextlib.contextmanager
    def consensus(self) -> Iterator[None]:
        """Inside the block the model holds the exact average of the replicas (every rank
        enters it together); this rank's replica is put back afterwards."""
        average = self.average()  # after quiesce: the deltas in flight are in the replica
        mine = self.flat.pack().clone()
        self.flat.copy_(average)
        try:
            yield
        finally:
            self.flat.copy_(mine)

    def become_average(self) -> None:
        """Every replica becomes the exact average of all replicas, or with ``outer_lr`` the
        outer optimizer's step from it (a sync point; gossip goes on at the next optimizer
        step)."""
        average = self.average()
        self.flat.copy_(average if self.outer is None else self.outer.step(average))

    def state_dict(self) -> dict[str, Any]:
        """The step count and the outer optimizer's state (for ``fabric.save``/a checkpoint;
        the replica itself is the model's)."""
        return {"step": self.step,
                "outer": None if self.outer is None else self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the model's weights are loaded)."""
        self.step = int(state["step"])
        if (state.get("outer") is None) != (self.outer is None):
            raise ValueError("the checkpoint's gossip state was saved with"
                             + (" an" if state.get("outer") is not None else "out an")
                             + " outer optimizer; this Gossip is built with"
                             + (" one" if self.outer is not None else "out one"))
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])

    def finish(self) -> None:
        """The end of training: every replica becomes the exact average of all replicas, the
        hooks are removed and the engine stops (:meth:`close`)."""
        self.become_average()
        self.close()

    def close(self) -> None:
        """Remove the optimizer hooks and stop the engine (idempotent; no average)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not self._closed:
            self._closed = True
            if self.elastic is not None:
                self.elastic.close()
            if self.engine is not None:
                self.engine.close()
            if self.heartbeat is not None:
                self.heartbeat.leave(failed=False)


def check_gossip_options(every_n_steps: int | None, outer_lr: float | None,
                         outer_momentum: float, outer_nesterov: bool,
                         heartbeat_timeout: float | None) -> OuterOptimizer | None:
    """Check the periodic global average's, the outer optimizer's and the heartbeat's options
    (``ValueError`` naming the option, at construction); the outer optimizer, or ``None``
    without ``outer_lr``.

    >>> check_gossip_options(8, 0.7, 0.9, True, heartbeat_timeout=60.0)
    OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    >>> check_gossip_options(8, None, 0.0, True, heartbeat_timeout=0)
    Traceback (most recent call last):
    ...
    ValueError: heartbeat_timeout must be positive or None, got 0
    """
    check_every("global_average_every_n_steps", every_n_steps)
    if heartbeat_timeout is not None and not heartbeat_timeout > 0:
        raise ValueError(f"heartbeat_timeout must be positive or None, got "
                         f"{heartbeat_timeout!r}")
    return check_outer(outer_lr, outer_momentum, outer_nesterov, every_n_steps)


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "adpsgd",
           **options: Any) -> Gossip:
    """Attach gossip to ``model`` and ``optimizer`` of a plain PyTorch loop (every rank calls it,
    inside an initialised process group); returns the :class:`Gossip`.

    From then on every ``optimizer.step()`` is a gossip step; :meth:`Gossip.finish` at the end
    leaves the exact average of the replicas on every rank. ``options`` are
    :class:`Gossip`'s keywords (``topology``, ``pairing``, ``seed``, ``max_staleness``,
    ``overlap``, ``delay_by_one``, ``wire_dtype``, ``gossip_every_n_steps``, ``timeout``,
    ``backend``, ``broadcast``, ``global_average_every_n_steps``, ``outer_lr``,
    ``outer_momentum``, ``outer_nesterov``, ``heartbeat_timeout``, ``hierarchical``,
    ``layout``, ``elastic``). ``hierarchical=True`` under ``torchrun --nnodes N
    --nproc-per-node P``: the P ranks of a node average their gradients at every
    ``optimizer.step()`` and gossip runs between the N nodes. ``elastic=True`` (with
    ``heartbeat_timeout``): the loop survives lost ranks, the others go on without them.

    >>> attach(None, None, strategy="ddp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: strategy must be one of ('dpsgd', 'adpsgd'), got 'ddp'
    >>> attach(None, None, strategy="dpsgd", elastic=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: attach(elastic=True) finds lost ranks by their heartbeat: give heartbeat_timeout ...
    """
    return Gossip(model, optimizer, strategy, **options)
