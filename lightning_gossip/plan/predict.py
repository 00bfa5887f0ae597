"""The per-strategy predictions of the cost model: ``ddp``, ``dpsgd`` and ``adpsgd`` (flat and
hierarchical), and :func:`predict_all` (the table of ``lightning-gossip plan``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_gossip import topology as _topology
from lightning_gossip.pairing import PairingName
from lightning_gossip.plan.blocks import (
    _consensus,
    cross_node_sends,
    hierarchical_allreduce_time,
    link_time,
    ring_allreduce_time,
    staleness_bound,
    step_time,
    tree_allreduce_time,
)
from lightning_gossip.plan.model import MODES, Cluster, Mode, Prediction, Workload, _check_period


def predict_ddp(cluster: Cluster, workload: Workload, algorithm: str = "ring",
                stragglers: Sequence[float] | None = None) -> Prediction:
    """Data parallelism: an all-reduce of the gradients, blocking (``compute + all-reduce``; the
    bucketed overlap of DDP with backward is ignored, so this is an upper bound).

    * ``ring``: one ring over all ranks, numbered node by node; one rank per node sends to the
      next node, so the inter-node hop is the slowest link and each node sends
      ``2 (n - 1) / n`` gradients per step;
    * ``tree``: :func:`tree_allreduce_time` with the inter-node link;
    * ``hierarchical``: :func:`hierarchical_allreduce_time` (NCCL's choice on many nodes).

    Every rank waits for the slowest (``compute_s * max(stragglers)``). The host's share
    (:meth:`Cluster.ddp_host_time`) of the bytes a rank sends and receives is added:
    ``4 (n - 1) / n`` gradients for the ring, ``4`` for the tree, ``4 (L - 1) / L`` plus
    ``4 (N - 1) / (N L)`` for the hierarchical form.

    >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9)
    >>> predict_ddp(c, Workload(params=1_000_000, compute_s=0.01)).step_s  # 0.01 + 2 x 2 ms
    0.014
    """
    n, N, L = cluster.world_size, cluster.nodes, cluster.gpus_per_node
    g = workload.params * workload.grad_bytes
    slow = max(stragglers) if stragglers is not None and len(stragglers) else 1.0
    if algorithm == "hierarchical":
        comm = hierarchical_allreduce_time(g, cluster)
        per_node = 2 * (N - 1) / N * g if N > 1 else 0.0
        host = 4 * (L - 1) / L * g + 4 * (N - 1) / N * g / L
    else:
        bw, lat = ((cluster.inter_bandwidth, cluster.inter_latency) if N > 1
                   else (cluster.intra_bandwidth, cluster.intra_latency))
        if algorithm == "ring":
            comm = ring_allreduce_time(g, n, bw, lat)
            per_node = 2 * (n - 1) / n * g if N > 1 else 0.0
            host = 4 * (n - 1) / n * g
        elif algorithm == "tree":
            comm = tree_allreduce_time(g, n, bw, lat)
            per_node = 2 * g if N > 1 else 0.0
            host = 4 * g if n > 1 else 0.0
        else:
            raise ValueError(f"algorithm must be ring, tree or hierarchical, got {algorithm!r}")
    compute = workload.compute_s * slow
    comm += cluster.ddp_host_time(host)
    return Prediction(f"ddp ({algorithm})", compute + comm, comm, per_node / L, per_node, 0,
                      "exact average every step")


def predict_dpsgd(cluster: Cluster, workload: Workload, topology: str = "random_ring",
                  hierarchical: bool = False, mode: Mode = "overlap", seed: int = 0,
                  stragglers: Sequence[float] | None = None,
                  tolerance: float | None = 1e-3, period: int = 1) -> Prediction:
    """Synchronous gossip (D-PSGD) with ``topology`` and the scheduling ``mode``
    (:func:`step_time`).

    * flat: every rank sends its replica (``params * wire_bytes``) to each of its peers; the
      messages that cross nodes share the node's interface (:func:`cross_node_sends` counts
      them for ranks numbered node by node), the others go over the GPU's intra-node link;
      the gossip time is the slower of the two.
    * ``hierarchical``: the topology is over nodes; a node's ``L`` GPUs each send their ``1/L``
      shard to each of the ``k`` peer nodes, so a node sends ``k`` replicas per step (``k/L``
      per rank). Inside the node, blocking: a ring all-reduce of the gradients
      (``grad_bytes``) before the optimizer step and an all-gather of the fp32 mixing change.

    Inter-node exchanges run at :attr:`Cluster.exchange_bandwidth` (both directions of a
    connection at once). Every rank waits for the slowest (``compute_s * max(stragglers)``).
    The host's share of the bytes a rank sends and receives (:meth:`Cluster.host_time`:
    ``2 peers`` replicas flat, ``2 k / L`` wire replicas plus, inside the node,
    ``4 (L - 1) / L`` gradients and ``2 (L - 1) / L`` fp32 replicas hierarchical) is added
    to compute, and only
    ``cluster.overlap`` of the gossip is hidden (:func:`step_time`). Steps to consensus from
    the topology's gap (:func:`consensus_steps`; skipped with ``tolerance=None``).

    ``period`` (``gossip_every_n_steps``): one exchange every ``period`` steps, posted at the
    first step of its period with the steps up to its exchange step ``e`` (the period's last)
    to complete in (``overlap``); with ``delay_by_one`` its change is applied one step later,
    after the step ``e + 1`` (:class:`~lightning_gossip.sync_gossip.schedule.RoundSchedule`),
    while the next period's exchange is posted at that step's start. Either way one exchange
    runs per ``n`` steps in the steady state, so a period of ``n`` steps takes
    :func:`step_time` of ``n`` steps' compute and one exchange. Per step that is
    the exchange's link time, its host work, its all-gather in the node and its bytes divided
    by ``n`` (exactly, whatever ``cluster.overlap``); the gradient all-reduce in the node stays
    every step, and the consensus steps are ``n`` times the mixing steps.

    >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9)
    >>> w = Workload(params=1_000_000, compute_s=0.01)
    >>> predict_dpsgd(c, w, "ring", mode="blocking").step_s  # 0.01 + 4 MB at 1 GB/s
    0.014
    >>> predict_dpsgd(c, w, "ring", mode="blocking", period=4).step_s  # 0.01 + 4 ms / 4
    0.011
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    _check_period(period)
    N, L = cluster.nodes, cluster.gpus_per_node
    replica = workload.params * workload.wire_bytes
    slow = max(stragglers) if stragglers is not None and len(stragglers) else 1.0
    compute = workload.compute_s * slow
    if hierarchical:
        name = f"dpsgd hier ({topology}, {mode})"
        every = gather = 0.0  # blocking in the node: every step, every exchange
        if L > 1:
            every = ring_allreduce_time(workload.params * workload.grad_bytes, L,
                                        cluster.intra_bandwidth, cluster.intra_latency)
            gather = (L - 1) * link_time(workload.params * 4 / L, cluster.intra_bandwidth,
                                         cluster.intra_latency)
        host_every = cluster.host_time(4 * (L - 1) / L * workload.params * workload.grad_bytes)
        host_gather = cluster.host_time(2 * (L - 1) / L * workload.params * 4)
        if N == 1:
            fixed = every + gather + host_every + host_gather
            return Prediction(name, compute + fixed, fixed, 0.0, 0.0, 0,
                              "one node: plain data parallelism", compute_s=compute)
        topo = _topology.build(topology, N, seed)
        cross, peers = cross_node_sends(topo, 1)
        per_node = cross * replica
        gossip = link_time(per_node, cluster.exchange_bandwidth, peers * cluster.inter_latency)
        host = host_gather + cluster.host_time(2 * peers * replica / L)
        step = step_time(compute + host_every + host / period, gossip / period,
                         every + gather / period, mode, cluster.overlap)
        hide = compute + host_every + (every if mode != "overlap" else 0.0)
        return Prediction(name, step, step - compute, per_node / L / period, per_node / period,
                          _steps(_consensus(topo, tolerance), period),
                          _per(f"{peers} peer node(s)", period), period, hide, gossip + host)
    name = f"dpsgd ({topology}, {mode})"
    n = cluster.world_size
    if n == 1:
        return Prediction(name, compute, 0.0, 0.0, 0.0, 0, "one rank", compute_s=compute)
    topo = _topology.build(topology, n, seed)
    cross, peers = cross_node_sends(topo, L) if N > 1 else (0.0, topo.degree(0))
    per_node = cross * replica
    inter = link_time(per_node, cluster.exchange_bandwidth,
                      math.ceil(cross / L) * cluster.inter_latency)
    local_msgs = max(peers - (cross / L), 0.0)
    intra = link_time(local_msgs * replica, cluster.intra_bandwidth,
                      math.ceil(local_msgs) * cluster.intra_latency)
    gossip = max(inter, intra)
    host = cluster.host_time(2 * peers * replica)
    step = step_time(compute + host / period, gossip / period, 0.0, mode, cluster.overlap)
    return Prediction(name, step, step - compute, per_node / L / period, per_node / period,
                      _steps(_consensus(topo, tolerance), period), _per(f"{peers} peers", period),
                      period, compute, gossip + host)


