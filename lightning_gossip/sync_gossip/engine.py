"""The training thread's side of D-PSGD: :class:`SyncGossip` starts, finishes and applies the
rounds of synchronous gossip."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.exchange import CommWorker, NeighborExchange, wait_all
from lightning_gossip.flat import FlatState
from lightning_gossip.hierarchy import NodeGroups, NodeLayout
from lightning_gossip.liveness import Heartbeat, keep_alive_at_exit
from lightning_gossip.sync_gossip.rounds import Round, SyncStats
from lightning_gossip.sync_gossip.schedule import RoundSchedule
from lightning_gossip.sync_gossip.sharded import ShardedExchange
from lightning_gossip.sync_gossip.stop import NO_STOP, StopAgreement
from lightning_gossip.topology import Topology

if TYPE_CHECKING:
    from lightning_gossip.gossip_period.auto import PeriodDriver

#: ``gather(mine, out)``: the node's all-gather of the ranks' slice deltas (``out`` is
#: ``devices`` slices of ``mine``'s length, in local-rank order)
NodeGather = Callable[[Tensor, Tensor], None]

__all__ = ["SyncGossip"]


class SyncGossip:
    """Synchronous neighbour gossip (D-PSGD) for one rank: ``x_{t+1} = W_t x_t - lr g_t``.

    Args:
        flat: the replica's :class:`~lightning_gossip.flat.FlatState`.
        rank: this rank (global).
        topology: gives ``W_t`` (over ranks; over nodes when ``layout.devices > 1``).
        group: a process group of the engine's own for the replica and stop messages (never
            one the training loop also uses).
        timeout: limit for every blocking wait.
        overlap: snapshot ``x_t`` and start the exchange in :meth:`before_step`, so it runs
            while the gradient is computed; :meth:`after_step` adds ``W_t x_t - x_t``.
            ``False``: :meth:`after_step` exchanges ``x'`` (the result of the local step) and
            replaces it by ``W_t x'`` (blocking).
        delay_by_one: :meth:`after_step` at step ``t`` adds the change of the round started at
            step ``t - 1``. Implies ``overlap``.
        wire_dtype: what is sent: ``torch.float32``, or ``bfloat16`` / ``float16``, mixed in
            the mean-preserving form ``x_i += sum_j W_ij (Q(x_j) - Q(x_i))``.
        layout: this rank's place in the nodes (hierarchical gossip: ``devices > 1``); default
            ``NodeLayout(world, 1, rank, 0)`` (flat).
        groups: with ``layout.devices > 1``, this rank's node and column groups
            (:func:`~lightning_gossip.hierarchy.make_node_groups`). With ``node_gossip`` the
            communication thread all-gathers a round's slices; without it ``node_gather``
            (the training thread's all-gather on the node group, as with NCCL) must be given.
        node_gather: see ``groups``.
        heartbeat: watched by every wait of the training thread (a silent peer is named);
            ``None``: the process's running heartbeat, if any.
        stats: counters to add to (e.g. kept over several engines of one process); default
            new ones.
        period: local optimizer steps per round (``gossip_every_n_steps``, default 1: a round
            every step): only the last step ``e`` of every period exchanges, mixing with
            ``W_e``; overlapped, that round is posted at the period's first step and hides
            behind its ``period`` steps (:class:`~.schedule.RoundSchedule`).
        auto: ``gossip_every_n_steps="auto"``: the
            :class:`~lightning_gossip.gossip_period.auto.PeriodDriver` (``agree=True``) that
            this engine tells its steps, exchange times and sync points; when a decision is
            due it quiesces the engine, agrees on the period with every rank (an all-reduce on
            a group of the training thread) and calls :meth:`set_period`, all inside
            :meth:`after_step`. Start with ``period=1``.

    Call from the training thread, on every rank, for every step ``t`` (the same on every
    rank, also the steps that exchange nothing): :meth:`before_step` before forward/backward,
    :meth:`after_step` after the optimizer step. :meth:`quiesce` applies every round in
    flight (a sync point), :meth:`close` stops the communication thread. :attr:`agreement`
    carries an agreed stop step in every round's side message
    (:mod:`lightning_gossip.sync_gossip.stop`).
    """

    def __init__(self, flat: FlatState, rank: int, topology: Topology,
                 group: dist.ProcessGroup, timeout: timedelta, *, overlap: bool = True,
                 delay_by_one: bool = False, wire_dtype: torch.dtype = torch.float32,
                 layout: NodeLayout | None = None, groups: NodeGroups | None = None,
                 node_gather: NodeGather | None = None,
                 heartbeat: Heartbeat | None = None, stats: SyncStats | None = None,
                 period: int = 1, auto: PeriodDriver | None = None) -> None:
        self.flat = flat
        self.rank = rank
        self.topology = topology
        self.group = group
        self.timeout = timeout
        self.delay_by_one = bool(delay_by_one)
        self.overlap = bool(overlap) or self.delay_by_one
        self.wire_dtype = wire_dtype
        self.layout = layout if layout is not None else NodeLayout(topology.world_size, 1,
                                                                    rank, 0)
        if self.layout.devices > 1 and groups is None:
            raise ValueError("a SyncGossip over nodes (layout.devices > 1) needs groups")
        self.groups = groups if groups is not None else NodeGroups(node=group, column=group)
        if self.layout.devices > 1 and self.groups.node_gossip is None and node_gather is None:
            raise ValueError("groups without node_gossip: give node_gather (the training "
                             "thread's all-gather on the node group)")
        self.node_gather = node_gather
        self.heartbeat = heartbeat
        #: which steps exchange (the gossip period), when rounds are posted and applied
        self.schedule = RoundSchedule(period, self.overlap, self.delay_by_one)
        self.schedule.check_connects(topology)
        self.agreement = StopAgreement(topology, self.layout, self.delay_by_one, self.schedule)
        #: rounds sharded over the node (and compressed rounds, also flat)
        self.sharded = self.layout.devices > 1 or wire_dtype != torch.float32
        #: flat rounds: with NCCL the training thread posts (the send must be ordered on its
        #: CUDA stream, untested); with gloo the worker (gloo's send writes to the socket on
        #: the calling thread: about 3 ms of a 42 MB step here). Rounds are posted in order
        #: either way: the worker runs its jobs first in, first out.
        self._post_on_training_thread = dist.get_backend(group) == "nccl"
        self._stats = stats if stats is not None else SyncStats()
        self._pending: list[Round] = []  # started, not yet applied (oldest first)
        self._last_round: int | None = None  # the exchange step of the last round started
        self._posted_at: int | None = None  # the step at which it was posted
        self._spare: list[list[Tensor]] = []  # recycled buffer sets
        self._worker: CommWorker | None = None  # finishes the rounds off the training thread
        #: ``gossip_every_n_steps="auto"``: the period's driver (``None``: a fixed period)
        self.auto = auto
        if auto is not None:
            auto.counts_from(self._stats.exchanges_timed, self._stats.exchange_seconds,
                             self._stats.peer_wait_seconds)

    # ------------------------------------------------------------------------------------------
    # The training thread's API
    # ------------------------------------------------------------------------------------------
    @property
    def stats(self) -> SyncStats:
        """This rank's counters (bytes and messages sent, rounds started)."""
        return self._stats

    @property
    def process_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups the communication thread's waits use (kept to the end of the process
        when the engine is abandoned on a lost peer)."""
        node = self.groups.node_gossip
        return (self.group,) if node is None else (self.group, node)

    @property
    def in_flight(self) -> int:
        """Rounds started and not yet applied."""
        return len(self._pending)

    def start(self) -> None:
        """Start the communication thread (idempotent; also restarts a stopped one)."""
        self._comm()

    @property
    def period(self) -> int:
        """Local optimizer steps per round (``gossip_every_n_steps``)."""
        return self.schedule.period

    def set_period(self, period: int) -> None:
        """Exchange every ``period`` steps from the next step on (the seam of a period picked
        while training, ``gossip_every_n_steps="auto"``). Every rank must call it at the same
        step boundary with the same ``period``, with no round in flight (after
        :meth:`quiesce`) and no stop or requeue proposed (its step was agreed along the old
        rounds); ``RuntimeError`` otherwise. The exchange steps stay counted from step 0. Switch
        where a period ends (:meth:`period_ends`): mid-period, a round that :meth:`quiesce`
        applied early would be posted again at its exchange step."""
        if self._pending:
            raise RuntimeError("set_period needs no round in flight: call quiesce() first")
        if self.agreement.values() != (NO_STOP, NO_STOP):
            raise RuntimeError("set_period after a stop or requeue was proposed: its step was "
                               "agreed along the rounds of the old period")
        schedule = RoundSchedule(period, self.overlap, self.delay_by_one)
        schedule.check_connects(self.topology)
        self.schedule = schedule
        self.agreement.reschedule(schedule)
        self._last_round = None  # the new period's rounds, even one of the same exchange step

    @property
    def stop_proposed(self) -> bool:
        """Whether this rank knows of a proposed stop or requeue (:attr:`agreement`)."""
        return self.agreement.values() != (NO_STOP, NO_STOP)

    def pending_proposal(self, step: int) -> int | None:
        """The latest step of a stop or requeue this rank knows of that is still to come after
        ``step`` (``None``: none). One agreed for ``step`` or earlier was acted on there by
        every rank (a stop ends the fit; a requeue whose ``scontrol`` failed lets it go on)."""
        later = [v for v in self.agreement.values() if v != NO_STOP and v > step]
        return max(later) if later else None

    def forget_proposals(self) -> None:
        """Forget every stop and requeue proposal this rank knows of (all acted on), so that
        :meth:`set_period` may switch again. Every rank must call it at the same step boundary,
        with no round in flight (after :meth:`quiesce`) and no proposal pending on any rank
        (:meth:`pending_proposal`): then no message carries an old proposal any more."""
        if self._pending:
            raise RuntimeError("forget_proposals needs no round in flight: call quiesce() first")
        self.agreement.reset()

    def period_ends(self, step: int) -> bool:
        """Whether ``step`` is the last step of a period (its exchange step): after its
        :meth:`after_step` the period's round is applied (with ``delay_by_one``, in flight
        until :meth:`quiesce`), and no later step belongs to it: where :meth:`set_period`
        switches without posting a round of the old period again."""
        return self.schedule.is_round(step)

    def started(self, step: int) -> bool:
        """Whether the round of exchange step ``step`` is in flight."""
        return any(r.step == step for r in self._pending)

    def before_step(self, step: int) -> None:
        """Before forward/backward of step ``step`` (``overlap``): at a period's first step,
        snapshot the replica and start the period's round, once (under gradient accumulation
        ``x_t`` does not change)."""
        entered = time.perf_counter()
        round_step = self.schedule.started_at(step)
        if round_step is not None and self._last_round != round_step:
            self._start(round_step, step)
        if self.auto is not None:
            self.auto.left(entered)

    def after_step(self, step: int) -> None:
        """After the optimizer step of ``step``: mix as ``W_step`` says at an exchange step.

        Blocking: exchange now and replace the replica by the mixed one. ``overlap``: add the
        change of this period's round. ``delay_by_one``: add that of the round of the previous
        step, if it was an exchange step (the first adds nothing). Other steps exchange nothing.
        With :attr:`auto`, then the step is recorded and a due decision taken (see ``auto``).
        """
        auto = self.auto
        if auto is None:
            self._mix_after(step)
            return
        auto.compute_ends()
        self._mix_after(step)
        stats = self._stats
        auto.step_done(self, step, stats.exchanges_timed, stats.exchange_seconds,
                       stats.peer_wait_seconds)

    def _mix_after(self, step: int) -> None:
        """:meth:`after_step`'s mixing."""
        schedule = self.schedule
        if not self.overlap:
            if schedule.is_round(step):
                self._finish_blocking(self._start(step, step))
            return
        if schedule.is_round(step) and self._last_round != step:
            self._start(step, step)  # before_step was not called: start it now
        while self._pending and schedule.apply_step(self._pending[0].step) <= step:
            self._apply_delta(self._pending.pop(0))

    def quiesce(self) -> None:
        """Finish every round in flight and apply its change (no mixing is lost)."""
        while self._pending:
            self._apply_delta(self._pending.pop(0))
        if self.auto is not None:
            self.auto.sync_point()

    def propose_stop(self, kind: str, step: int) -> int:
        """Propose an agreed stop (``"stop"``) or requeue at the first step every rank can
        know of it, from the next round this rank sends (the current step's, if not yet
        started); returns that step."""
        first = step + (1 if self._posted_at == step else 0)
        return self.agreement.propose(kind, self.rank, first)

    def abandon(self) -> None:
        """A peer was lost (elastic fit): :meth:`close`, the rounds in flight dropped unapplied
        (their messages may never come). The engine is not used again: the survivors keep its
        :attr:`process_groups` to the end of the process and start a new one."""
        self.close()

    def close(self) -> None:
        """Drop rounds in flight and buffers, and stop the communication thread (idempotent;
        :meth:`start` makes the engine usable again)."""
        self._pending.clear()
        self._spare.clear()
        self._last_round = self._posted_at = None
        if self._worker is not None:
            self._worker.close(timeout=0.5)
            if self._worker.alive and self.groups.node_gossip is not None:
                # maybe inside a sharded round's all-gather: its group must outlive the process
                keep_alive_at_exit(self.groups.node_gossip)
            self._worker = None

    # ------------------------------------------------------------------------------------------
    # Starting a round (training thread): the snapshot copy, then post
    # ------------------------------------------------------------------------------------------
    def _start(self, step: int, now: int) -> Round:
        """Post the round of exchange step ``step`` at step ``now``: its stop messages first,
        then the replica (a peer's stop message arriving says that the peer has posted the
        round: :meth:`_peers_posted`)."""
        self._last_round, self._posted_at = step, now
        if self.sharded:
            rnd = self._start_sharded(step)
        else:
            peers = self.topology.peers(self.rank, step)
            flat = self.flat
            bufs = self._spare.pop() if self._spare else [flat.empty(), flat.empty()]
            send = flat.pack(out=bufs[0])
            stop = self._post_stop(step)
            exchange = NeighborExchange(send, peers, self.group, recv_buffers=bufs[2:],
                                        post_now=self._post_on_training_thread)
            self._stats.count(exchange)
            rnd = Round(step, exchange, delta=bufs[1], stop=stop)
            rnd.job = self._comm().submit(lambda: self._finish_round(rnd), exchange.others,
                                          exchange.describe(step))
        if self.overlap:
            self._pending.append(rnd)
        return rnd

    def _start_sharded(self, step: int) -> Round:
        flat, layout = self.flat, self.layout
        if self._spare:
            bufs = self._spare.pop()
        else:  # a zeroed fp32 vector of devices * shard values (the replica, zero-padded)
            size = layout.devices * layout.shard_size(flat.numel)
            bufs = [torch.zeros(size, dtype=torch.float32, device=flat.device)]
        snapshot = bufs[0]  # a recycled one holds an earlier round's delta: pack, zero the pad
        flat.pack(out=snapshot[: flat.numel])
        snapshot[flat.numel:].zero_()
        stop = self._post_stop(step)  # before the slice (see _start)
        exchange = ShardedExchange(snapshot, layout, self.topology.peers(layout.node, step),
                                   self.groups, self.wire_dtype, buffers=bufs[1:])
        self._stats.count(exchange.exchange)
        # the worker writes the delta over the snapshot (dead once the slice is on the wire)
        rnd = Round(step, exchange, delta=snapshot, stop=stop)
        rnd.job = self._comm().submit(lambda: self._finish_sharded(rnd), exchange.others,
                                      exchange.describe(step))
        return rnd

    def _post_stop(self, step: int):  # noqa: ANN202 - StopMessages
        return self.agreement.post(self.rank, step, self.group, self.flat.device)

    def _gather_on_worker(self) -> bool:
        """Whether the worker all-gathers a sharded round's slices (not with NCCL: see
        ``docs/architecture.md``); one process per node has nothing to gather."""
        return self.groups.node_gossip is not None

    def _comm(self) -> CommWorker:
        if self._worker is None or not self._worker.alive:
            self._worker = CommWorker(name=f"lightning-gossip-comm-{self.rank}",
                                      groups=self.process_groups)
        return self._worker

    # ------------------------------------------------------------------------------------------
    # Finishing a round (communication thread): wait, check, mix into the round's delta
    # ------------------------------------------------------------------------------------------
    def _finish_round(self, rnd: Round) -> None:
        """Wait for the round's messages (plainly: :meth:`Job.result` watches the peers),
        check them, and mix: ``delta = W_t x_t - x_t`` (overlap) or ``W_t x'_t`` (blocking)."""
        started = time.perf_counter()
        ex = rnd.exchange
        assert isinstance(ex, NeighborExchange) and rnd.delta is not None
        ex.post()  # (gloo: posted here, on the worker)
        ready = self._peers_posted(rnd, ex.describe(rnd.step))
        ex.wait(self.timeout, step=rnd.step, watch_peers=False, check=False)
        ex.check_mixed(ex.mixed(out=rnd.delta, delta=self.overlap))
        rnd.timed(started, ready, time.perf_counter())  # read after the job is done

    def _finish_sharded(self, rnd: Round) -> None:
        """Wait for a sharded round's messages (plainly), then ``delta = sum_j W_ij (x_j -
        x_i)`` over the node replica, written over the snapshot: this rank's slice, and the
        all-gather on the worker's own node group."""
        started = time.perf_counter()
        ex = rnd.exchange
        assert isinstance(ex, ShardedExchange) and rnd.delta is not None
        ready = self._peers_posted(rnd, ex.describe(rnd.step))
        ex.delta(self.timeout, rnd.step, out=rnd.delta, watch_peers=False,
                 gather=self._gather_on_worker())
        rnd.timed(started, ready, time.perf_counter())

    def _peers_posted(self, rnd: Round, what: str) -> float:
        """Wait for the round's stop messages and merge them; the moment the last one was in
        (``time.perf_counter()``). Every rank posts a round's stop messages before its replica
        data (:meth:`_start`), so from then on every rank the round depends on has posted it:
        the time before is a wait for late peers (their compute), not the exchange's own
        (:attr:`Round.exchange_s` counts from here). A failed wait is described as the round
        (``what``)."""
        if rnd.stop is not None:
            wait_all(rnd.stop.works, self.timeout, what)  # (once: gloo's works wait per call)
            self.agreement.merge(*rnd.stop.received())  # (reading them syncs a CUDA stream)
        return time.perf_counter()

    # ------------------------------------------------------------------------------------------
    # Applying a round (training thread)
    # ------------------------------------------------------------------------------------------
    def _collect(self, rnd: Round) -> Tensor:
        """Wait for a round: its mixed result (flat), or its delta (sharded, unpadded)."""
        assert rnd.job is not None and rnd.delta is not None
        ex = rnd.exchange
        if not isinstance(ex, ShardedExchange):
            rnd.job.result(self.timeout, self.heartbeat)
            return rnd.delta
        try:
            rnd.job.result(self.timeout, self.heartbeat)
        except BaseException:
            if self._gather_on_worker():  # the worker may be in the all-gather: keep its group
                keep_alive_at_exit(self.groups.node_gossip)
            raise
        if self.layout.devices > 1 and not self._gather_on_worker():
            assert self.node_gather is not None
            size = ex.shard.numel()
            mine = rnd.delta[self.layout.local * size:(self.layout.local + 1) * size]
            started = time.perf_counter()
            self.node_gather(mine.clone(), rnd.delta)  # NCCL: the training thread's
            rnd.exchange_s += time.perf_counter() - started  # part of the round's exchange
        return rnd.delta[: self.flat.numel]

    def _apply_delta(self, rnd: Round) -> None:
        """``x <- x + (W_t x_t - x_t)``: add the mixing's change to the current weights."""
        self.flat.add_(self._collect(rnd))
        self._stats.timed(rnd.exchange_s, rnd.peer_wait_s)
        self._spare.append(rnd.buffers())

    def _finish_blocking(self, rnd: Round) -> None:
        """``x <- W_t x'``: replace the weights by the mixed ones."""
        if isinstance(rnd.exchange, ShardedExchange):  # x' + sum_j W_ij (x'_j - x'_i)
            self._apply_delta(rnd)
            return
        self.flat.copy_(self._collect(rnd))
        self._stats.timed(rnd.exchange_s, rnd.peer_wait_s)
        self._spare.append(rnd.buffers())
