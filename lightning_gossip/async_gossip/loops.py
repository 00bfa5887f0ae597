"""The gossip thread's two loops: an active rank starts exchanges, a passive rank serves them.

Control messages are two int64 values ``[kind, phase]`` on the gloo *control* group
(:class:`MessageKind`); snapshots (this rank's shard of them, in the wire dtype) travel on the
*data* group. One exchange at a time per rank
makes every pairwise average atomic, and because only actives start exchanges no cycle of
waiting ranks can form.

**How an exchange is timed** (``GossipStats.exchange_s``, what ``gossip_every_n_steps="auto"``
takes as the exchange time): from the moment *both* sides have posted it to holding the
partner's snapshot, mixed. The swap cannot start before the later side posts (gloo sends once
the receiver has posted its receive), and an active posts right after its request, while its
passive may answer late: it serves one request at a time, so a request waits behind the
exchanges of the passive's other actives, and its thread may be slow to wake on a loaded host.
Timed from this rank's own posting, that wait would count as link time, and ``"auto"`` would
pick too long a period. So each side posts a one-value *posted* marker to its partner on the
control group (tag :data:`POSTED_TAG`) right before its snapshot, waits for the partner's
marker first and times the swap from its arrival; the wait before it is kept apart in
``GossipStats.peer_wait_s``. The marker travels next to the snapshot, so it adds no round trip.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_gossip.async_gossip.inbox import ControlInbox
from lightning_gossip.async_gossip.state import SharedState
from lightning_gossip.compression import pairwise_delta, quantize
from lightning_gossip.errors import GossipStopped
from lightning_gossip.exchange import check_finite, post, wait_all
from lightning_gossip.liveness import Heartbeat
from lightning_gossip.liveness.waits import blame, wait_done
from lightning_gossip.pairing import Pairing

if TYPE_CHECKING:
    from lightning_gossip.pairing import ColumnPairing

__all__ = ["POSTED_TAG", "ActiveLoop", "GossipLoop", "MessageKind", "PassiveLoop"]

log = logging.getLogger("lightning_gossip.async_gossip")

POSTED_TAG = 1
"""The tag of the *posted* markers on the control group (requests and BYEs use tag 0)."""


class MessageKind(IntEnum):
    """The first value of a control message ``[kind, phase]``."""

    REQUEST = 1  #: an active asks a passive for one exchange in ``phase``
    BYE = 2      #: an active has finished ``phase``: it sends no more requests in it


class GossipLoop:
    """What both loops share: the exchange, control messages, idling.

    Args:
        shared: the rank's :class:`~lightning_gossip.async_gossip.state.SharedState`.
        rank: this rank (global).
        pairing: roles and partner choice (a
            :class:`~lightning_gossip.pairing.ColumnPairing` for hierarchical gossip).
        control_group: a gloo group for the control messages.
        data_group: the group that carries snapshots.
        timeout: limit for every blocking wait.
        heartbeat: when given, every wait fails fast (``PeerSilent``) once a rank it depends
            on goes silent.
        wire_dtype: what is sent: the snapshot's shard (fp32), or ``q = Q(shard)`` rounded to
            bf16/fp16. The delta is then ``(q_peer - q) / 2`` with the very ``q`` sent, so the
            two deltas of an exchange still cancel exactly.

    The loop runs in the gossip thread; its buffers ``send``, ``theirs`` and ``delta`` and the
    control buffer are used by that thread only.
    """

    def __init__(self, shared: SharedState, rank: int, pairing: Pairing | ColumnPairing,
                 control_group: dist.ProcessGroup, data_group: dist.ProcessGroup,
                 timeout: timedelta, heartbeat: Heartbeat | None = None,
                 wire_dtype: torch.dtype = torch.float32) -> None:
        self.shared = shared
        self.heartbeat = heartbeat
        self.rank = rank
        self.pairing = pairing
        self.control_group = control_group
        self.data_group = data_group
        self.timeout = timeout
        box = shared.mailbox
        n, device = box.hi - box.lo, box.view.device
        self.wire_dtype = wire_dtype
        self._send = (None if wire_dtype == torch.float32
                      else torch.empty(n, dtype=wire_dtype, device=device))
        self._theirs = torch.empty(n, dtype=wire_dtype, device=device)
        self._delta = torch.empty(n, dtype=torch.float32, device=device)
        # the posted markers (control group, CPU): this side's, and the partner's
        self._posted_out = torch.ones(1, dtype=torch.int64)
        self._posted_in = torch.zeros(1, dtype=torch.int64)
        self._inbox = ControlInbox(control_group, timeout, rank)  # (a passive's)

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
        mine = box.view[box.lo:box.hi]  # only this thread swaps the view
        send = mine if self._send is None else quantize(mine, self.wire_dtype, out=self._send)
        started = time.perf_counter()
        ready = self._swap(send, peer)  # the partner's marker came: both sides had posted
        # (q_theirs - q_mine) / 2: the partner's is its exact negative (mean-preserving)
        pairwise_delta(send, [(self._theirs, 0.5)], out=self._delta)
        done = time.perf_counter()  # on the wire from when both had posted, and mixed
        mine.add_(self._delta)
        with shared.cv:
            # order after the training thread's latest reads of acc / writes of fresh (CUDA)
            shared.handoff.wait_for_training()
            box.post_delta(self._delta, covered)
            shared.handoff.to_training()
            shared.stats.exchanges += 1
            shared.stats.sent_bytes += send.numel() * send.element_size()
            shared.stats.exchange_s += done - max(ready, started)
            shared.stats.peer_wait_s += max(ready - started, 0.0)
            shared.cv.notify_all()

    def _swap(self, send: torch.Tensor, peer: int) -> float:
        """Swap ``send`` for the partner's snapshot (into ``_theirs``): post this side's posted
        marker, then the snapshot; wait for the partner's marker, then for the rest. Returns
        when the partner's marker came (``time.perf_counter()``); raises ``GossipStopped``
        when a stop abandoned the exchange.

        A stop leaves an exchange on the wire only after the stop's grace
        (``SharedState.exchange_abandoned``): the partner may have posted its side too, and
        would apply its delta alone (the sum not conserved)."""
        shared, group = self.shared, self.control_group
        what = f"pairwise gossip between rank {self.rank} and rank {peer}"
        marks = post(self._posted_out, (peer,), [(peer, self._posted_in)], group, tag=POSTED_TAG)
        works = post(send, (peer,), [(peer, self._theirs)], self.data_group)
        shared.waiting_on = f"rank {peer} to post its side of the exchange of snapshots"
        if not wait_all(marks[1:], self.timeout, f"{what}: waiting for rank {peer} to post "
                        "its side", heartbeat=self.heartbeat, peers=(peer,),
                        should_stop=shared.exchange_abandoned):
            raise GossipStopped(f"rank {self.rank}: stopped in the exchange with rank {peer}")
        ready = time.perf_counter()
        shared.waiting_on = f"the exchange of snapshots with rank {peer}"
        if not wait_all(works + marks[:1], self.timeout, what, heartbeat=self.heartbeat,
                        peers=(peer,), should_stop=shared.exchange_abandoned):
            raise GossipStopped(f"rank {self.rank}: stopped in the exchange with rank {peer}")
        shared.waiting_on = "nothing (idle)"
        check_finite(self._theirs, peer=peer, rank=self.rank)
        return ready

    def send_control(self, kind: MessageKind, phase: int, dst: int) -> None:
        """Send ``[kind, phase]`` to ``dst`` on the control group (with the timeout)."""
        msg = torch.tensor([kind, phase], dtype=torch.int64)
        works = post(msg, (dst,), (), self.control_group)
        what = "request" if kind == MessageKind.REQUEST else "end-of-phase message (BYE)"
        what = f"rank {self.rank} sending a gossip {what} for phase {phase} to rank {dst}"
        self.shared.waiting_on = what
        if not wait_all(works, self.timeout, what, heartbeat=self.heartbeat, peers=(dst,),
                        should_stop=self._stopping):
            raise GossipStopped(f"{what}: stopped")
        self.shared.waiting_on = "nothing (idle)"

    def _stopping(self) -> bool:
        """Whether the training thread asked this thread to stop (a wait on a peer returns)."""
        return self.shared.stop_requested

    def receive_control(self, phase: int = 0, missing: tuple[int, ...] = ()
                        ) -> tuple[MessageKind, int, int] | None:
        """Receive the next control message of the actives ``missing``: ``(kind, phase,
        sender)``.

        ``missing``: the actives whose BYE for ``phase`` has not come yet; the only ranks that
        may still send: a receive from each is posted (:class:`~.inbox.ControlInbox`), their
        heartbeats are watched and they are named on failure. Returns ``None`` when asked to
        stop meanwhile (the receives are left pending; they end at the interpreter's exit).
        """
        inbox = self._inbox
        for active in missing:
            inbox.post(active)
        what = (f"passive rank {self.rank} waiting in phase {phase} for a gossip request or the "
                f"end-of-phase message (BYE) of rank(s) {', '.join(map(str, missing))}")
        self.shared.waiting_on = f"a request or BYE from rank(s) {', '.join(map(str, missing))}"
        came = inbox.take()
        if came is None:
            if not wait_done(inbox.arrived, missing, self.heartbeat, self.timeout, what,
                             should_stop=self._stopping):
                return None
            came = inbox.take()
            assert came is not None
        self.shared.waiting_on = "nothing (idle)"
        sender, msg, error = came
        if error is not None:  # a closed connection names no culprit but its rank: look
            raise blame(error, [sender], self.heartbeat, what)
        raw, phase = int(msg[0]), int(msg[1])
        try:
            kind = MessageKind(raw)
        except ValueError:
            raise RuntimeError(f"rank {self.rank}: unknown gossip control message {raw} from "
                               f"rank {sender}") from None
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
        byes: dict[int, set[int]] = {}
        actives = tuple(sorted(self.pairing.contacted_by(self.rank)))
        while True:
            phase = clock.thread_phase  # only this thread changes it
            # Listen only while the phase is open on this rank: between phases (evaluation,
            # checkpointing) nobody sends, and that may take longer than the timeout.
            if not shared.idle_until(lambda p=phase: clock.opened >= p):
                return
            while len(byes.get(phase, ())) < len(actives):
                missing = tuple(r for r in actives if r not in byes.get(phase, ()))
                got = self.receive_control(phase, missing)
                if got is None:
                    return
                kind, msg_phase, sender = got
                if kind == MessageKind.REQUEST:
                    self.exchange(sender)
                else:
                    byes.setdefault(msg_phase, set()).add(sender)
            with shared.cv:
                clock.mark_ended(phase)
                shared.cv.notify_all()
