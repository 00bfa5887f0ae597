"""Stopping and requeueing together under :class:`~lightning_gossip.strategies.DPSGDStrategy`,
as a mixin: one agreement, carried by the gossip messages, on the step at which every rank acts.

Two requests travel the same way: "stop at step s" (SIGTERM: every rank raises Lightning's
``SIGTERMException`` at step ``s``) and "requeue at step s" (SLURM's auto-requeue signal,
``SIGUSR1`` by default: every rank writes Lightning's ``hpc_ckpt_<n>.ckpt`` at step ``s``,
rank 0 runs ``scontrol requeue``, and once the job is requeued every rank stops at that step).
A rank that received the signal proposes :meth:`_StopAgreementMixin.stop_step_for` of the next
round it sends, a step by which every rank will have heard of it; the proposal rides along every
round from then on (a two-value side message: the smallest stop and requeue steps this rank
knows of), and every rank acts at the first batch whose step is at least the smallest proposal
it knows of, which is the same batch on every rank: a proposal ``p`` reaches every rank by step
``p``, so at the smallest proposal every rank knows it, of either kind.

Lightning's own handler would save the requeue checkpoint (a collective: the consensus average)
inside the signal handler, wherever each rank happens to be in its step: under real SLURM that
hung, three ranks in the checkpoint's average and one waiting for its gossip round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.exchange import post, wait_all

log = logging.getLogger(__name__)

#: "no stop agreed" in the stop messages
NO_STOP = 2**62
#: the tag of the stop messages (apart from the replicas' tag 0)
STOP_TAG = 7


@dataclass
class _StopMessages:
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


class _StopAgreementMixin:
    """The agreed stop and requeue steps of :class:`DPSGDStrategy` (SIGTERM, SLURM requeue)."""

    def _reset_agreement(self) -> None:
        with self._stop_lock:
            self._stop_at = NO_STOP
            self._requeue_at = NO_STOP
        self._stop_proposed = self._requeue_proposed = self._requeue_done = False
        self._stopping_together = False

    def install_sigterm_check(self, trainer: Any) -> None:
        """Replace Lightning's per-batch SIGTERM broadcast by :meth:`sigterm_stop_now`, and
        defer Lightning's SLURM auto-requeue handler to :meth:`requeue_now`."""
        from lightning_gossip.liveness.waits import make_sigterm_check_local

        self._reset_agreement()
        self._begin_fit()
        make_sigterm_check_local(trainer, stop_now=self.sigterm_stop_now,
                                 requeue_now=self.requeue_now)

    def _propose(self, kind: str) -> None:
        """Propose to stop (``kind="stop"``) or requeue at the first step every rank can know."""
        first = self.step + (1 if self.overlap and self._started(self.step) else 0)
        proposal = self.stop_step_for(self.global_rank, first)
        with self._stop_lock:
            if kind == "stop":
                self._stop_at = min(self._stop_at, proposal)
            else:
                self._requeue_at = min(self._requeue_at, proposal)
        log.info("rank %d received the %s signal at step %d: proposes that every rank acts at "
                 "step %d", self.global_rank, kind, self.step, proposal)

    def _flags_all_reduce(self, received: bool, what: str) -> bool:
        """One node of several ranks (nothing to gossip): combine the flags by an all-reduce
        on the gossip group (every rank calls it before every batch)."""
        flag = torch.tensor([1 if received else 0], device=self.root_device)
        self.watched(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self._group,
                     what=f"agreeing whether to {what} at step {self.step}")
        return bool(flag.item())

    def sigterm_stop_now(self, received: bool) -> bool:
        """Called before every training batch: whether every rank stops here.

        ``received``: this rank got SIGTERM. The first time, it proposes to stop at
        :meth:`stop_step_for` of the next round it sends; the proposal goes out with every
        round from then on. Every rank stops at the first batch whose step is at least the
        smallest proposal it knows of, which is the same batch on every rank. With
        ``hierarchical=True`` on a single node (nothing to gossip) the flags are combined by
        an all-reduce on the gossip group instead.
        """
        if not self._exchanging:
            stop = self._flags_all_reduce(received, "stop (SIGTERM)")
        else:
            if received and not self._stop_proposed:
                self._stop_proposed = True
                self._propose("stop")
            with self._stop_lock:
                stop = self.step >= self._stop_at
        if stop:
            self._stopping_together = True
        return stop

    def requeue_now(self, received: bool) -> bool:
        """Called before every training batch when Lightning's SLURM auto-requeue is on (before
        :meth:`sigterm_stop_now`): whether every rank stops here, requeued.

        ``received``: this rank got the requeue signal. Agreed like a stop; at the agreed step
        every rank writes the requeue checkpoint and rank 0 requeues the job
        (:meth:`save_and_requeue`); once it is requeued every rank stops there, otherwise
        (``scontrol`` failed) training goes on, as with Lightning's own handler. Once per fit.
        """
        if self._requeue_done:
            return False
        if not self._exchanging:
            due = self._flags_all_reduce(received, "requeue (SLURM)")
        else:
            if received and not self._requeue_proposed:
                self._requeue_proposed = True
                self._propose("requeue")
            with self._stop_lock:
                due = self.step >= self._requeue_at
        if not due:
            return False
        self._requeue_done = True
        requeued = self.save_and_requeue()
        if requeued:
            self._stopping_together = True
        return requeued

    # ------------------------------------------------------------------------------------------
    # The side messages of every round
    # ------------------------------------------------------------------------------------------
    def _stop_peers(self, rank: int, step: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(send_to, recv_from)`` ranks of ``rank``'s stop messages in round ``step``: its
        replica peers (flat), or its column peers plus its node's other ranks (sharded)."""
        assert self.topology is not None and self.layout is not None
        devices = self.layout.devices
        node, local = divmod(rank, devices)
        peers = self.topology.peers(node, step)
        mates = tuple(node * devices + k for k in range(devices) if k != local)
        send_to = tuple(r * devices + local for r in peers.send_to) + mates
        recv_from = tuple(j * devices + local for j in peers.recv_ranks) + mates
        return send_to, recv_from

    def _post_stop(self, step: int) -> _StopMessages:
        assert self._flat is not None and self._group is not None
        send_to, recv_from = self._stop_peers(self.global_rank, step)
        device = self._flat.device
        with self._stop_lock:
            values = [self._stop_at, self._requeue_at]
        send = torch.tensor(values, dtype=torch.int64, device=device)
        recv = [(j, torch.empty(2, dtype=torch.int64, device=device)) for j in recv_from]
        msgs = _StopMessages(send, recv)
        msgs.works = post(send, send_to, recv, self._group, tag=STOP_TAG)
        return msgs

    def _merge_stop(self, rnd: Any, watch_peers: bool) -> None:
        """Wait for the round's stop messages and keep the smallest steps heard of."""
        msgs = rnd.stop
        if msgs is None:
            return
        ranks = sorted({j for j, _ in msgs.recv})
        wait_all(msgs.works, self.timeout,
                 f"stop messages of rank {self.global_rank} with ranks {ranks} at step "
                 f"{rnd.step}", heartbeat=self.heartbeat if watch_peers else None,
                 peers=ranks if watch_peers else ())
        stop, requeue = msgs.received()
        with self._stop_lock:
            self._stop_at = min(self._stop_at, stop)
            self._requeue_at = min(self._requeue_at, requeue)

    def _rounds_lag(self) -> int:
        """Steps from posting a round to the first batch start after it was applied, minus
        one: 2 with ``delay_by_one`` (a round received at step t+1 goes out again at t+2),
        else 1."""
        return 2 if self.delay_by_one else 1

    def stop_step_for(self, rank: int, first_round: int) -> int:
        """The first step at which every rank knows a stop that ``rank`` puts into its stop
        messages from round ``first_round`` on.

        Simulates the spreading along the actual rounds (the topology at every step, which
        every rank can compute), so it is exact for static and time-varying topologies alike:
        at most ``(world_size - 1)`` rounds when every step's graph is connected (twice that
        with ``delay_by_one``). Raises ``RuntimeError`` when the rounds do not connect the
        ranks within ``100 * world_size`` steps.
        """
        n, lag = self.world_size, self._rounds_lag()
        known = {rank: first_round - lag}  # rank -> the round after which it knows the stop
        t = first_round
        limit = first_round + 100 * n * lag
        while len(known) < n:
            if t > limit:
                raise RuntimeError(
                    f"the stop proposed by rank {rank} at round {first_round} does not reach "
                    f"ranks {sorted(set(range(n)) - set(known))} within {limit - first_round} "
                    "rounds: the topology does not connect the ranks")
            heard = {}
            for j in range(n):
                if j in known:
                    continue
                _, recv_from = self._stop_peers(j, t)
                if any(i in known and known[i] + lag <= t for i in recv_from):
                    heard[j] = t
            known.update(heard)
            t += 1
        return max(known.values()) + lag
