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

**Gossip period.** With ``period=n`` (a strategy's ``gossip_every_n_steps``) the gossip rows
exchange once every ``n`` steps and the exchange has the ``n`` steps of its period to hide
behind: per step, its time, host work and bytes are divided by ``n`` (ddp has no period).
:func:`cluster_ratio` is the cluster's R (one bf16 replica over the inter-node link against a
step's compute); :func:`predict_periods` gives the gossip rows at the period that
``gossip_every_n_steps="auto"`` picks (:mod:`lightning_gossip.gossip_period`): one for all
ranks of ``dpsgd``, each rank its own under ``adpsgd`` (:func:`adpsgd_auto_periods`: with
stragglers, a slow rank a shorter one). The simulator (:mod:`lightning_gossip.sim`) models the
same periods and, given the exchange time, the same step times.

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

from lightning_gossip.plan.blocks import (
    consensus_steps,
    cross_node_sends,
    hierarchical_allreduce_time,
    link_time,
    ring_allreduce_time,
    staleness_bound,
    step_time,
    straggler_factors,
    tree_allreduce_time,
)
from lightning_gossip.plan.model import MODES, Cluster, Prediction, Workload
from lightning_gossip.plan.period import (
    adpsgd_auto_periods,
    auto_period,
    cluster_period,
    cluster_ratio,
    predict_periods,
    replica_seconds,
)
from lightning_gossip.plan.predict import (
    adpsgd_exchange_time,
    adpsgd_rank_compute,
    predict_adpsgd,
    predict_all,
    predict_ddp,
    predict_dpsgd,
)

__all__ = [
    "MODES",
    "Cluster",
    "Prediction",
    "Workload",
    "adpsgd_auto_periods",
    "adpsgd_exchange_time",
    "adpsgd_rank_compute",
    "auto_period",
    "cluster_period",
    "cluster_ratio",
    "consensus_steps",
    "cross_node_sends",
    "hierarchical_allreduce_time",
    "link_time",
    "predict_adpsgd",
    "predict_all",
    "predict_ddp",
    "predict_dpsgd",
    "predict_periods",
    "replica_seconds",
    "ring_allreduce_time",
    "staleness_bound",
    "step_time",
    "straggler_factors",
    "tree_allreduce_time",
]
