"""The gossip thread's two loops: an active rank starts exchanges, a passive rank serves them.

Control messages are two int64 values ``[kind, phase]`` on the gloo *control* group
(:class:`MessageKind`); snapshots travel on the *data* group. One exchange at a time per rank
makes every pairwise average atomic, and because only actives start exchanges no cycle of
waiting ranks can form.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from lightning_gossip._compat import work_source_rank
from lightning_gossip.async_gossip.state import SharedState
from lightning_gossip.exchange import pairwise_exchange, wait_all
from lightning_gossip.pairing import Pairing

__all__ = ["ActiveLoop", "GossipLoop", "MessageKind", "PassiveLoop"]

log = logging.getLogger("lightning_gossip.async_gossip")


class MessageKind(IntEnum):
    """The first value of a control message ``[kind, phase]``."""

    REQUEST = 1  #: an active asks a passive for one exchange in ``phase``
    BYE = 2      #: an active has finished ``phase``: it sends no more requests in it


class GossipLoop:
    """What both loops share: the exchange, control messages, idling.

    Args:
        shared: the rank's :class:`~lightning_gossip.async_gossip.state.SharedState`.
        rank: this rank (global).
        pairing: roles and partner choice.
        control_group: a gloo group for the control messages.
        data_group: the group that carries snapshots.
        timeout: limit for every blocking wait.

    The loop runs in the gossip thread; its buffers ``theirs`` and ``delta`` and the
    control buffer are used by that thread only.
    """

    def __init__(self, shared: SharedState, rank: int, pairing: Pairing,
                 control_group: dist.ProcessGroup, data_group: dist.ProcessGroup,
                 timeout: timedelta) -> None:
        self.shared = shared
        self.rank = rank
        self.pairing = pairing
        self.control_group = control_group
        self.data_group = data_group
        self.timeout = timeout
        self._theirs = shared.mailbox.flat.empty()
        self._delta = shared.mailbox.flat.empty()
        self._ctrl = torch.zeros(2, dtype=torch.int64)

    def run(self) -> None:
        """The loop body; returns when the training thread asks to stop."""
        raise NotImplementedError

    def exchange(self, peer: int) -> None:
        """One atomic pairwise average with ``peer``; hands the delta to the training thread."""
        shared, box = self.shared, self.shared.mailbox
        with shared.cv:
            shared.handoff.wait_for_training()
            fresh = box.fresh_ready
            covered = box.take_snapshot()  # adopt the newest snapshot
            if fresh:
                shared.cv.notify_all()
        view = box.view  # only this thread swaps it
        pairwise_exchange(view, self._theirs, peer, self.data_group, self.timeout, self.rank)
        torch.sub(self._theirs, view, out=self._delta).mul_(0.5)
        view.add_(self._delta)
        with shared.cv:
            box.post_delta(self._delta, covered)
            shared.handoff.to_training()
            shared.stats.exchanges += 1
            shared.cv.notify_all()

    def send_control(self, kind: MessageKind, phase: int, dst: int) -> None:
        """Send ``[kind, phase]`` to ``dst`` on the control group (with the timeout)."""
        msg = torch.tensor([kind, phase], dtype=torch.int64)
        work = dist.isend(msg, dst, group=self.control_group)
        what = "request" if kind == MessageKind.REQUEST else "end-of-phase message"
        wait_all([work], self.timeout, f"rank {self.rank} sending a gossip {what} to rank {dst}")

    def receive_control(self) -> tuple[MessageKind, int, int]:
        """Receive the next control message from any rank: ``(kind, phase, sender)``."""
        work = dist.irecv(self._ctrl, group=self.control_group)
        wait_all([work], self.timeout, f"passive rank {self.rank} waiting for a gossip request")
        sender = dist.get_global_rank(self.control_group, work_source_rank(work))
        raw, phase = int(self._ctrl[0]), int(self._ctrl[1])
        try:
            kind = MessageKind(raw)
        except ValueError:
            raise RuntimeError(f"unknown gossip control message {raw} from {sender}") from None
        log.debug("rank %d: got %s from rank %d (phase %d)", self.rank, kind.name, sender, phase)
        return kind, phase, sender


class ActiveLoop(GossipLoop):
    """An active rank: one exchange per new snapshot; BYE to every candidate at a phase end."""

    def run(self) -> None:
        """Serve the training thread's snapshots until asked to stop."""
        shared, clock, box = self.shared, self.shared.clock, self.shared.mailbox
        k = 0
        while True:
            if not shared.idle_until(lambda: clock.open_for_thread()
                                     and (box.fresh_ready or clock.end_requested_for_thread())):
                return
            with shared.cv:
                phase = clock.thread_phase
                has_snapshot = box.fresh_ready
                ending = clock.end_requested_for_thread()
            if has_snapshot:  # a pending snapshot is exchanged before the phase ends
                partner = self.pairing.partner(self.rank, k)
                k += 1
                log.debug("rank %d: request %d to rank %d (phase %d)", self.rank, k, partner,
                          phase)
                self.send_control(MessageKind.REQUEST, phase, partner)
                self.exchange(partner)
                log.debug("rank %d: exchanged with rank %d", self.rank, partner)
            elif ending:
                for passive in self.pairing.candidates(self.rank):
                    self.send_control(MessageKind.BYE, phase, passive)
                with shared.cv:
                    clock.mark_ended(phase)
                    shared.cv.notify_all()


class PassiveLoop(GossipLoop):
    """A passive rank: serves requests in order until each of its actives said BYE."""

    def run(self) -> None:
        """Serve requests phase after phase until asked to stop."""
        shared, clock = self.shared, self.shared.clock
        byes: dict[int, int] = {}
        expected = len(self.pairing.contacted_by(self.rank))
        while True:
            phase = clock.thread_phase  # only this thread changes it
            # Listen only while the phase is open on this rank: between phases (evaluation,
            # checkpointing) nobody sends, and that may take longer than the timeout.
            if not shared.idle_until(lambda p=phase: clock.opened >= p):
                return
            while byes.get(phase, 0) < expected:
                kind, msg_phase, sender = self.receive_control()
                if kind == MessageKind.REQUEST:
                    self.exchange(sender)
                else:
                    byes[msg_phase] = byes.get(msg_phase, 0) + 1
            with shared.cv:
                clock.mark_ended(phase)
                shared.cv.notify_all()