def _per(what: str, period: int) -> str:
    """``what`` per step, or every ``period`` steps."""
    return f"{what}/step" if period == 1 else f"{what} every {period} steps"


def _steps(mixing_steps: float | None, period: int) -> float | None:
    """Optimizer steps for ``mixing_steps`` exchanges at one every ``period`` steps."""
    return None if mixing_steps is None else mixing_steps * period


def adpsgd_exchange_time(cluster: Cluster, workload: Workload, pairing: PairingName = "ring",
                         hierarchical: bool = False) -> tuple[float, float]:
    """``(seconds, cross)`` of one exchange round of AD-PSGD, ``cross`` the fraction of the
    ranks' exchanges that cross nodes. An exchange swaps replicas with one partner (each side
    sends ``params * wire_bytes``); all ranks exchange at once.

    * flat, ``pairing="ring"`` (ranks in order, a partner next to it): ``1 / L`` of the pairs
      cross nodes (``0`` on one node); ``"random"``: a random other rank, ``(n - L) / (n - 1)``.
      The crossing exchanges of a node share its interface; the others use the intra link.
    * ``hierarchical``: nodes pair up; each GPU swaps its ``1/L`` shard, so a node sends one
      replica per exchange through its interface.

    The interface runs at :attr:`Cluster.exchange_bandwidth` (a swap: both directions of one
    connection at once).

    >>> c = Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e12)
    >>> adpsgd_exchange_time(c, Workload(params=1_000_000, compute_s=0.1))  # 2 x 1/2 x 4 MB
    (0.16, 0.5)
    """
    N, L, n = cluster.nodes, cluster.gpus_per_node, cluster.world_size
    replica = workload.params * workload.wire_bytes
    if hierarchical:
        if N == 1:
            return 0.0, 0.0
        return link_time(replica, cluster.exchange_bandwidth, cluster.inter_latency), 1.0
    if n == 1:
        return 0.0, 0.0
    if pairing == "ring":
        cross = 1.0 / L if N > 1 else 0.0
    elif pairing == "random":
        cross = (n - L) / (n - 1)
    else:
        raise ValueError(f"pairing must be ring or random, got {pairing!r}")
    inter = link_time(L * cross * replica, cluster.exchange_bandwidth, cluster.inter_latency)
    intra = link_time(replica, cluster.intra_bandwidth, cluster.intra_latency)
    return max(inter if cross > 0 else 0.0, intra if cross < 1 else 0.0), cross


