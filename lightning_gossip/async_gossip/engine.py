"""The training thread's side of AD-PSGD: :class:`AsyncGossip` starts and drives the thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.async_gossip.loops import ActiveLoop, GossipLoop, PassiveLoop
from lightning_gossip.async_gossip.mailbox import DeltaMailbox
from lightning_gossip.async_gossip.state import GossipStats, SharedState
from lightning_gossip.errors import GossipStopped
from lightning_gossip.flat import FlatState
from lightning_gossip.liveness import Heartbeat, track
from lightning_gossip.pairing import Pairing

if TYPE_CHECKING:
    from lightning_gossip.gossip_period.auto import PeriodDriver
    from lightning_gossip.pairing import ColumnPairing

#: ``gather(mine, out)``: the node's all-gather of the ranks' slice deltas (``out`` is
#: ``devices`` slices of ``mine``'s length, in local-rank order)
NodeGather = Callable[[Tensor, Tensor], None]

__all__ = ["FINISH_GRACE_S", "IDLE_EVERY_MAX_S", "AsyncGossip"]

IDLE_EVERY_MAX_S = 1.0
"""The longest pause between two snapshots an idle active rank leaves
(:meth:`AsyncGossip.idle`)."""

FINISH_GRACE_S = 2.0
"""Seconds :meth:`AsyncGossip.abandon` gives an exchange whose snapshots are on the wire to
complete (with a live partner it completes on both sides or on neither)."""


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
            not yet gossiped. ``None`` never waits. With a ``period`` it counts exchanges: the
            wait starts once more than ``(max_staleness + 1) * period - 1`` steps are in no
            exchanged snapshot (``period`` 1: ``max_staleness`` steps, as before).
        delay_by_one: apply deltas one step boundary later than they arrive, so every
            exchange has a whole step to hide behind.
        heartbeat: this rank's :class:`~lightning_gossip.liveness.Heartbeat`; every wait of the
            gossip thread then fails fast, naming the peer, when a peer it waits on goes
            silent. ``None``: waits end only at ``timeout``.
        wire_dtype: what the snapshots are sent as (see
            :class:`~lightning_gossip.async_gossip.loops.GossipLoop`).
        shard: ``(index, count)``: gossip only slice ``index`` of ``count`` equal slices of the
            replica (hierarchical AD-PSGD: the local rank and the node's size). Then
            ``node_gather`` must be given: at every step boundary (and at :meth:`quiesce`) every
            rank of the node calls it with its due slice deltas, and every rank adds the same
            gathered full delta to its weights, so the node's replicas stay bit-identical.
        node_gather: the node's all-gather (a collective of the training thread on the node's
            group).
        period: local optimizer steps per exchange (``gossip_every_n_steps``, default 1): a
            fresh snapshot is left for the gossip thread only once this many steps passed since
            the last one on an active rank, so it starts at most one exchange per ``period``
            steps (a passive rank answers with its newest snapshot, as before).
        auto: ``gossip_every_n_steps="auto"``: this rank's
            :class:`~lightning_gossip.gossip_period.auto.PeriodDriver` (``agree=False``), told
            the steps, the gossip thread's exchange times (:attr:`GossipStats.exchange_s
            <lightning_gossip.async_gossip.state.GossipStats>`, timed from the moment both
            sides had posted, and ``peer_wait_s``) and the sync points; a due
            decision calls :meth:`set_period` at the end of :meth:`after_step` (no
            collective). Start with ``period=1``.

    The verbs are :class:`~lightning_gossip.sync_gossip.SyncGossip`'s: :meth:`start` (the
    gossip thread), :meth:`before_step` (opens a phase if none is open: all ranks together,
    e.g. after a barrier), :meth:`after_step`, :meth:`quiesce` (ends the phase: a sync point),
    :meth:`close`, :attr:`stats`. Every method is called from the training thread. The state it
    shares with the gossip thread lives in a
    :class:`~lightning_gossip.async_gossip.state.SharedState`; the step counter ``_steps`` is
    the training thread's alone (a step number given to the verbs is not needed: the ranks'
    steps differ anyway).
    """

    def __init__(self, flat: FlatState, rank: int, pairing: Pairing | ColumnPairing,
                 control_group: dist.ProcessGroup, data_group: dist.ProcessGroup,
                 timeout: timedelta, max_staleness: int | None = 4,
                 delay_by_one: bool = False, heartbeat: Heartbeat | None = None,
                 wire_dtype: torch.dtype = torch.float32,
                 shard: tuple[int, int] = (0, 1),
                 node_gather: NodeGather | None = None, period: int = 1,
                 auto: PeriodDriver | None = None) -> None:
        self.flat = flat
        self.rank = rank
        self.pairing = pairing
        self.active = pairing.is_active(rank)
        self.control_group = control_group
        self.data_group = data_group
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.delay_by_one = delay_by_one
        index, count = shard
        size = -(-flat.numel // count)
        lo = min(index * size, flat.numel)
        bounds = (lo, min(lo + size, flat.numel))
        if count > 1 and node_gather is None:
            raise ValueError("a sharded AsyncGossip needs node_gather")
        self._gather = node_gather if count > 1 else None
        self._mine = flat.empty()[:size] if self._gather is not None else None
        self._gathered = (torch.empty(size * count, device=flat.device)
                          if self._gather is not None else None)
        self._shared = SharedState(rank, DeltaMailbox(flat, delay_by_one, bounds), timeout)
        #: local steps per exchange; the staleness bound in steps (``None``: no bound)
        self.period, self.staleness_steps = 1, max_staleness
        self.set_period(period)
        if heartbeat is not None and heartbeat.monitor:
            beat = heartbeat
            self._shared.liveness = lambda what: beat.check(f"rank {rank} {what}")
        loop = ActiveLoop if self.active else PassiveLoop
        self._loop: GossipLoop = loop(self._shared, rank, pairing, control_group, data_group,
                                      timeout, heartbeat, wire_dtype)
        self._thread: threading.Thread | None = None
        self._steps = 0
        #: when the last step of the open phase ended, the last interval between two (capped
        #: at IDLE_EVERY_MAX_S), when :meth:`idle` last left a snapshot: idle paces itself so
        self._stepped_at: float | None = None
        self._step_s = 0.0
        self._idled_at = 0.0
        #: sharded: an error of the work after the node's all-gather, raised before the next
        #: node collective of this engine instead (see :meth:`after_step`)
        self._deferred: BaseException | None = None
        #: sharded: ``_mine`` holds slice deltas taken out of the mailbox and not yet in the
        #: weights (the node's all-gather was entered and has not returned)
        self._gathering = False
        #: ``gossip_every_n_steps="auto"``: this rank's period driver (``None``: fixed)
        self.auto = auto

    @property
    def stop_proposed(self) -> bool:
        """``False``: AD-PSGD agrees on stops at its meetings, not along the exchanges."""
        return False

    def period_ends(self, step: int) -> bool:
        """``True``: an asynchronous rank may switch its period at any step
        (:meth:`set_period`)."""
        return True

    @property
    def stats(self) -> GossipStats:
        """This rank's counters (exchanges, steps, staleness waits)."""
        return self._shared.stats

    @property
    def process_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups the gossip thread's waits use (kept to the end of the process when the
        engine is abandoned on a lost peer)."""
        return self.control_group, self.data_group

    @property
    def in_phase(self) -> bool:
        """A phase is open: between :meth:`before_step` and :meth:`quiesce`."""
        return self._shared.clock.is_open

    def start(self) -> None:
        """Start the gossip thread (it idles until the first :meth:`before_step`)."""
        self._thread = threading.Thread(target=self._run_thread, daemon=True,
                                        name=f"lightning-gossip-{self.rank}")
        # stopped and joined before the interpreter finalizes (liveness.at_exit)
        track(self._thread, stop=self._shared.request_stop, groups=self.process_groups)
        self._thread.start()

    def before_step(self, step: int) -> None:
        """Before forward/backward of ``step``: open a new phase if none is open (from then on
        exchanges may start; the ranks open a phase together, e.g. after a barrier). Nothing
        else: the step's work is in :meth:`after_step`. ``step`` is not used."""
        del step
        shared = self._shared
        with shared.cv:
            shared.raise_if_failed()
            if shared.clock.is_open:
                return
            shared.clock.open()
            self._stepped_at = None
            shared.mailbox.reset(self._steps)
            shared.handoff.to_thread()
            shared.cv.notify_all()

    def after_step(self, step: int) -> None:
        """After the optimizer step of ``step`` (not used: the engine counts its own steps):
        apply deltas, leave a fresh snapshot, bound the staleness.

        Unsharded, the replica-sized work is at most one add (the due deltas) and one copy
        (the snapshot, with any pending deltas added on the way): see
        :class:`~lightning_gossip.async_gossip.mailbox.DeltaMailbox`.

        Sharded: the node's ranks all-gather their due slice deltas (every step, zeros where
        none) and each adds the same full delta, before the fresh snapshot is packed (the
        deltas still pending are added to this rank's slice of it only). An error after the
        all-gather (the gossip thread's, a staleness wait's) is raised at the next call, before
        the next all-gather: every rank of the node then leaves at the same collective (an
        elastic fit re-issues the one a loss interrupted, on the survivors' group).

        With :attr:`auto` the step is then recorded and a due decision taken.
        """
        auto = self.auto
        if auto is not None:
            auto.compute_ends()
        self._after(step)
        if auto is not None:
            with self._shared.cv:
                stats = self.stats
                exchanges, seconds, waited = stats.exchanges, stats.exchange_s, stats.peer_wait_s
            auto.step_done(self, step, exchanges, seconds, waited)

    def _after(self, step: int) -> None:
        """:meth:`after_step`'s work."""
        del step
        shared = self._shared
        if self._gather is not None:
            with shared.cv:
                self._raise_deferred()
                shared.raise_if_failed()
                shared.handoff.wait_for_thread()
                assert self._mine is not None
                shared.mailbox.take_due(self._mine)
                shared.handoff.to_thread()  # the thread may overwrite the buffers read here
            self._apply_gathered()
        with shared.cv:
            try:
                self._step_done()
            except BaseException as e:
                if self._gather is None:
                    raise
                self._deferred = e

    def _raise_deferred(self) -> None:
        error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    def _step_done(self) -> None:
        """(Under the lock) count the step, hand a snapshot over, bound the staleness."""
        shared, box, clock = self._shared, self._shared.mailbox, self._shared.clock
        shared.raise_if_failed()
        self._steps += 1
        shared.stats.steps = self._steps
        now = time.monotonic()
        if self._stepped_at is not None:
            self._step_s = min(now - self._stepped_at, IDLE_EVERY_MAX_S)
        self._stepped_at = now
        self._hand_over()
        if self.staleness_steps is not None and clock.is_open:
            bound = self.staleness_steps

            def caught_up() -> bool:
                # the thread took and exchanged the last snapshot, left steps ago while it was
                # busy: it gets the current one, or it would idle and this wait never end
                if (not box.fresh_ready and box.gossiped >= box.fresh_step
                        and self._steps - box.gossiped > bound):
                    self._hand_over()
                # a passive whose actives have all ended the phase gets no more gossip: go on
                return self._steps - box.gossiped <= bound or clock.quiet

            shared.wait_for(caught_up, "waiting for gossip to catch up (max_staleness="
                            f"{self.max_staleness}, {bound} steps)", count=True)

    def _hand_over(self, idle: bool = False) -> None:
        """(Under the lock) apply the due deltas (unsharded), and leave a fresh snapshot when
        the gossip thread took the last one and (an active rank, unless ``idle``) the period's
        steps passed since the last snapshot. A passive rank's thread takes one per exchange,
        so it packs one per exchange anyway, and the newest is the best to answer with."""
        shared, box = self._shared, self._shared.mailbox
        handed = False
        if self._gather is None and box.due_now():
            shared.handoff.wait_for_thread()
            box.apply_due()
            handed = True  # clean delta buffers: the thread overwrites what was read here
        due = idle or not self.active or self._steps - box.fresh_step >= self.period
        if not box.fresh_ready and due:  # the thread took the last snapshot: leave a new one
            box.leave_snapshot(self._steps)
            handed = True
            shared.cv.notify_all()
        if handed:
            shared.handoff.to_thread()

    def set_period(self, period: int) -> None:
        """Leave a snapshot at most every ``period`` steps from now on, with the staleness
        bound counted in the new period (the seam of a period picked while training,
        ``gossip_every_n_steps="auto"``; ranks may differ)."""
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"the gossip period must be a positive integer, got {period!r}")
        with self._shared.cv:
            self.period = period
            self.staleness_steps = (None if self.max_staleness is None
                                    else (self.max_staleness + 1) * period - 1)

    def idle(self) -> None:
        """While this rank waits without stepping, mid-phase (an elastic fit's wait at an
        epoch's end for its peers): an active rank hands its gossip thread a fresh snapshot of
        the unchanged replica whenever the thread took the last one, so it keeps starting
        exchanges. A passive peer still training may be waiting for one (``max_staleness``),
        and actives start one exchange per snapshot. At most one snapshot per interval between
        this rank's last two steps (at most :data:`IDLE_EVERY_MAX_S`): an idle rank exchanges
        no faster than it did while training. Passive ranks do nothing. Sharded, the snapshot
        is of this rank's slice with its pending deltas added (no collective: the deltas stay
        pending until the node's next all-gather); without it, a passive node still training
        waited for this one until the timeout (found by a 3-node elastic digits fit).
        """
        shared, now = self._shared, time.monotonic()
        if not self.active or now < self._idled_at + self._step_s:
            return
        with shared.cv:
            shared.raise_if_failed()
            if shared.clock.is_open and not shared.mailbox.fresh_ready:
                self._idled_at = now
                self._hand_over(idle=True)

    def quiesce(self) -> None:
        """End the current phase: finish in-flight gossip everywhere, apply every delta."""
        shared, clock = self._shared, self._shared.clock
        with shared.cv:
            self._raise_deferred()
            shared.raise_if_failed()
            if not clock.is_open:
                return
            phase = clock.request_end()
            shared.cv.notify_all()
            shared.wait_for(lambda: clock.is_ended(phase),
                            f"waiting for the gossip phase {phase} to end")
            shared.handoff.wait_for_thread()
            if self._gather is None:
                shared.mailbox.apply_all(self._steps)
            else:
                assert self._mine is not None
                shared.mailbox.take_all(self._mine, self._steps)
            clock.close()
        if self._gather is not None:
            self._apply_gathered()
        if self.auto is not None:
            self.auto.sync_point()

    def _apply_gathered(self) -> None:
        """The node's all-gather of the taken slice deltas; add the full delta to the weights
        (training thread, outside the lock: the gossip thread goes on meanwhile)."""
        assert self._gather is not None and self._mine is not None
        assert self._gathered is not None
        self._gathering = True  # an error in the all-gather leaves them to abandon()
        self._gather(self._mine, self._gathered)
        self.flat.add_(self._gathered[:self.flat.numel])
        self._gathering = False

    def close(self) -> None:
        """Stop the thread (after :meth:`quiesce`; idempotent)."""
        self._stop(0.0)

    def _stop(self, finish_s: float) -> None:
        """Ask the thread to stop (an exchange on the wire gets ``finish_s`` seconds) and join
        it for at most 5 s."""
        self._shared.request_stop(finish_s)
        if self._thread is not None and self._thread is not threading.current_thread():
            # The thread is a daemon; after an error elsewhere it may be stuck in a receive.
            self._thread.join(timeout=min(5.0, self.timeout.total_seconds()))
        self._thread = None

    def abandon(self) -> Tensor | None:
        """A peer was lost (elastic fit): stop the thread without ending the phase (no BYE:
        peers are gone), keeping every delta already received. The engine is not used again;
        the survivors start a new one over the live ranks.

        An exchange whose snapshots are on the wire gets :data:`FINISH_GRACE_S` to complete
        (with a live partner both sides then apply their deltas; a lost partner's fails); a
        wait for a control message is left at once (the partner then never gets this rank's
        snapshot, and neither side applies a delta).

        Flat, the deltas received are applied to the weights and ``None`` is returned.
        Sharded, applying them needs the node's all-gather, which cannot be issued here (a
        node-mate may be inside another node collective on the old group, abandoned): the slice
        deltas not yet in the weights (those of the mailbox, and those of an all-gather the loss
        interrupted) are returned, and the new engine over the node's new group takes them
        (:meth:`carry`), so that its next all-gather applies them on every rank of the node.
        """
        self._stop(FINISH_GRACE_S)
        shared = self._shared
        leftover: Tensor | None = None
        with shared.cv:
            shared.handoff.wait_for_thread()
            if self._gather is None:
                shared.mailbox.apply_all(self._steps)
            else:
                assert self._mine is not None
                leftover = torch.empty_like(self._mine)  # (an abandoned gather may hold _mine)
                shared.mailbox.take_all(leftover, self._steps)
                if self._gathering:
                    leftover.add_(self._mine)
            if shared.clock.is_open:
                shared.clock.close()
        return leftover

    def carry(self, leftover: Tensor) -> None:
        """Take the slice deltas an abandoned engine of the same replica and shard left
        (:meth:`abandon`) as pending deltas of this rank's slice: the node's next all-gather
        (:meth:`after_step` or :meth:`quiesce`) adds them to the weights of every rank of the
        node. Called from the training thread, also while the gossip thread runs."""
        if self._mine is None or leftover.shape != self._mine.shape:
            raise ValueError("carry() takes what abandon() returned for the same shard of a "
                             f"sharded engine, not a tensor of shape {tuple(leftover.shape)}")
        shared, box = self._shared, self._shared.mailbox
        with shared.cv:
            shared.handoff.wait_for_thread()
            box.post_delta(leftover[:box.hi - box.lo], covered=box.gossiped)
            shared.handoff.to_thread()
            shared.cv.notify_all()

    def _run_thread(self) -> None:
        """The gossip thread: run the loop on the side stream; hand any error over."""
        try:
            with self._shared.handoff.on_side_stream():
                self._loop.run()
        except GossipStopped:  # asked to stop in an exchange: nobody waits for it any more
            return
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._shared.fail(e)
