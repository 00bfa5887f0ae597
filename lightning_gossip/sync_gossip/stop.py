"""The agreed stop of synchronous gossip: one value, carried by the rounds' side messages, on
the step at which every rank acts (no Lightning here; the strategy's hooks are in
:mod:`lightning_gossip.strategies.dpsgd_stop`).

Two requests travel the same way: "stop at step s" and "requeue at step s". A rank that wants to
stop proposes :meth:`StopAgreement.stop_step_for` of the next round it sends, a step by which
every rank will have heard of it; the proposal rides along every round from then on (a
two-value side message: the smallest stop and requeue steps this rank knows of), and every rank
acts at the first step that is at least the smallest proposal it knows of, which is the same
step on every rank: a proposal ``p`` reaches every rank by step ``p``, so at the smallest
proposal every rank knows it, of either kind.

:class:`StopAgreement` is pure arithmetic plus two guarded numbers: a test builds it from a
topology and a :class:`~lightning_gossip.hierarchy.NodeLayout`, no process group needed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.exchange import post, wait_all
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.sync_gossip.schedule import RoundSchedule
from lightning_gossip.topology import Topology

__all__ = ["NO_STOP", "STOP_TAG", "StopAgreement", "StopMessages"]

log = logging.getLogger(__name__)

#: "no stop agreed" in the stop messages
NO_STOP = 2**62
#: the tag of the stop messages (apart from the replicas' tag 0)
STOP_TAG = 7


@dataclass
class StopMessages:
    """One round's side messages: what this rank sent (``[stop_at, requeue_at]``), what it
    receives, the works."""

    send: Tensor
    recv: list[tuple[int, Tensor]]
    works: list = field(default_factory=list)

    def received(self) -> tuple[int, int]:
        """The smallest ``(stop_at, requeue_at)`` received (:data:`NO_STOP` if none)."""
        stop = min((int(buf[0].item()) for _, buf in self.recv), default=NO_STOP)
        requeue = min((int(buf[1].item()) for _, buf in self.recv), default=NO_STOP)
        return stop, requeue


class StopAgreement:
    """The smallest stop and requeue steps this rank knows of, and when a proposal reaches
    every rank.

    Args:
        topology: the topology the rounds follow (over nodes when ``layout.devices > 1``).
        layout: the ranks' layout: ``NodeLayout(world, 1, rank, 0)`` when flat.
        delay_by_one: the rounds apply their change one step later (a proposal spreads
            half as fast).
        schedule: when the rounds are posted and applied (a gossip period); default: a round
            every step, overlapped (blocking rounds spread a proposal alike at period 1), with
            ``delay_by_one``.

    ``stop_at`` and ``requeue_at`` are read and written under one lock: the training thread
    proposes, the communication thread merges what the peers sent.
    """

    def __init__(self, topology: Topology, layout: NodeLayout,
                 delay_by_one: bool = False, schedule: RoundSchedule | None = None) -> None:
        self.topology = topology
        self.layout = layout
        self.schedule = (schedule if schedule is not None
                         else RoundSchedule(1, overlap=True, delay_by_one=bool(delay_by_one)))
        self.delay_by_one = self.schedule.delay_by_one
        self.world_size = layout.num_nodes * layout.devices
        #: the ranks the rounds connect (an elastic fit's survivors: a
        #: :class:`~lightning_gossip.topology.MemberTopology`'s members, or their nodes' ranks;
        #: else every rank)
        d = layout.devices
        self.ranks = tuple(n * d + k for n in getattr(topology, "members", range(layout.num_nodes))
                           for k in range(d))
        self._lock = threading.Lock()
        self.stop_at = NO_STOP
        self.requeue_at = NO_STOP

    def reschedule(self, schedule: RoundSchedule) -> None:
        """The rounds follow ``schedule`` from now on (a new gossip period; no proposal known)."""
        self.schedule = schedule

    def reset(self) -> None:
        """Forget every proposal (a new fit)."""
        with self._lock:
            self.stop_at = self.requeue_at = NO_STOP

    @property
    def lag(self) -> int:
        """With a round every step: steps from posting a round to the first step start after it
        was applied, minus one: 2 with ``delay_by_one`` (a round received at step t+1 goes out
        again at t+2), else 1. (A gossip period: :attr:`schedule` says when rounds go.)"""
        return 2 if self.delay_by_one else 1

    def values(self) -> tuple[int, int]:
        """``(stop_at, requeue_at)``, read together."""
        with self._lock:
            return self.stop_at, self.requeue_at

    def merge(self, stop: int, requeue: int) -> None:
        """Keep the smaller of the known and the given steps."""
        with self._lock:
            self.stop_at = min(self.stop_at, stop)
            self.requeue_at = min(self.requeue_at, requeue)

    def propose(self, kind: str, rank: int, first_round: int) -> int:
        """``rank`` proposes to stop (``kind="stop"``) or requeue, putting it into its stop
        messages of the rounds posted from step ``first_round`` on; returns the proposed
        step."""
        if kind not in ("stop", "requeue"):
            raise ValueError(f"kind must be 'stop' or 'requeue', got {kind!r}")
        proposal = self.stop_step_for(rank, first_round)
        if kind == "stop":
            self.merge(proposal, NO_STOP)
        else:
            self.merge(NO_STOP, proposal)
        return proposal

    def stop_due(self, step: int) -> bool:
        """Whether every rank stops at ``step`` (the agreed stop step is reached)."""
        with self._lock:
            return step >= self.stop_at

    def requeue_due(self, step: int) -> bool:
        """Whether every rank requeues at ``step``."""
        with self._lock:
            return step >= self.requeue_at

    def peers(self, rank: int, step: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(send_to, recv_from)`` ranks of ``rank``'s stop messages in round ``step``: its
        replica peers (flat), or its column peers plus its node's other ranks (sharded)."""
        devices = self.layout.devices
        node, local = divmod(rank, devices)
        peers = self.topology.peers(node, step)
        mates = tuple(node * devices + k for k in range(devices) if k != local)
        send_to = tuple(r * devices + local for r in peers.send_to) + mates
        recv_from = tuple(j * devices + local for j in peers.recv_ranks) + mates
        return send_to, recv_from

    def stop_step_for(self, rank: int, first_round: int) -> int:
        """The first step at which every rank knows a stop that ``rank`` puts into its stop
        messages of the rounds posted from step ``first_round`` on.

        Simulates the spreading along the actual rounds (the topology at every exchange step,
        which every rank can compute), so it is exact for static and time-varying topologies
        and any gossip period alike: a rank forwards what it knew when it posted a round, and
        knows what a round brought from the step after the one that applied it. At most
        ``(world_size - 1)`` rounds when every round's graph is connected (twice that with
        ``delay_by_one``). Raises ``RuntimeError`` when the rounds do not connect the ranks
        within ``200 * world_size`` rounds.
        """
        ranks, schedule = self.ranks, self.schedule
        known = {rank: first_round}  # rank -> the first step whose posts carry the stop
        e = schedule.first_round_posted_from(first_round)
        limit = e + 200 * len(ranks) * schedule.period
        while len(known) < len(ranks):
            if e > limit:
                raise RuntimeError(
                    f"the stop proposed by rank {rank} at step {first_round} does not reach "
                    f"ranks {sorted(set(ranks) - set(known))} within {limit - first_round} "
                    "steps: the rounds do not connect the ranks")
            posted, known_from = schedule.post_step(e), schedule.apply_step(e) + 1
            heard = {}
            for j in ranks:
                if j in known:
                    continue
                _, recv_from = self.peers(j, e)
                if any(i in known and known[i] <= posted for i in recv_from):
                    heard[j] = known_from
            known.update(heard)
            e += schedule.period
        return max(known.values())

    # ------------------------------------------------------------------------------------------
    # The side messages of every round
    # ------------------------------------------------------------------------------------------
    def post(self, rank: int, step: int, group: dist.ProcessGroup,
             device: torch.device) -> StopMessages:
        """Post round ``step``'s side messages of ``rank`` (non-blocking, on ``group``)."""
        send_to, recv_from = self.peers(rank, step)
        send = torch.tensor(list(self.values()), dtype=torch.int64, device=device)
        recv = [(j, torch.empty(2, dtype=torch.int64, device=device)) for j in recv_from]
        msgs = StopMessages(send, recv)
        msgs.works = post(send, send_to, recv, group, tag=STOP_TAG)
        return msgs

    def wait_and_merge(self, msgs: StopMessages, timeout: timedelta, rank: int,
                       step: int) -> None:
        """Wait (plainly, up to ``timeout``) for a round's stop messages and keep the smallest
        steps heard of."""
        ranks = sorted({j for j, _ in msgs.recv})
        wait_all(msgs.works, timeout,
                 f"stop messages of rank {rank} with ranks {ranks} at step {step}")
        self.merge(*msgs.received())
