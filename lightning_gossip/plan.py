"""A communication cost model: predicted time per optimizer step of ``ddp``, ``dpsgd`` and
``adpsgd`` (flat and hierarchical) on a cluster described by a handful of numbers.

Pure Python and NumPy (no torch, no Lightning): it backs ``lightning-gossip plan`` and starts in
a fraction of a second. Every formula is a small function below with its assumptions.

**The link model (alpha-beta).** Sending ``m`` bytes over a link costs ``alpha + m / beta``:
``alpha`` the per-message latency (s), ``beta`` the bandwidth (bytes/s). There are two kinds of
links, described by :class:`Cluster`:

* *intra-node* (NVLink, PCIe, loopback): every GPU has its own ``intra_bandwidth``;
* *inter-node*: every node has **one** network interface of ``inter_bandwidth`` per direction,
  shared by all its GPUs (full duplex; a non-blocking switch: no oversubscribed core).

**Step time.** A step is ``compute_s`` of forward/backward/optimizer (:class:`Workload`) plus
communication. Communication that the strategy posts before forward/backward (``overlap``) is
hidden behind compute up to the compute time; ``delay_by_one`` gives it a whole step;
``blocking`` adds it. "Exposed communication" is step time minus compute time.

Example: 2 nodes of 2 GPUs, 1M parameters, 0.1 s of compute, a 25 MB/s network::

    >>> c = Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e12)
    >>> w = Workload(params=1_000_000, compute_s=0.1)
    >>> round(predict_ddp(c, w).step_s, 3)  # ring all-reduce: each node sends 1.5 x 4 MB
    0.34
    >>> p = predict_dpsgd(c, w, topology="ring", hierarchical=True, mode="blocking")
    >>> round(p.step_s, 3), p.inter_bytes_per_rank  # 4 MB to the one peer node, 2 MB per rank
    (0.26, 2000000.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lightning_gossip import topology as _topology

__all__ = [
    "MODES",
    "Cluster",
    "Prediction",
    "Workload",
    "adpsgd_exchange_time",
    "consensus_steps",
    "cross_node_sends",
    "hierarchical_allreduce_time",
    "link_time",
    "predict_adpsgd",
    "predict_all",
    "predict_ddp",
    "predict_dpsgd",
    "ring_allreduce_time",
    "step_time",
    "straggler_factors",
    "tree_allreduce_time",
]

#: how gossip is scheduled against compute: ``overlap`` (posted before forward/backward, the
#: strategy's default), ``delay_by_one`` (applied a step later), ``blocking`` (neither)
MODES = ("overlap", "delay_by_one", "blocking")


def _check(name: str, value: float, minimum: float = 0.0, strict: bool = True) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is finite and > (or >=) ``minimum``."""
    ok = math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        rel = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {rel} {minimum:g}, got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """The machines: ``nodes`` x ``gpus_per_node`` ranks, bandwidths in bytes/s, latencies in s.

    ``inter_bandwidth`` is one node's network interface, each direction, shared by its GPUs;
    ``intra_bandwidth`` is one GPU's link inside the node.

    >>> Cluster(nodes=0, gpus_per_node=8, inter_bandwidth=1e9)
    Traceback (most recent call last):
    ...
    ValueError: nodes must be an integer >= 1, got 0
    """

    nodes: int
    gpus_per_node: int
    inter_bandwidth: float
    inter_latency: float = 0.0
    intra_bandwidth: float = 150e9
    intra_latency: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        _check("inter_bandwidth (bytes/s)", self.inter_bandwidth)
        _check("intra_bandwidth (bytes/s)", self.intra_bandwidth)
        _check("inter_latency (s)", self.inter_latency, strict=False)
        _check("intra_latency (s)", self.intra_latency, strict=False)

    @property
    def world_size(self) -> int:
        """Total ranks, ``nodes * gpus_per_node``."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """The model and its step: ``params`` values, ``compute_s`` seconds of forward, backward and
    optimizer step per rank, ``wire_bytes`` per value sent by gossip (4 fp32, 2 bf16/fp16),
    ``grad_bytes`` per value of an all-reduced gradient (4: gradients are reduced in fp32).

    >>> Workload(params=10, compute_s=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: compute_s must be a finite number >= 0, got -1.0
    """

    params: int
    compute_s: float
    wire_bytes: int = 4
    grad_bytes: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.params, (int, np.integer)) or self.params < 1:
            raise ValueError(f"params must be an integer >= 1, got {self.params!r}")
        _check("compute_s", self.compute_s, strict=False)
        if self.wire_bytes not in (1, 2, 4, 8):
            raise ValueError(f"wire_bytes must be 1, 2, 4 or 8, got {self.wire_bytes!r}")
        if self.grad_bytes not in (2, 4, 8):
            raise ValueError(f"grad_bytes must be 2, 4 or 8, got {self.grad_bytes!r}")


@dataclass
class Prediction:
    """One row of ``lightning-gossip plan``: the predicted time per optimizer step (``step_s``;
    for ``adpsgd`` the mean over ranks, ``world_size / sum of the ranks' step rates``), the
    communication not hidden behind compute (``exposed_s``), bytes sent per step on inter-node
    links per rank and per node, and mixing steps to consensus (``None``: not applicable)."""

    strategy: str
    step_s: float
    exposed_s: float
    inter_bytes_per_rank: float
    inter_bytes_per_node: float
    consensus_steps: float | None = None
    note: str = ""

    def as_dict(self) -> dict:
        """The row as a JSON-ready dict."""
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def link_time(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """One message of ``nbytes`` over one link: ``latency + nbytes / bandwidth`` (0 for 0 bytes).

    >>> link_time(4e6, 25e6, 1e-3)  # 1 ms + 4 MB at 25 MB/s
    0.161
    """
    return 0.0 if nbytes <= 0 else latency + nbytes / bandwidth


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: reduce-scatter then all-gather,
    ``2 (n - 1)`` rounds of one ``nbytes / n`` chunk per rank, so each rank sends
    ``2 (n - 1) / n * nbytes`` and the time is ``2 (n - 1) (latency + nbytes / (n bandwidth))``.
    ``bandwidth`` is the slowest link of the ring (all links busy at once).

    >>> ring_allreduce_time(8e6, 4, 1e9)  # 6 rounds of 2 MB at 1 GB/s
    0.012
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (latency + nbytes / (n * bandwidth))


def tree_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Pipelined (double) binary-tree all-reduce, NCCL's tree: a reduce up and a broadcast down
    a tree of depth ``ceil(log2 n)``, pipelined so the bandwidth term is that of sending the
    buffer twice: ``2 ceil(log2 n) latency + 2 nbytes / bandwidth``. Fewer latency terms than the
    ring (``log n`` instead of ``n``), the same bandwidth term to first order.

    >>> tree_allreduce_time(8e6, 4, 1e9, 1e-3)  # 2 x 2 levels x 1 ms + 2 x 8 ms
    0.02
    """
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * latency + 2 * nbytes / bandwidth


def hierarchical_allreduce_time(
    nbytes: float, cluster: Cluster, algorithm: str = "ring"
) -> float:
    """NCCL-style two-level all-reduce: a ring reduce-scatter inside every node (each GPU ends
    with a ``1/L`` shard), an all-reduce of the shards between nodes (the ``L`` GPUs of a node
    do theirs at once, sharing the node's interface: ``L`` shards of ``nbytes / L`` = the whole
    buffer per node), then a ring all-gather inside the node. ``algorithm`` is that of the
    inter-node all-reduce (``ring`` or ``tree``).

    >>> c = Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=1e9, intra_bandwidth=1e10)
    >>> round(hierarchical_allreduce_time(8e6, c), 6)  # 2 x 0.4 ms in the node + 8 ms between
    0.0088
    """
    L, N = cluster.gpus_per_node, cluster.nodes
    intra = 2 * (L - 1) * (cluster.intra_latency + nbytes / (L * cluster.intra_bandwidth))
    fn = {"ring": ring_allreduce_time, "tree": tree_allreduce_time}[algorithm]
    # the L shard all-reduces run in parallel through one interface: bandwidth / L each
    inter = fn(nbytes / L, N, cluster.inter_bandwidth / L, cluster.inter_latency)
    return intra + inter


def step_time(compute_s: float, gossip_s: float, fixed_s: float = 0.0,
              mode: str = "overlap") -> float:
    """Time of one step: ``compute_s`` of compute, ``gossip_s`` of communication that can be
    scheduled against it, ``fixed_s`` that cannot (a blocking all-reduce inside the node).

    * ``blocking``: ``compute + gossip + fixed``;
    * ``overlap`` (posted before forward/backward, waited for after): ``max(compute, gossip) +
      fixed``;
    * ``delay_by_one`` (applied one step later: the exchange has a whole step):
      ``max(compute + fixed, gossip)``.

    Assumes communication progresses without slowing compute (DMA engines, a separate
    stream); where both share CPU cores (the emulated cluster) overlap hides less.

    >>> step_time(0.1, 0.3, 0.05, "blocking"), step_time(0.1, 0.3, 0.05, "overlap")
    (0.45, 0.35)
    >>> step_time(0.1, 0.3, 0.05, "delay_by_one")
    0.3
    """
    if mode == "blocking":
        return compute_s + gossip_s + fixed_s
    if mode == "overlap":
        return max(compute_s, gossip_s) + fixed_s
    if mode == "delay_by_one":
        return max(compute_s + fixed_s, gossip_s)
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def cross_node_sends(topo: _topology.Topology, gpus_per_node: int,
                     steps: int | None = None) -> tuple[float, int]:
    """``(cross, peers)`` of a topology over ranks numbered ``node * gpus_per_node + local``:
    ``cross`` the messages per step the busiest node sends to other nodes (mean over ``steps``
    steps of a time-varying topology; default 16, 4 above 256 ranks, where one step's count is
    already close to its mean), ``peers`` the most ranks any rank sends to per step.

    >>> cross_node_sends(_topology.build("ring", 4), 2)  # ring 0-1-2-3-0: 1-2 and 3-0 cross
    (2.0, 2)
    """
    n = topo.world_size
    if n <= 1:
        return 0.0, 0
    if steps is None:
        steps = 16 if n <= 256 else 4
    node = np.arange(n) // gpus_per_node
    other = node[:, None] != node[None, :]
    eye = np.eye(n, dtype=bool)
    cross, peers, first = [], 0, None
    for t in range(steps):
        send = (topo.mixing_matrix(t).T > 0) & ~eye  # send[i, j]: i sends to j
        if t == 1 and np.array_equal(send, first):
            break  # static topology
        first = send if t == 0 else first
        peers = max(peers, int(send.sum(axis=1).max()))
        per_node = np.bincount(node, weights=(send & other).sum(axis=1))
        cross.append(float(per_node.max()))
    return float(np.mean(cross)), peers


def consensus_steps(topo: _topology.Topology, tolerance: float = 1e-3) -> float:
    """Mixing steps for the RMS consensus error to fall by ``tolerance``, predicted from the
    topology's mean-square gap exactly as ``lightning-gossip topologies`` does
    (:func:`lightning_gossip.analysis.predicted_consensus_steps`).

    >>> round(consensus_steps(_topology.build("complete", 8)))
    1
    """
    from lightning_gossip.analysis import predicted_consensus_steps

    return predicted_consensus_steps(max(topo.mean_square_gap(), 0.0), tolerance)


def _consensus(topo: _topology.Topology, tolerance: float | None) -> float | None:
    """:func:`consensus_steps`, or ``None`` when ``tolerance`` is ``None``."""
    return None if tolerance is None else consensus_steps(topo, tolerance)


def straggler_factors(world_size: int, gpus_per_node: int, fraction: float = 0.0,
                      slowdown: float = 1.0) -> np.ndarray:
    """Compute-time factor of every rank: ``round(fraction * world_size)`` ranks are
    ``slowdown`` times slower, spread one per node first (local rank 0 of node 0, 1, ..., then
    local rank 1, ...): the worst case for the synchronous and hierarchical strategies.

    >>> straggler_factors(4, 2, 0.5, 3.0).tolist()
    [3.0, 1.0, 3.0, 1.0]
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"straggler fraction must be in [0, 1], got {fraction}")
    _check("straggler slowdown", slowdown, 1.0, strict=False)
    f = np.ones(world_size)
    order = sorted(range(world_size), key=lambda r: (r % gpus_per_node, r // gpus_per_node))
    f[order[: int(round(fraction * world_size))]] = slowdown
    return f


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


def predict_ddp(cluster: Cluster, workload: Workload, algorithm: str = "ring",
                stragglers: Sequence[float] | None = None) -> Prediction:
    """Data parallelism: an all-reduce of the gradients, blocking (``compute + all-reduce``; the
    bucketed overlap of DDP with backward is ignored, so this is an upper bound).

    * ``ring``: one ring over all ranks, numbered node by node; one rank per node sends to the
      next node, so the inter-node hop is the slowest link and each node sends
      ``2 (n - 1) / n`` gradients per step;
    * ``tree``: :func:`tree_allreduce_time` with the inter-node link;
    * ``hierarchical``: :func:`hierarchical_allreduce_time` (NCCL's choice on many nodes).

    Every rank waits for the slowest (``compute_s * max(stragglers)``).

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
    else:
        bw, lat = ((cluster.inter_bandwidth, cluster.inter_latency) if N > 1
                   else (cluster.intra_bandwidth, cluster.intra_latency))
        if algorithm == "ring":
            comm = ring_allreduce_time(g, n, bw, lat)
            per_node = 2 * (n - 1) / n * g if N > 1 else 0.0
        elif algorithm == "tree":
            comm = tree_allreduce_time(g, n, bw, lat)
            per_node = 2 * g if N > 1 else 0.0
        else:
            raise ValueError(f"algorithm must be ring, tree or hierarchical, got {algorithm!r}")
    compute = workload.compute_s * slow
    return Prediction(f"ddp ({algorithm})", compute + comm, comm, per_node / L, per_node, 0,
                      "exact average every step")


def predict_dpsgd(cluster: Cluster, workload: Workload, topology: str = "random_ring",
                  hierarchical: bool = False, mode: str = "overlap", seed: int = 0,
                  stragglers: Sequence[float] | None = None,
                  tolerance: float | None = 1e-3) -> Prediction:
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

    Every rank waits for the slowest (``compute_s * max(stragglers)``). Steps to consensus
    from the topology's gap (:func:`consensus_steps`; skipped with ``tolerance=None``).

    >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9)
    >>> w = Workload(params=1_000_000, compute_s=0.01)
    >>> predict_dpsgd(c, w, "ring", mode="blocking").step_s  # 0.01 + 4 MB at 1 GB/s
    0.014
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    N, L = cluster.nodes, cluster.gpus_per_node
    replica = workload.params * workload.wire_bytes
    slow = max(stragglers) if stragglers is not None and len(stragglers) else 1.0
    compute = workload.compute_s * slow
    if hierarchical:
        name = f"dpsgd hier ({topology}, {mode})"
        fixed = 0.0
        if L > 1:
            fixed = (ring_allreduce_time(workload.params * workload.grad_bytes, L,
                                         cluster.intra_bandwidth, cluster.intra_latency)
                     + (L - 1) * link_time(workload.params * 4 / L, cluster.intra_bandwidth,
                                           cluster.intra_latency))
        if N == 1:
            return Prediction(name, compute + fixed, fixed, 0.0, 0.0, 0,
                              "one node: plain data parallelism")
        topo = _topology.build(topology, N, seed)
        cross, peers = cross_node_sends(topo, 1)
        per_node = cross * replica
        gossip = link_time(per_node, cluster.inter_bandwidth, peers * cluster.inter_latency)
        step = step_time(compute, gossip, fixed, mode)
        return Prediction(name, step, step - compute, per_node / L, per_node,
                          _consensus(topo, tolerance), f"{peers} peer node(s)/step")
    name = f"dpsgd ({topology}, {mode})"
    n = cluster.world_size
    if n == 1:
        return Prediction(name, compute, 0.0, 0.0, 0.0, 0, "one rank")
    topo = _topology.build(topology, n, seed)
    cross, peers = cross_node_sends(topo, L) if N > 1 else (0.0, topo.degree(0))
    per_node = cross * replica
    inter = link_time(per_node, cluster.inter_bandwidth,
                      math.ceil(cross / L) * cluster.inter_latency)
    local_msgs = max(peers - (cross / L), 0.0)
    intra = link_time(local_msgs * replica, cluster.intra_bandwidth,
                      math.ceil(local_msgs) * cluster.intra_latency)
    gossip = max(inter, intra)
    step = step_time(compute, gossip, 0.0, mode)
    return Prediction(name, step, step - compute, per_node / L, per_node,
                      _consensus(topo, tolerance), f"{peers} peers/step")


def adpsgd_exchange_time(cluster: Cluster, workload: Workload, pairing: str = "ring",
                         hierarchical: bool = False) -> tuple[float, float]:
    """``(seconds, cross)`` of one exchange round of AD-PSGD, ``cross`` the fraction of the
    ranks' exchanges that cross nodes. An exchange swaps replicas with one partner (each side
    sends ``params * wire_bytes``); all ranks exchange at once.

    * flat, ``pairing="ring"`` (ranks in order, a partner next to it): ``1 / L`` of the pairs
      cross nodes (``0`` on one node); ``"random"``: a random other rank, ``(n - L) / (n - 1)``.
      The crossing exchanges of a node share its interface; the others use the intra link.
    * ``hierarchical``: nodes pair up; each GPU swaps its ``1/L`` shard, so a node sends one
      replica per exchange through its interface.

    >>> c = Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e12)
    >>> adpsgd_exchange_time(c, Workload(params=1_000_000, compute_s=0.1))  # 2 x 1/2 x 4 MB
    (0.16, 0.5)
    """
    N, L, n = cluster.nodes, cluster.gpus_per_node, cluster.world_size
    replica = workload.params * workload.wire_bytes
    if hierarchical:
        if N == 1:
            return 0.0, 0.0
        return link_time(replica, cluster.inter_bandwidth, cluster.inter_latency), 1.0
    if n == 1:
        return 0.0, 0.0
    if pairing == "ring":
        cross = 1.0 / L if N > 1 else 0.0
    elif pairing == "random":
        cross = (n - L) / (n - 1)
    else:
        raise ValueError(f"pairing must be ring or random, got {pairing!r}")
    inter = link_time(L * cross * replica, cluster.inter_bandwidth, cluster.inter_latency)
    intra = link_time(replica, cluster.intra_bandwidth, cluster.intra_latency)
    return max(inter if cross > 0 else 0.0, intra if cross < 1 else 0.0), cross


def predict_adpsgd(cluster: Cluster, workload: Workload, pairing: str = "ring",
                   hierarchical: bool = False, max_staleness: int | None = 4,
                   stragglers: Sequence[float] | None = None) -> Prediction:
    """Asynchronous gossip (AD-PSGD): the compute step never waits for gossip unless the
    exchanges cannot keep up. An exchange takes ``t_x`` (:func:`adpsgd_exchange_time`) and
    covers every step made before it started, so a rank whose compute step is ``c`` runs at
    ``max(c, t_x / max_staleness)`` (``c + t_x`` with ``max_staleness=0``, ``c`` with ``None``).
    Ranks do not wait for each other: the step rate is the **sum of the ranks' rates**, and
    ``step_s`` is ``world_size`` over that sum (synchronous strategies: the slowest rank's).
    With ``hierarchical``, the unit is the node: every step is the node's blocking gradient
    all-reduce plus all-gather (as in :func:`predict_dpsgd`) after its slowest GPU (a form that
    :class:`~lightning_gossip.ADPSGDStrategy` does not offer yet).

    Bytes per step: ``min(1, steps per exchange)`` exchanges, ``cross`` of them across nodes.

    >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9)
    >>> w = Workload(params=1_000_000, compute_s=0.01)
    >>> predict_adpsgd(c, w, max_staleness=0).step_s  # blocking: 0.01 + 4 ms
    0.014
    >>> predict_adpsgd(c, w, stragglers=[1.0, 3.0]).step_s  # 2 / (1/0.01 + 1/0.03)
    0.015
    """
    N, L, n = cluster.nodes, cluster.gpus_per_node, cluster.world_size
    f = np.ones(n) if stragglers is None else np.asarray(stragglers, dtype=float)
    if f.shape != (n,):
        raise ValueError(f"stragglers must have one factor per rank ({n}), got {f.shape}")
    t_x, cross = adpsgd_exchange_time(cluster, workload, hierarchical=hierarchical,
                                      pairing=pairing)
    fixed = 0.0
    if hierarchical:
        name = "adpsgd hier"
        if L > 1:
            fixed = (ring_allreduce_time(workload.params * workload.grad_bytes, L,
                                         cluster.intra_bandwidth, cluster.intra_latency)
                     + (L - 1) * link_time(workload.params * 4 / L, cluster.intra_bandwidth,
                                           cluster.intra_latency))
        compute = workload.compute_s * f.reshape(N, L).max(axis=1) + fixed  # per node
        units = L
    else:
        name = f"adpsgd ({pairing})"
        compute = workload.compute_s * f
        units = 1
    if max_staleness is None:
        steps = compute
    elif max_staleness == 0:
        steps = compute + t_x
    else:
        steps = np.maximum(compute, t_x / max_staleness)
    with np.errstate(divide="ignore"):  # a step of 0 s: an infinite rate, a mean of 0
        step = float(n / (units * (1.0 / steps).sum()))
        mean_compute = float(n / (units * (1.0 / compute).sum())) - fixed
    exchanges = float(min(1.0, step / t_x)) if t_x > 0 else 0.0
    replica = workload.params * workload.wire_bytes
    per_rank = exchanges * cross * replica / (L if hierarchical else 1)
    return Prediction(name, step, step - mean_compute, per_rank, per_rank * L, None,
                      f"{exchanges:.2f} exchanges/step, {cross:.2f} cross nodes")


def predict_all(cluster: Cluster, workload: Workload, topology: str = "random_ring",
                mode: str = "overlap", pairing: str = "ring", max_staleness: int | None = 4,
                stragglers: Sequence[float] | None = None, seed: int = 0,
                tolerance: float | None = 1e-3) -> list[Prediction]:
    """Every strategy on one cluster: ddp (ring, tree, hierarchical), dpsgd and adpsgd (flat
    and hierarchical).

    >>> c = Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e12)
    >>> [p.strategy for p in predict_all(c, Workload(params=1000, compute_s=0.1))][:3]
    ['ddp (ring)', 'ddp (tree)', 'ddp (hierarchical)']
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
