"""The building blocks of the cost model: alpha-beta link and all-reduce times, the step time of
a scheduling mode, the cross-node sends of a topology, its consensus steps, straggler factors."""

from __future__ import annotations

import math

import numpy as np

from lightning_gossip import topology as _topology
from lightning_gossip.plan.model import MODES, Cluster, Mode, _check


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
              mode: Mode = "overlap", overlap: float = 1.0) -> float:
    """Time of one step: ``compute_s`` of compute, ``gossip_s`` of communication that can be
    scheduled against it, ``fixed_s`` that cannot (a blocking all-reduce inside the node), and
    ``overlap`` the fraction of the schedulable part that really runs hidden
    (:attr:`Cluster.overlap`; 1 on GPUs):

    * ``blocking``: ``compute + gossip + fixed``;
    * ``overlap`` (posted before forward/backward, waited for after):
      ``compute + gossip + fixed - overlap * min(compute, gossip)``, which is
      ``max(compute, gossip) + fixed`` with ``overlap=1``;
    * ``delay_by_one`` (applied one step later: the exchange has a whole step):
      ``compute + fixed + gossip - overlap * min(compute + fixed, gossip)``, which is
      ``max(compute + fixed, gossip)`` with ``overlap=1``.

    ``overlap < 1`` models communication that needs the cores compute runs on (the emulated
    cluster: gloo's threads and the kernel's TCP work on 2 CPU cores shared by 4 ranks).

    >>> step_time(0.1, 0.3, 0.05, "blocking"), step_time(0.1, 0.3, 0.05, "overlap")
    (0.45, 0.35)
    >>> step_time(0.1, 0.3, 0.05, "delay_by_one")
    0.3
    >>> round(step_time(0.1, 0.3, 0.05, "overlap", overlap=0.5), 6)  # half of 0.1 s hidden
    0.4
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    if mode == "blocking":
        return compute_s + gossip_s + fixed_s
    if mode == "overlap":
        if overlap == 1.0:
            return max(compute_s, gossip_s) + fixed_s
        return compute_s + gossip_s + fixed_s - overlap * min(compute_s, gossip_s)
    if mode == "delay_by_one":
        if overlap == 1.0:
            return max(compute_s + fixed_s, gossip_s)
        return compute_s + fixed_s + gossip_s - overlap * min(compute_s + fixed_s, gossip_s)
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def staleness_bound(exchange_s: float, max_staleness: int | None) -> float:
    """Shortest mean step of an AD-PSGD rank whose gossip thread runs exchanges of
    ``exchange_s`` back to back under the bound ``max_staleness`` (``m``):
    ``3 exchange_s / (m + 2)`` for ``m >= 1``; ``exchange_s`` for ``m = 0`` (every step waits
    for a whole exchange); 0 without a bound (``None``).

    Why not ``exchange_s / m``: the training thread waits while ``steps - gossiped > m``, where
    ``gossiped`` is the step count of the snapshot the last *finished* exchange sent, and it
    leaves a new snapshot only at the first step boundary after the gossip thread took the
    previous one (``DeltaMailbox.leave_snapshot``), so a snapshot is already stale when its
    exchange starts. Stepping through those rules with fast compute, the waits repeat every 3
    exchanges and ``m + 2`` steps (``m = 4``: waits at steps 5, 6, 7, then 11, 12, 13, ...:
    2 steps per exchange). So at the bound a rank takes part in ``3 / (m + 2)`` exchanges per
    step (0.5 for the default ``m = 4``), which is what the emulated cluster measured
    (inter-node bytes per step 0.45-0.56 of one exchange per step, docs/plan.md).

    >>> staleness_bound(0.3, 4), staleness_bound(0.3, 1), staleness_bound(0.3, None)
    (0.15, 0.3, 0.0)
    """
    if max_staleness is None:
        return 0.0
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness!r}")
    if max_staleness == 0:
        return exchange_s
    return 3.0 * exchange_s / (max_staleness + 2)


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

