"""The cost model's inputs and outputs: the :class:`Cluster` and :class:`Workload` it is given,
the :class:`Prediction` row it returns, and the scheduling :data:`MODES`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

#: how gossip is scheduled against compute: ``overlap`` (posted before forward/backward, the
#: strategy's default), ``delay_by_one`` (applied a step later), ``blocking`` (neither)
Mode = Literal["overlap", "delay_by_one", "blocking"]
MODES: tuple[Mode, ...] = ("overlap", "delay_by_one", "blocking")


def _check_period(period: int) -> None:
    """``ValueError`` unless ``period`` (local steps between gossip exchanges) is an int >= 1."""
    if not isinstance(period, (int, np.integer)) or isinstance(period, bool) or period < 1:
        raise ValueError(f"period must be an integer >= 1, got {period!r}")


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

    Three properties of the hosts say how much communication costs besides the links:

    * ``overlap`` (0 to 1): the fraction of the communication a strategy schedules against
      compute that really runs hidden behind it. 1 (the default) on GPUs, where DMA engines and
      a separate stream move the bytes while the GPU computes; possibly lower where compute
      and communication share the same CPU cores (on the emulated cluster, 2 cores for 4
      ranks, the calibration gives 1 once the host and link terms are right: docs/plan.md).
    * ``host_bandwidth`` (bytes/s): how fast one rank's CPU pushes bytes through the
      communication stack (copies into and out of the transport, the kernel's socket copies,
      reductions). Every byte a rank sends or receives costs ``1 / host_bandwidth`` s of that
      rank's CPU time, added to its compute and never hidden. ``inf`` (the default): NCCL on
      GPUs, where the host does not touch the bytes.
    * ``ddp_host_bandwidth`` (bytes/s): the same for the bytes of ddp's gradient all-reduce
      (``None``, the default: ``host_bandwidth``). A separate constant because gloo's ring
      all-reduce reduces in place in pipelined chunks, and PyTorch DDP starts it during
      backward, so it costs the host less per byte than a gossip exchange (packed into a
      buffer, swapped, mixed, handed over as a delta). The all-reduce and all-gather inside a
      node of the hierarchical strategies stay on ``host_bandwidth``: they run between gossip
      exchanges, on the same cores.

    One property of the inter-node links:

    * ``exchange_efficiency`` ``d`` (0 to 1]: the fraction of ``inter_bandwidth`` one process's
      gossip exchanges get in each direction, where two ranks send each other a replica at once
      over one connection (dpsgd's neighbour exchanges, adpsgd's swaps, flat and hierarchical).
      1 (the default): full duplex at the full rate. 0.5: the process moves its bytes one
      direction at a time, so a direction of the interface is busy half the time. The
      ``gpus_per_node`` processes of a node drive its interface independently, so the node gets
      ``1 - (1 - d) ** gpus_per_node`` of the rate for exchanges
      (:attr:`exchange_bandwidth`). Calibrated on the emulated cluster (gloo over TCP through
      ``tbf`` shapers: 0.45, docs/plan.md); ddp's ring all-reduce (each connection one way,
      pipelined chunks) keeps the full rate.

    >>> Cluster(nodes=0, gpus_per_node=8, inter_bandwidth=1e9)
    Traceback (most recent call last):
    ...
    ValueError: nodes must be an integer >= 1, got 0
    >>> Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9, overlap=1.5)
    Traceback (most recent call last):
    ...
    ValueError: overlap must be in [0, 1], got 1.5
    """

    nodes: int
    gpus_per_node: int
    inter_bandwidth: float
    inter_latency: float = 0.0
    intra_bandwidth: float = 150e9
    intra_latency: float = 0.0
    overlap: float = 1.0
    host_bandwidth: float = math.inf
    ddp_host_bandwidth: float | None = None
    exchange_efficiency: float = 1.0

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        _check("inter_bandwidth (bytes/s)", self.inter_bandwidth)
        _check("intra_bandwidth (bytes/s)", self.intra_bandwidth)
        _check("inter_latency (s)", self.inter_latency, strict=False)
        _check("intra_latency (s)", self.intra_latency, strict=False)
        if not (isinstance(self.overlap, (int, float)) and 0.0 <= self.overlap <= 1.0):
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
        if not self.host_bandwidth > 0:  # also refuses NaN; inf is allowed (free)
            raise ValueError(
                f"host_bandwidth (bytes/s) must be > 0 (inf: free), got {self.host_bandwidth!r}")
        coll = self.ddp_host_bandwidth
        if coll is not None and not coll > 0:
            raise ValueError("ddp_host_bandwidth (bytes/s) must be > 0 (inf: free; None: "
                             f"host_bandwidth), got {coll!r}")
        eff = self.exchange_efficiency
        if not (isinstance(eff, (int, float)) and 0.0 < eff <= 1.0):
            raise ValueError(f"exchange_efficiency must be in (0, 1], got {eff!r}")

    def host_time(self, nbytes: float) -> float:
        """CPU seconds one rank spends moving ``nbytes`` (sent plus received) through the
        communication stack: ``nbytes / host_bandwidth`` (0 with the default ``inf``).

        >>> Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9, host_bandwidth=1e8).host_time(
        ...     4e6)
        0.04
        """
        return 0.0 if math.isinf(self.host_bandwidth) else nbytes / self.host_bandwidth

    def ddp_host_time(self, nbytes: float) -> float:
        """CPU seconds one rank spends on ``nbytes`` (sent plus received) of ddp's all-reduce:
        ``nbytes / ddp_host_bandwidth`` (:meth:`host_time` when that is ``None``).

        >>> Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9, host_bandwidth=1e8,
        ...         ddp_host_bandwidth=4e8).ddp_host_time(4e6)
        0.01
        """
        bw = self.ddp_host_bandwidth
        if bw is None:
            return self.host_time(nbytes)
        return 0.0 if math.isinf(bw) else nbytes / bw

    @property
    def exchange_bandwidth(self) -> float:
        """Bytes/s of one node's interface for gossip exchanges, each direction:
        ``inter_bandwidth * (1 - (1 - exchange_efficiency) ** gpus_per_node)``.

        >>> Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=1e9,
        ...         exchange_efficiency=0.5).exchange_bandwidth  # 1 - 0.5 ** 2
        750000000.0
        """
        idle = (1.0 - self.exchange_efficiency) ** self.gpus_per_node
        return self.inter_bandwidth * (1.0 - idle)

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
    links per rank and per node, and mixing steps to consensus (``None``: not applicable).

    The gossip rows also say at which ``period`` (``gossip_every_n_steps``: local steps between
    exchanges) they were predicted and give the two numbers the period policy
    (:func:`lightning_gossip.gossip_period.choose_period`) takes, as a strategy measures them:
    ``exchange_s``, one exchange (its link time plus its host work), and ``compute_s``, the
    compute per step it can hide behind in the row's scheduling mode (both 0 for ddp, which
    has no period)."""

    strategy: str
    step_s: float
    exposed_s: float
    inter_bytes_per_rank: float
    inter_bytes_per_node: float
    consensus_steps: float | None = None
    note: str = ""
    period: int = 1
    compute_s: float = 0.0
    exchange_s: float = 0.0

    def as_dict(self) -> dict:
        """The row as a JSON-ready dict."""
        return asdict(self)