def _adpsgd_rank_step(compute: np.ndarray, t_x: float | np.ndarray,
                      unhidden: float | np.ndarray) -> np.ndarray:
    """Step time of ranks whose compute step is ``compute`` while a gossip thread runs
    exchanges of ``t_x`` back to back, each costing the training thread ``unhidden`` seconds:
    the fixed point of ``s = compute + unhidden * min(1, s / t_x)`` (a rank takes part in
    ``min(1, s / t_x)`` exchanges per step), i.e. ``min(compute / (1 - unhidden / t_x),
    compute + unhidden)``. ``t_x`` and ``unhidden`` may differ by rank (arrays: each rank's
    own period).

    >>> _adpsgd_rank_step(np.array([0.1]), 0.2, 0.1).tolist()  # 0.1 / (1 - 1/2)
    [0.2]
    >>> _adpsgd_rank_step(np.array([0.1, 0.1]), np.array([0.2, 0.1]), np.array([0.1, 0.1])
    ...                   ).tolist()  # the second: all unhidden, in series
    [0.2, 0.2]
    """
    if np.ndim(t_x) or np.ndim(unhidden):
        c, x, u = np.broadcast_arrays(np.asarray(compute, dtype=float), t_x, unhidden)
        return np.array([_adpsgd_rank_step(np.array([ci]), float(xi), float(ui))[0]
                         for ci, xi, ui in zip(c, x, u)])
    if t_x <= 0 or unhidden <= 0:
        return compute
    if unhidden >= t_x:  # the exchange is all unhidden: one per step, in series
        return compute + unhidden
    return np.minimum(compute / (1.0 - unhidden / t_x), compute + unhidden)


