"""The background engine of AD-PSGD: atomic pairwise averaging in a communication thread.

No Lightning here: :class:`AsyncGossip` is driven by a training thread that calls
:meth:`AsyncGossip.after_step` at every step boundary and :meth:`AsyncGossip.quiesce` at sync
points. The protocol (see ``docs/adpsgd.md``):

* Roles from :class:`~lightning_gossip.pairing.Pairing`: *active* ranks start exchanges,
  *passive* ranks answer them, one at a time, so every pairwise average is atomic and no cycle of
  waiting ranks can form.
* The training thread never blocks on communication. At a step boundary it adds the deltas the
  thread produced since the last boundary to the weights and, if the thread took the previous
  snapshot, leaves a fresh one. The thread never writes parameters (autograd would break).
* An active thread, for every new snapshot: sends ``[REQUEST, phase]`` to its next partner on a
  gloo *control* group, swaps snapshots on the *data* group, and computes
  ``delta = (theirs - mine) / 2``. The partner computes the opposite delta, so the sum of all
  replicas is conserved exactly.
* A passive thread receives control messages from any source and serves them in order.
* Phases: at a sync point every active finishes its exchange and sends ``[BYE, phase]`` to every
  passive it may contact; a passive is quiet once it has a BYE from each of its actives.
* Bounded staleness: the training thread waits while more than ``max_staleness`` of its steps
  are not yet in a snapshot that was exchanged.
* Every wait has a timeout; an exception in the thread is re-raised in the training thread.

Example (inside an initialised process group)::

    engine = AsyncGossip(FlatState(model), rank, Pairing("ring", world), control, data,
                         timeout=timedelta(minutes=5))
    engine.start()
    for batch in loader:
        train_step(batch)
        engine.after_step()      # apply deltas, offer a snapshot, bound staleness
    engine.quiesce()             # network quiet: evaluate, checkpoint, average...
    engine.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_gossip.exchange import GossipTimeout, pairwise_exchange, wait_all
from lightning_gossip.flat import FlatState
from lightning_gossip.pairing import Pairing

__all__ = ["AsyncGossip", "GossipStats"]

log = logging.getLogger(__name__)

REQUEST, BYE = 1, 2
_POLL = 0.05  # seconds between checks of the stop flag while idle


@dataclass
class GossipStats:
    """Counters a run can report (per rank)."""

    exchanges: int = 0
    steps: int = 0
    staleness_waits: int = 0
    staleness_wait_s: float = 0.0


class AsyncGossip:
    """Pairwise gossip in a background thread for one rank.

    Args:
        flat: the replica's :class:`~lightning_gossip.flat.FlatState`.
        rank: this rank (global).
        pairing: roles and partner choice.
        control_group: a gloo group for the small control messages.
        data_group: the group that carries snapshots (gloo, or nccl for CUDA models).
        timeout: limit for every blocking wait.
        max_staleness: the training thread waits while more than this many of its steps are
            not yet gossiped. ``None`` never waits.
        delay_by_one: apply deltas one step boundary later than they arrive, so every
            exchange has a whole step to hide behind.
    """

    def __init__(self, flat: FlatState, rank: int, pairing: Pairing,
                 control_group: dist.ProcessGroup, data_group: dist.ProcessGroup,
                 timeout: timedelta, max_staleness: int | None = 4,
                 delay_by_one: bool = False) -> None:
        self.flat = flat
        self.rank = rank
        self.pairing = pairing
        self.active = pairing.is_active(rank)
        self.control_group = control_group
        self.data_group = data_group
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.delay_by_one = delay_by_one
        self.stats = GossipStats()

        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        # training-thread side
        self._steps = 0
        self._phase = 0
        self._phase_open = False   # a phase is running (between begin_phase and quiesce)
        # shared, under _cv
        self._fresh_ready = False
        self._fresh_step = 0
        self._gossiped = 0         # steps covered by the last exchanged snapshot
        self._acc_dirty = False
        self._ready_dirty = False
        self._quit_phase = -1      # phase the training thread asked to end
        self._quiet_phase = -1     # last phase the thread has ended
        self._started_phase = -1   # last phase the training thread opened
        # buffers
        self._view = flat.pack()   # the thread's copy of the replica (only the thread uses it)
        self._fresh = flat.empty()  # a snapshot the training thread leaves for the thread
        self._theirs = flat.empty()
        self._delta = flat.empty()
        self._acc = torch.zeros_like(self._view)    # deltas not yet applied
        self._ready = torch.zeros_like(self._view)  # (delay_by_one) deltas due next boundary
        self._ctrl = torch.zeros(2, dtype=torch.int64)
        self._cuda = self._view.is_cuda
        self._stream = torch.cuda.Stream(device=self._view.device) if self._cuda else None
        self._event_to_thread: torch.cuda.Event | None = None
        self._event_to_training: torch.cuda.Event | None = None

    # ------------------------------------------------------------------------------------------
    # Training thread API
    # ------------------------------------------------------------------------------------------
    def start(self) -> None:
        target = self._run_active if self.active else self._run_passive
        self._thread = threading.Thread(target=self._guarded, args=(target,), daemon=True,
                                        name=f"lightning-gossip-{self.rank}")
        self._thread.start()

    def begin_phase(self) -> None:
        """Open a new phase: from now on exchanges may start (all ranks call this together)."""
        with self._cv:
            self._raise_if_failed()
            if self._phase_open:
                return
            self._phase_open = True
            self._started_phase = self._phase
            self._fresh_ready = False
            self.flat.pack(out=self._view)  # the thread is idle between phases
            self._record_to_thread()
            self._gossiped = self._steps
            self._cv.notify_all()

    @property
    def in_phase(self) -> bool:
        return self._phase_open

    def after_step(self) -> None:
        """At a step boundary: apply deltas, leave a fresh snapshot, bound the staleness."""
        with self._cv:
            self._raise_if_failed()
            self._steps += 1
            self.stats.steps = self._steps
            self._apply_due()
            if not self._fresh_ready:
                self.flat.pack(out=self._fresh)
                if self._acc_dirty:  # deltas not yet in the weights belong in the snapshot
                    self._fresh.add_(self._acc)
                if self._ready_dirty:
                    self._fresh.add_(self._ready)
                self._record_to_thread()
                self._fresh_step = self._steps
                self._fresh_ready = True
                self._cv.notify_all()
            if self.max_staleness is not None and self._phase_open:
                # A passive whose actives have all ended the phase gets no more gossip: go on.
                self._wait_for(lambda: self._steps - self._gossiped <= self.max_staleness
                               or self._quiet_phase >= self._phase,
                               "waiting for gossip to catch up (max_staleness)", count=True)

    def quiesce(self) -> None:
        """End the current phase: finish in-flight gossip everywhere, apply every delta."""
        with self._cv:
            self._raise_if_failed()
            if not self._phase_open:
                return
            self._quit_phase = self._phase
            self._cv.notify_all()
            phase = self._phase
            self._wait_for(lambda: self._quiet_phase >= phase, "waiting for the gossip phase to end")
            self._sync_to_training()
            self.flat.add_(self._acc)
            self._acc.zero_()
            if self.delay_by_one:
                self.flat.add_(self._ready)
                self._ready.zero_()
            self._acc_dirty = self._ready_dirty = False
            self._fresh_ready = False
            self._gossiped = self._steps
            self._phase += 1
            self._phase_open = False

    def stop(self) -> None:
        """Stop the thread (after :meth:`quiesce`; idempotent)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            # The thread is a daemon; after an error elsewhere it may be stuck in a receive.
            self._thread.join(timeout=min(5.0, self.timeout.total_seconds()))
        self._thread = None

    def check(self) -> None:
        """Raise the thread's error, if it had one."""
        with self._cv:
            self._raise_if_failed()

    # ------------------------------------------------------------------------------------------
    def _apply_due(self) -> None:
        """Add the deltas that are due to the weights (under ``_cv``)."""
        if self.delay_by_one:
            if self._ready_dirty:
                self._sync_to_training()
                self.flat.add_(self._ready)
                self._ready.zero_()
                self._ready_dirty = False
            if self._acc_dirty:  # what arrived since the last boundary is due at the next one
                self._sync_to_training()
                self._ready, self._acc = self._acc, self._ready
                self._ready_dirty, self._acc_dirty = True, False
        elif self._acc_dirty:
            self._sync_to_training()
            self.flat.add_(self._acc)
            self._acc.zero_()
            self._acc_dirty = False

    def _wait_for(self, predicate, what: str, count: bool = False) -> None:
        """Wait on ``_cv`` until ``predicate()``; raise on thread error or timeout."""
        if predicate():
            return
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        while not predicate():
            self._raise_if_failed()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GossipTimeout(f"rank {self.rank}: {what} took longer than {self.timeout}")
            self._cv.wait(min(remaining, 1.0))
        if count:
            self.stats.staleness_waits += 1
            self.stats.staleness_wait_s += time.monotonic() - start

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"rank {self.rank}: the gossip thread failed: {self._error}"
            ) from self._error

    # ------------------------------------------------------------------------------------------
    # Thread side
    # ------------------------------------------------------------------------------------------
    def _guarded(self, target) -> None:
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    target()
            else:
                target()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _idle_until(self, predicate) -> bool:
        """Wait (no deadline: the training thread may be computing) until ``predicate()``.

        Returns False when asked to stop.
        """
        with self._cv:
            while not predicate():
                if self._stop:
                    return False
                self._cv.wait(_POLL)
            return not self._stop

    def _run_active(self) -> None:
        k = 0
        while True:
            ok = self._idle_until(lambda: self._started_phase >= self._quiet_phase + 1
                                  and (self._fresh_ready or self._quit_phase > self._quiet_phase))
            if not ok:
                return
            with self._cv:
                phase = self._quiet_phase + 1
                has_snapshot = self._fresh_ready
                ending = self._quit_phase >= phase
            if has_snapshot:
                partner = self.pairing.partner(self.rank, k)
                k += 1
                log.debug("rank %d: request %d to rank %d (phase %d)", self.rank, k, partner, phase)
                self._send_control(REQUEST, phase, partner)
                self._exchange(partner)
                log.debug("rank %d: exchanged with rank %d", self.rank, partner)
            elif ending:
                for passive in self.pairing.candidates(self.rank):
                    self._send_control(BYE, phase, passive)
                with self._cv:
                    self._quiet_phase = phase
                    self._cv.notify_all()

    def _run_passive(self) -> None:
        byes: dict[int, int] = {}
        expected = len(self.pairing.contacted_by(self.rank))
        while True:
            phase = self._quiet_phase + 1
            # Listen only while the phase is open on this rank: between phases (evaluation,
            # checkpointing) nobody sends, and that may take longer than the timeout.
            if not self._idle_until(lambda p=phase: self._started_phase >= p):
                return
            while byes.get(phase, 0) < expected:
                work = dist.irecv(self._ctrl, group=self.control_group)
                wait_all([work], self.timeout,
                         f"passive rank {self.rank} waiting for a gossip request")
                sender = dist.get_global_rank(self.control_group, work._source_rank())
                kind, msg_phase = int(self._ctrl[0]), int(self._ctrl[1])
                log.debug("rank %d: got %s from rank %d (phase %d)", self.rank,
                          "REQUEST" if kind == REQUEST else "BYE", sender, msg_phase)
                if kind == REQUEST:
                    self._exchange(sender)
                elif kind == BYE:
                    byes[msg_phase] = byes.get(msg_phase, 0) + 1
                else:
                    raise RuntimeError(f"unknown gossip control message {kind} from {sender}")
            with self._cv:
                self._quiet_phase = phase
                self._cv.notify_all()

    def _send_control(self, kind: int, phase: int, dst: int) -> None:
        msg = torch.tensor([kind, phase], dtype=torch.int64)
        work = dist.isend(msg, dst, group=self.control_group)
        what = "request" if kind == REQUEST else "end-of-phase message"
        wait_all([work], self.timeout, f"rank {self.rank} sending a gossip {what} to rank {dst}")

    def _exchange(self, peer: int) -> None:
        """One atomic pairwise average with ``peer``; hands the delta to the training thread."""
        with self._cv:
            self._wait_from_training()
            if self._fresh_ready:  # adopt the newest snapshot
                self._view, self._fresh = self._fresh, self._view
                covered = self._fresh_step
                self._fresh_ready = False
                self._cv.notify_all()
            else:
                covered = self._gossiped
        pairwise_exchange(self._view, self._theirs, peer, self.data_group, self.timeout, self.rank)
        torch.sub(self._theirs, self._view, out=self._delta).mul_(0.5)
        self._view.add_(self._delta)
        with self._cv:
            self._acc.add_(self._delta)
            if self._fresh_ready:  # a snapshot left meanwhile lacks this delta
                self._fresh.add_(self._delta)
            self._record_to_training()
            self._acc_dirty = True
            self._gossiped = max(self._gossiped, covered)
            self.stats.exchanges += 1
            self._cv.notify_all()

    # -- CUDA stream ordering (no-ops on CPU) ------------------------------------------------------
    def _record_to_thread(self) -> None:
        if self._cuda:
            self._event_to_thread = torch.cuda.Event()
            self._event_to_thread.record()

    def _wait_from_training(self) -> None:
        if self._cuda and self._event_to_thread is not None:
            torch.cuda.current_stream().wait_event(self._event_to_thread)

    def _record_to_training(self) -> None:
        if self._cuda:
            self._event_to_training = torch.cuda.Event()
            self._event_to_training.record()

    def _sync_to_training(self) -> None:
        if self._cuda and self._event_to_training is not None:
            torch.cuda.current_stream().wait_event(self._event_to_training)
