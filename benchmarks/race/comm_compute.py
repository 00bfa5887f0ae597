"""R, the ratio that decides a race: one bf16 replica's time on the inter-node link over one
compute step, measured in the race itself (issue 47, deliverable 3).

``R = replica_transfer_s / compute_step_s``:

* ``replica_transfer_s``: a buffer of a bf16 replica's bytes (2 bytes per parameter) sent once
  over the emulated inter-node link, after the link is shaped, from node 1's local rank 0 to
  node 0's local rank 0 through gloo (the race's own process group; every other rank waits in
  a barrier, so nothing else is on the link), answered by a 1-byte acknowledgement. The
  sender's clock runs from the send to the acknowledgement; half of the median 1-byte round
  trip measured just before is taken off, so the term is the one-way time of the replica,
  its first byte's latency included. Median of ``repeats`` sends.
* ``compute_step_s``: the local step (forward, backward, optimizer step; no communication) of
  the race's model with every rank computing at once (the same case layout, the same pinning),
  a barrier before each step: ``worker.calibrate``'s lockstep timing; the median over ranks.

Collective functions take the race's process group; :func:`ratio` and :func:`combine` are
pure.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

HOW = ("R = replica_transfer_s / compute_step_s. replica_transfer_s: a buffer of a bf16 "
       "replica's bytes (2 per parameter) sent over the emulated link from node 1's local rank "
       "0 to node 0's (gloo; every other rank in a barrier), the sender timing the send and a "
       "1-byte acknowledgement, half the median 1-byte round trip taken off; median of the "
       "sends. compute_step_s: the local step (forward, backward, optimizer step, no "
       "communication) of the race's model with every rank computing in lockstep (the case "
       "layout, its pinning), median over ranks. Measured once per launch, before the cases.")
"""How R is measured, in words (the record's ``comm_compute.how``)."""


def ratio(transfer_s: float | None, compute_s: float | None) -> float | None:
    """R from its two terms (None where either is missing or the step is not positive).

    >>> ratio(0.196, 0.357), ratio(None, 0.3), ratio(0.2, 0.0)
    (0.549, None, None)
    """
    if transfer_s is None or compute_s is None or compute_s <= 0:
        return None
    return round(transfer_s / compute_s, 3)


def combine(measurements: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """A record's R from its launches' measurements: the median of each term, and R of the
    medians (None when no launch measured it).

    >>> combine([{"replica_bytes": 8, "replica_transfer_s": 0.2, "compute_step_s": 0.4},
    ...          {"replica_bytes": 8, "replica_transfer_s": 0.3, "compute_step_s": 0.35},
    ...          None])["comm_compute_ratio"]
    0.667
    """
    known = [m for m in measurements if m and m.get("replica_transfer_s") is not None
             and m.get("compute_step_s")]
    if not known:
        return None
    transfer = statistics.median(m["replica_transfer_s"] for m in known)
    compute = statistics.median(m["compute_step_s"] for m in known)
    transfer, compute = round(transfer, 6), round(compute, 6)
    return {"comm_compute_ratio": ratio(transfer, compute),
            "replica_bytes": known[0].get("replica_bytes"),
            "replica_transfer_s": transfer, "compute_step_s": compute,
            "launches": len(known), "how": HOW}


def _median_over_ranks(value: float, group: Any, world: int) -> float:
    """Every rank's ``value`` gathered (collective); their median."""
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64), group=group)
    return statistics.median(float(v[0]) for v in values)


def replica_transfer_s(group: Any, rank: int, world: int, sender: int, receiver: int,
                       nbytes: int, repeats: int = 3) -> dict[str, float]:
    """One-way time of ``nbytes`` from global rank ``sender`` to ``receiver`` (collective over
    ``group``: every rank calls it; the others wait in barriers). Every rank gets
    ``{"transfer_s", "ack_rtt_s", "sends_s"}`` (the sender's figures)."""
    one = torch.zeros(1, dtype=torch.uint8)
    buf = torch.zeros(int(nbytes), dtype=torch.uint8)
    rtts: list[float] = []
    sends: list[float] = []
    dist.barrier(group=group)
    for payload, out in [(one, rtts)] * (repeats + 1) + [(buf, sends)] * repeats:
        if rank == sender:
            t0 = time.perf_counter()
            dist.send(payload, dst=receiver, group=group)
            dist.recv(one, src=receiver, group=group)
            out.append(time.perf_counter() - t0)
        elif rank == receiver:
            dist.recv(payload, src=sender, group=group)
            dist.send(one, dst=sender, group=group)
        dist.barrier(group=group)
    figures = torch.zeros(3, dtype=torch.float64)
    if rank == sender:
        rtt = statistics.median(rtts[1:])  # the first round trip opens the pair's connection
        send = statistics.median(sends)
        figures = torch.tensor([max(0.0, send - rtt / 2), rtt, send], dtype=torch.float64)
    dist.all_reduce(figures, group=group)  # only the sender's are non-zero
    return {"transfer_s": round(float(figures[0]), 5), "ack_rtt_s": round(float(figures[1]), 6),
            "sends_s": round(float(figures[2]), 5)}


def measure(group: Any, rank: int, world: int, procs: int, nodes: int, params: int,
            local_step_s: float) -> dict[str, Any]:
    """R and its terms for this launch (collective over ``group``): ``local_step_s`` is this
    rank's lockstep compute step; the replica is ``params`` parameters in bf16."""
    compute = round(_median_over_ranks(local_step_s, group, world), 6)
    out: dict[str, Any] = {"replica_bytes": 2 * int(params), "compute_step_s": compute,
                           "replica_transfer_s": None, "comm_compute_ratio": None}
    if nodes < 2:
        return out
    transfer = replica_transfer_s(group, rank, world, sender=procs, receiver=0,
                                  nbytes=2 * int(params))
    out.update(replica_transfer_s=transfer["transfer_s"], ack_rtt_s=transfer["ack_rtt_s"],
               send_and_ack_s=transfer["sends_s"],
               comm_compute_ratio=ratio(transfer["transfer_s"], compute))
    return out