def _unit_periods(period: int | Sequence[int], n: int, gpus_per_node: int,
                  hierarchical: bool) -> int | np.ndarray:
    """``period`` as an int, or one period per unit (rank; node, ``hierarchical``, whose ranks
    must agree) from one per rank; ``ValueError`` for a bad one."""
    if isinstance(period, (int, np.integer)):
        _check_period(period)
        return int(period)
    per = np.asarray(period)
    if per.shape != (n,):
        raise ValueError(f"period must be an integer or one per rank ({n}), got {per.shape}")
    for p in per.tolist():
        _check_period(p)
    if not hierarchical:
        return per.astype(np.int64)
    nodes = per.reshape(-1, gpus_per_node)
    if (nodes != nodes[:, :1]).any():
        raise ValueError("hierarchical: the ranks of a node step together and take one period, "
                         f"got {per.tolist()}")
    return nodes[:, 0].astype(np.int64)


def _node_fixed(cluster: Cluster, workload: Workload) -> float:
    """Hierarchical AD-PSGD's blocking work in the node at every step: the gradient
    all-reduce, the all-gather of the slices' changes and their host work (0 for one GPU)."""
    L = cluster.gpus_per_node
    if L == 1:
        return 0.0
    return (ring_allreduce_time(workload.params * workload.grad_bytes, L,
                                cluster.intra_bandwidth, cluster.intra_latency)
            + (L - 1) * link_time(workload.params * 4 / L, cluster.intra_bandwidth,
                                  cluster.intra_latency)
            + cluster.host_time((4 * workload.grad_bytes + 2 * 4) * (L - 1) / L
                                * workload.params))


def adpsgd_rank_compute(cluster: Cluster, workload: Workload, hierarchical: bool = False,
                        stragglers: Sequence[float] | None = None) -> np.ndarray:
    """The compute per step each rank of AD-PSGD measures for ``gossip_every_n_steps="auto"``
    (one value per rank): ``compute_s`` times its straggler factor; hierarchical, its node's
    step (the slowest GPU of the node, then the node's blocking all-reduce and all-gather), the
    same on every rank of the node. What :func:`predict_adpsgd` steps at before gossip.

    >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9)
    >>> adpsgd_rank_compute(c, Workload(params=10, compute_s=0.1), stragglers=[1, 2]).tolist()
    [0.1, 0.2]
    """
    N, L, n = cluster.nodes, cluster.gpus_per_node, cluster.world_size
    f = np.ones(n) if stragglers is None else np.asarray(stragglers, dtype=float)
    if f.shape != (n,):
        raise ValueError(f"stragglers must have one factor per rank ({n}), got {f.shape}")
    if not hierarchical:
        return workload.compute_s * f
    node = workload.compute_s * f.reshape(N, L).max(axis=1) + _node_fixed(cluster, workload)
    return np.repeat(node, L)


