"""The training thread's side of AD-PSGD: :class:`AsyncGossip` starts and drives the thread."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from lightning_gossip.async_gossip.loops import ActiveLoop, GossipLoop, PassiveLoop
from lightning_gossip.async_gossip.mailbox import DeltaMailbox
from lightning_gossip.async_gossip.state import GossipStats, SharedState
from lightning_gossip.flat import FlatState
from lightning_gossip.liveness import Heartbeat
from lightning_gossip.pairing import Pairing

__all__ = ["AsyncGossip"]


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
        heartbeat: this rank's :class:`~lightning_gossip.liveness.Heartbeat`; every wait of the
            gossip thread then fails fast, naming the peer, when a peer it waits on goes
            silent. ``None``: waits end only at ``timeout``.

    Every method is called from the training thread. The state it shares with the gossip
    thread lives in a :class:`~lightning_gossip.async_gossip.state.SharedState`; the step
    counter ``_steps`` is the training thread's alone.
    """

    def __init__(self, flat: FlatState, rank: int, pairing: Pairing,
                 control_group: dist.ProcessGroup, data_group: dist.ProcessGroup,
                 timeout: timedelta, max_staleness: int | None = 4,
                 delay_by_one: bool = False, heartbeat: Heartbeat | None = None) -> None:
        self.flat = flat
        self.rank = rank
        self.pairing = pairing
        self.active = pairing.is_active(rank)
        self.control_group = control_group
        self.data_group = data_group
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.delay_by_one = delay_by_one
        self._shared = SharedState(rank, DeltaMailbox(flat, delay_by_one), timeout)
        loop = ActiveLoop if self.active else PassiveLoop
        self._loop: GossipLoop = loop(self._shared, rank, pairing, control_group, data_group,
                                      timeout, heartbeat)
        self._thread: threading.Thread | None = None
        self._steps = 0

    @property
    def stats(self) -> GossipStats:
        """This rank's counters (exchanges, steps, staleness waits)."""
        return self._shared.stats

    @property
    def in_phase(self) -> bool:
        """A phase is open: between :meth:`begin_phase` and :meth:`quiesce`."""
        return self._shared.clock.is_open

    def start(self) -> None:
        """Start the gossip thread (it idles until the first :meth:`begin_phase`)."""
        self._thread = threading.Thread(target=self._run_thread, daemon=True,
                                        name=f"lightning-gossip-{self.rank}")
        self._thread.start()

    def begin_phase(self) -> None:
        """Open a new phase: from now on exchanges may start (all ranks call this together)."""
        shared = self._shared
        with shared.cv:
            shared.raise_if_failed()
            if shared.clock.is_open:
                return
            shared.clock.open()
            shared.mailbox.reset(self._steps)
            shared.handoff.to_thread()
            shared.cv.notify_all()

    def after_step(self) -> None:
        """At a step boundary: apply deltas, leave a fresh snapshot, bound the staleness."""
        shared, box, clock = self._shared, self._shared.mailbox, self._shared.clock
        with shared.cv:
            shared.raise_if_failed()
            self._steps += 1
            shared.stats.steps = self._steps
            if box.due_now():
                shared.handoff.wait_for_thread()
                box.apply_due()
            if not box.fresh_ready:  # the thread took the last snapshot: leave a new one
                box.leave_snapshot(self._steps)
                shared.handoff.to_thread()
                shared.cv.notify_all()
            if self.max_staleness is not None and clock.is_open:
                # A passive whose actives have all ended the phase gets no more gossip: go on.
                bound = self.max_staleness
                shared.wait_for(lambda: self._steps - box.gossiped <= bound or clock.quiet,
                                f"waiting for gossip to catch up (max_staleness={bound})",
                                count=True)

    def quiesce(self) -> None:
        """End the current phase: finish in-flight gossip everywhere, apply every delta."""
        shared, clock = self._shared, self._shared.clock
        with shared.cv:
            shared.raise_if_failed()
            if not clock.is_open:
                return
            phase = clock.request_end()
            shared.cv.notify_all()
            shared.wait_for(lambda: clock.is_ended(phase),
                            f"waiting for the gossip phase {phase} to end")
            shared.handoff.wait_for_thread()
            shared.mailbox.apply_all(self._steps)
            clock.close()

    def stop(self) -> None:
        """Stop the thread (after :meth:`quiesce`; idempotent)."""
        self._shared.request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            # The thread is a daemon; after an error elsewhere it may be stuck in a receive.
            self._thread.join(timeout=min(5.0, self.timeout.total_seconds()))
        self._thread = None

    def _run_thread(self) -> None:
        """The gossip thread: run the loop on the side stream; hand any error over."""
        try:
            with self._shared.handoff.on_side_stream():
                self._loop.run()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._shared.fail(e)
