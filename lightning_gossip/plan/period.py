"""The gossip period in the cost model: the ratio R of a cluster, and the gossip rows of
``lightning-gossip plan`` at the period ``gossip_every_n_steps="auto"`` picks, with the
strategies' own policy (:func:`lightning_gossip.gossip_period.choose_period`), so that the plan
and a strategy given the same two numbers pick the same period.

**R of a cluster** (:func:`cluster_ratio`): the time to send one bf16 replica
(``2 params`` bytes) over a node's inter-node link, ``inter_latency + 2 params /
inter_bandwidth``, over the compute of one step (``Workload.compute_s``). The reference is the
same whatever the strategy (the wire dtype, the topology and the exchange efficiency are left
out), so R compares clusters and workloads: below 1 a hierarchical bf16 exchange with one peer
node hides behind one step; above 1 it needs about R steps between exchanges.

**Each strategy's period** (:func:`auto_period`): the policy given the two numbers a strategy
measures in its first steps, as the model predicts them for that row
(:attr:`Prediction.exchange_s`, :attr:`Prediction.compute_s`): one exchange as the row sends it
(its wire dtype, its peers, its shards, its host work) and the compute per step it hides
behind in the row's scheduling mode. ``dpsgd``'s ranks agree on one period (the slowest
rank's compute decides); ``adpsgd``'s ranks decide each for itself
(:func:`adpsgd_auto_periods`), so with stragglers its rows carry one period per rank, a
straggler's shorter, as the strategy and the simulator (:mod:`lightning_gossip.sim.period`)
pick them.

>>> from lightning_gossip.plan.model import Cluster, Workload
>>> c = Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6)
>>> w = Workload(params=2_450_000, compute_s=0.1, wire_bytes=2)
>>> round(cluster_ratio(c, w), 3)  # 4.9 MB at 25 MB/s: 0.196 s over 0.1 s
1.96
>>> [(r.strategy, r.period) for r in predict_periods(c, w, topology="ring")]
... # doctest: +NORMALIZE_WHITESPACE
[('dpsgd (ring, overlap)', 5), ('dpsgd hier (ring, overlap)', 3), ('adpsgd (ring)', 3),
 ('adpsgd hier', 3)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from lightning_gossip.gossip_period import DEFAULT_MARGIN, DEFAULT_MAX_PERIOD, choose_period
from lightning_gossip.pairing import PairingName
from lightning_gossip.plan.blocks import link_time
from lightning_gossip.plan.model import Cluster, Mode, Prediction, Workload
from lightning_gossip.plan.predict import adpsgd_rank_compute, predict_adpsgd, predict_dpsgd

__all__ = ["adpsgd_auto_periods", "auto_period", "cluster_period", "cluster_ratio",
           "predict_periods", "replica_seconds"]

#: the wire of R's reference replica: bf16, 2 bytes per value
_BF16 = 2


def replica_seconds(cluster: Cluster, workload: Workload) -> float:
    """Seconds to send one bf16 replica (``2 params`` bytes) over a node's inter-node link:
    ``inter_latency + 2 params / inter_bandwidth`` (the full rate: no exchange efficiency).

    >>> from lightning_gossip.plan.model import Cluster, Workload
    >>> replica_seconds(Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9,
    ...                         inter_latency=1e-3), Workload(params=1_000_000, compute_s=0.1))
    0.003
    """
    return link_time(workload.params * _BF16, cluster.inter_bandwidth, cluster.inter_latency)


def cluster_ratio(cluster: Cluster, workload: Workload) -> float:
    """R of the cluster: :func:`replica_seconds` over ``workload.compute_s`` (``inf`` for a
    compute time of 0).

    >>> from lightning_gossip.plan.model import Cluster, Workload
    >>> cluster_ratio(Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9),
    ...                    Workload(params=1_000_000, compute_s=0.001))  # 2 ms / 1 ms
    2.0
    """
    x = replica_seconds(cluster, workload)
    if workload.compute_s <= 0:
        return math.inf if x > 0 else 0.0
    return x / workload.compute_s


def cluster_period(cluster: Cluster, workload: Workload, margin: float = DEFAULT_MARGIN,
                   max_period: int = DEFAULT_MAX_PERIOD) -> int:
    """The period ``"auto"`` picks for the cluster's R: the policy given one bf16 replica's
    time over the link (:func:`replica_seconds`) and ``workload.compute_s``; ``max_period``
    for a compute time of 0.

    >>> from lightning_gossip.plan.model import Cluster, Workload
    >>> cluster_period(Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9),
    ...                Workload(params=1_000_000, compute_s=0.001))  # R = 2, margin 1.1
    3
    """
    if workload.compute_s <= 0:
        return max_period
    return choose_period(workload.compute_s, replica_seconds(cluster, workload), margin=margin,
                         max_period=max_period)


def auto_period(row: Prediction, margin: float = DEFAULT_MARGIN,
                max_period: int = DEFAULT_MAX_PERIOD) -> int:
    """The period ``"auto"`` picks for a gossip row predicted at period 1: the policy
    (:func:`~lightning_gossip.gossip_period.choose_period`) given the row's ``compute_s`` and
    ``exchange_s``. 1 for a row without an exchange; ``max_period`` for one without compute.

    >>> auto_period(Prediction("dpsgd", 0.3, 0.2, 0, 0, compute_s=0.1, exchange_s=0.25))
    3
    """
    if row.exchange_s <= 0:
        return 1
    if row.compute_s <= 0:
        return max_period
    return choose_period(row.compute_s, row.exchange_s, margin=margin, max_period=max_period)


def predict_periods(cluster: Cluster, workload: Workload, period: int | Literal["auto"] = "auto",
                    topology: str = "random_ring", mode: Mode = "overlap",
                    pairing: PairingName = "ring", max_staleness: int | None = 4,
                    stragglers: Sequence[float] | None = None, seed: int = 0,
                    tolerance: float | None = 1e-3, margin: float = DEFAULT_MARGIN,
                    max_period: int = DEFAULT_MAX_PERIOD) -> list[Prediction]:
    """The gossip rows of :func:`~lightning_gossip.plan.predict_all` (dpsgd and adpsgd, flat
    and hierarchical) at ``period`` local steps between exchanges, or with ``"auto"`` at the
    period each row's own measurements give (:func:`auto_period` of its prediction at period
    1; ``adpsgd``: each rank's own, :func:`adpsgd_auto_periods`, so with stragglers the row
    has one period per rank). ``margin`` and ``max_period``: those of the policy."""
    if period != "auto" and (not isinstance(period, int) or isinstance(period, bool)
                             or period < 1):
        raise ValueError(f"period must be an integer >= 1 or 'auto', got {period!r}")
    def at(kind: str, hier: bool, n: int | np.ndarray) -> Prediction:
        if kind == "dpsgd":
            return predict_dpsgd(cluster, workload, topology, hier, mode, seed, stragglers,
                                 tolerance, period=n)
        return predict_adpsgd(cluster, workload, pairing, hier, max_staleness, stragglers,
                              period=n)

    out = []
    for kind in ("dpsgd", "adpsgd"):
        for hier in (False, True):
            row = at(kind, hier, 1)
            n: int | np.ndarray = period if period != "auto" else (
                auto_period(row, margin, max_period) if kind == "dpsgd" else
                adpsgd_auto_periods(cluster, workload, pairing, hier, stragglers, margin,
                                    max_period))
            if isinstance(n, np.ndarray) and (n == n[0]).all():
                n = int(n[0])  # every rank the same: the row of one period
            out.append(row if isinstance(n, int) and n == 1 else at(kind, hier, n))
    return out


def adpsgd_auto_periods(cluster: Cluster, workload: Workload, pairing: PairingName = "ring",
                        hierarchical: bool = False, stragglers: Sequence[float] | None = None,
                        margin: float = DEFAULT_MARGIN,
                        max_period: int = DEFAULT_MAX_PERIOD) -> np.ndarray:
    """The period ``"auto"`` picks on each rank of AD-PSGD (one per rank): every rank decides
    for itself, from its own compute per step
    (:func:`~lightning_gossip.plan.predict.adpsgd_rank_compute`: a straggler's is longer, so
    its period shorter; hierarchical, the ranks of a node the same) and the time of one
    exchange (the row's :attr:`Prediction.exchange_s`, the same for every rank). 1 without an
    exchange; ``max_period`` for a rank without compute.

    >>> from lightning_gossip.plan.model import Cluster, Workload
    >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=25e6)
    >>> w = Workload(params=1_000_000, compute_s=0.025, wire_bytes=2)  # exchange: 0.08 s
    >>> adpsgd_auto_periods(c, w).tolist(), adpsgd_auto_periods(c, w, stragglers=[1, 4]
    ...                                                          ).tolist()
    ([4, 4], [4, 1])
    """
    exchange = predict_adpsgd(cluster, workload, pairing, hierarchical,
                              stragglers=stragglers).exchange_s
    compute = adpsgd_rank_compute(cluster, workload, hierarchical, stragglers)
    if exchange <= 0:
        return np.ones(len(compute), dtype=np.int64)
    return np.array([choose_period(c, exchange, margin=margin, max_period=max_period)
                     if c > 0 else max_period for c in compute], dtype=np.int64)