def predict_adpsgd(cluster: Cluster, workload: Workload, pairing: PairingName = "ring",
                   hierarchical: bool = False, max_staleness: int | None = 4,
                   stragglers: Sequence[float] | None = None,
                   period: int | Sequence[int] = 1) -> Prediction:
    """Asynchronous gossip (AD-PSGD): the compute step never waits for gossip unless the
    exchanges cannot keep up. An exchange takes ``t_x`` (:func:`adpsgd_exchange_time`) and,
    because of how the engine hands snapshots over, the staleness bound lets a rank make
    ``(max_staleness + 2) / 3`` steps per exchange (:func:`staleness_bound`), so a rank whose
    compute step is ``c`` runs at ``max(c, 3 t_x / (max_staleness + 2))`` (``c + t_x`` with
    ``max_staleness=0``, ``c`` with ``None``).
    Ranks do not wait for each other: the step rate is the **sum of the ranks' rates**, and
    ``step_s`` is ``world_size`` over that sum (synchronous strategies: the slowest rank's).
    With ``hierarchical``, the unit is the node: every step is the node's blocking gradient
    all-reduce plus all-gather of the slices' changes (as in :func:`predict_dpsgd`, host work
    included) after its slowest GPU.

    Hosts that share cores between compute and communication (``cluster.overlap < 1`` or a
    finite ``host_bandwidth``): an exchange's host work (sending and receiving the replica,
    ``2 params wire_bytes``, or ``2 / L`` of it hierarchical) lengthens
    the exchange and, with ``1 - overlap`` of its link time, is taken from the training thread
    once per exchange the rank takes part in (:func:`_adpsgd_rank_step`).

    Bytes per step: ``min(1, steps per exchange)`` exchanges, ``cross`` of them across nodes.

    ``period`` (``gossip_every_n_steps``): a rank's gossip takes part in one exchange every
    ``period`` steps, modelled as an exchange of ``t_x / period`` every step (its host work and
    unhidden share divided alike, and the staleness bound, which then counts periods:
    ``3 t_x / ((max_staleness + 2) period)``); bytes per step divided by ``period``. The
    node's all-reduce and all-gather (hierarchical) stay every step. ``period`` may also give
    one period per rank (``gossip_every_n_steps="auto"`` lets each rank pick its own: a slow
    rank a shorter one; hierarchical, the ranks of a node agree): each rank's step then
    follows its own, the bytes are the mean over the ranks, and the row's ``period`` is the
    longest (its note gives the range).

    >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9)
    >>> w = Workload(params=1_000_000, compute_s=0.01)
    >>> predict_adpsgd(c, w, max_staleness=0).step_s  # blocking: 0.01 + 4 ms
    0.014
    >>> predict_adpsgd(c, w, stragglers=[1.0, 3.0]).step_s  # 2 / (1/0.01 + 1/0.03)
    0.015
    >>> predict_adpsgd(c, w, max_staleness=0, period=4).step_s  # 0.01 + 4 ms / 4
    0.011
    """
    N, L, n = cluster.nodes, cluster.gpus_per_node, cluster.world_size
    per = _unit_periods(period, n, L, hierarchical)
    f = np.ones(n) if stragglers is None else np.asarray(stragglers, dtype=float)
    if f.shape != (n,):
        raise ValueError(f"stragglers must have one factor per rank ({n}), got {f.shape}")
    link, cross = adpsgd_exchange_time(cluster, workload, hierarchical=hierarchical,
                                       pairing=pairing)
    replica = workload.params * workload.wire_bytes
    fixed = _node_fixed(cluster, workload) if hierarchical else 0.0
    if hierarchical:
        name = "adpsgd hier"
        host_x = 2 * replica / L
        compute = workload.compute_s * f.reshape(N, L).max(axis=1) + fixed  # per node
        units = L
    else:
        name = f"adpsgd ({pairing})"
        host_x = 2 * replica
        compute = workload.compute_s * f
        units = 1
    h = cluster.host_time(host_x) if link > 0 else 0.0
    exchange = link + h
    t_x = exchange / per  # one exchange every period steps: 1/period of one per step
    unhidden = (h + (1.0 - cluster.overlap) * link) / per
    if max_staleness is None:
        steps = _adpsgd_rank_step(compute, t_x, unhidden)
    elif max_staleness == 0:
        steps = compute + t_x
    else:
        steps = np.maximum(_adpsgd_rank_step(compute, t_x, unhidden),
                           staleness_bound(t_x, max_staleness))
    with np.errstate(divide="ignore"):  # a step of 0 s: an infinite rate, a mean of 0
        step = float(n / (units * (1.0 / steps).sum()))
        mean_compute = float(n / (units * (1.0 / compute).sum())) - fixed
    if isinstance(per, int):
        exchanges = float(min(1.0, step / t_x)) / per if t_x > 0 else 0.0
        row_period, note = per, ""
    else:  # each unit its own: at most one exchange per period, at its own step rate
        exchanges = (float(np.mean(np.minimum(1.0, steps / t_x) / per)) if exchange > 0
                     else 0.0)
        row_period = int(per.max())
        note = f", periods {int(per.min())}-{row_period} by rank" if per.min() < row_period else ""
    per_rank = exchanges * cross * replica / (L if hierarchical else 1)
    return Prediction(name, step, step - mean_compute, per_rank, per_rank * L, None,
                      f"{exchanges:.2f} exchanges/step, {cross:.2f} cross nodes{note}",
                      row_period, mean_compute + fixed, exchange)


def predict_all(cluster: Cluster, workload: Workload, topology: str = "random_ring",
                mode: Mode = "overlap", pairing: PairingName = "ring",
                max_staleness: int | None = 4, stragglers: Sequence[float] | None = None,
                seed: int = 0, tolerance: float | None = 1e-3) -> list[Prediction]:
    """Every strategy on one cluster: ddp (ring, tree, hierarchical), dpsgd and adpsgd (flat
    and hierarchical).

    >>> c = Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e12)
    >>> rows = predict_all(c, Workload(params=1000, compute_s=0.1))
    >>> print(", ".join(rows[i].strategy for i in range(3)))
    ddp (ring), ddp (tree), ddp (hierarchical)
    """
    rows = [predict_ddp(cluster, workload, a, stragglers) for a in ("ring", "tree",
                                                                    "hierarchical")]
    for hier in (False, True):
        rows.append(predict_dpsgd(cluster, workload, topology, hier, mode, seed, stragglers,
                                  tolerance))
    for hier in (False, True):
        rows.append(predict_adpsgd(cluster, workload, pairing, hier, max_staleness,
                                   stragglers))
    return rows
