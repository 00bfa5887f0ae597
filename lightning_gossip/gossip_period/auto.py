"""``gossip_every_n_steps="auto"`` while training: :class:`PeriodDriver` measures, reduces and
switches the period of one engine; the engines call it, so the Trainer strategies, Fabric's
strategies and :func:`~lightning_gossip.attach` all get it from the engine they build.

The engine (:class:`~lightning_gossip.sync_gossip.SyncGossip` or
:class:`~lightning_gossip.async_gossip.AsyncGossip`, given ``auto=PeriodDriver(...)``) calls,
on the training thread, :meth:`PeriodDriver.left` when its ``before_step`` returns,
:meth:`PeriodDriver.compute_ends` when its ``after_step`` is called, :meth:`PeriodDriver.step_done`
when its ``after_step`` has done its work (with its cumulative exchange counters), and
:meth:`PeriodDriver.sync_point` from its ``quiesce``.

**What is measured.** ``compute_s`` of a step: the training thread's time between the engine's
calls, from the end of the previous step's ``after_step`` (after a sync point: from the return
of ``before_step``) to the call of this step's ``after_step``, without the time inside
``before_step``: forward, backward and the optimizer step, and no wait for gossip (which
happens inside the engine's calls), whether the loop calls ``before_step`` before forward (the
Trainer strategies) or at ``optimizer.step()`` (``attach``, Fabric). ``exchange_s``: the wire
time of each exchange, measured where it runs (``SyncGossip``: the communication worker, from
the moment every peer of the round had posted it to holding every peer's data, mixed, with the
node's all-gather of a sharded round; ``AsyncGossip``: the gossip thread, from the moment both
sides of the pairwise exchange had posted it to holding the partner's snapshot, mixed), handed
to the training thread as cumulative seconds and counts in the engine's stats and diffed per
step. The waits for peers that posted later are counted apart (cumulative too) and reported
with every decision (:attr:`PeriodSwitch.local_peer_wait_s`).

**Why not from posting** (``dpsgd``; ``adpsgd`` alike, for a passive that answers late:
:mod:`lightning_gossip.async_gossip.loops`): a synchronous round cannot complete before the last of
its peers posts it, so a rank whose step is shorter than a neighbour's waits for that
neighbour's compute inside every round; timed from its own posting, that wait would count as
link time, the maximum over the ranks would take it, and R would be overestimated (on an
oversubscribed machine, or with one slow rank, by about the slowest rank's extra compute per
step, which no period hides: the period would grow for nothing). Every rank posts a round's
small stop messages (:mod:`lightning_gossip.sync_gossip.stop`) before its replica data, so the
arrival of the last peer's stop message is the moment every peer has posted: the worker waits
for the stop messages first and times the exchange from there (the wait before it is kept
apart, in ``SyncStats.peer_wait_seconds``). What the measurement leaves out besides: the
rendezvous of the messages, at most about one round trip of the link, which the margin
covers.

**When a decision is due** (:attr:`PeriodTuner.due <.tuner.PeriodTuner.due>`), at the first
step after it that ends a period of the engine (``SyncGossip.period_ends``: its exchange step,
whose round is applied, so no round of the old period is posted again under the new one; every
step for ``AsyncGossip``):

* ``agree=True`` (``dpsgd``: every rank must switch at the same step): the engine is quiesced,
  the maxima over all ranks of this rank's medians (and the latest step of a stop or requeue
  still to come that any rank knows of) are taken with one all-reduce on ``group``, a group of
  the *training* thread (the default group, or the ``attach`` meeting group: never one of the
  engine's own, which its communication thread uses), then every rank decides the same period
  and calls the engine's ``set_period`` at the same step. While a stop or requeue is pending
  (its step was agreed along the rounds of the period in force, so the period must not change
  before it) the decision is postponed to that step (:attr:`PeriodDriver.postponed`); by then
  every rank has acted on it (a stop ends the fit; a requeue whose ``scontrol`` failed lets it
  go on), so at the postponed decision every rank forgets the proposals it acted on
  (``forget_proposals``) and the re-checks go on as before.
* ``agree=False`` (``adpsgd``): this rank's medians, no collective; a rank that has recorded
  no exchange yet decides at a later step.

Every decision is logged on the ``lightning_gossip.gossip_period.auto`` logger (INFO,
:meth:`~.tuner.PeriodDecision.describe`) and kept in :attr:`PeriodDriver.switches`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from lightning_gossip.gossip_period.tuner import AutoPeriod, PeriodDecision
from lightning_gossip.liveness import Heartbeat, watched_collective

__all__ = ["PeriodDriver", "PeriodSwitch"]

log = logging.getLogger(__name__)

#: the compute time a step that measured none counts with (the policy needs one > 0)
_TINY_S = 1e-9


class _Engine(Protocol):
    """What the driver asks of its engine."""

    def quiesce(self) -> None: ...  # noqa: D102

    def set_period(self, period: int) -> None: ...  # noqa: D102

    def period_ends(self, step: int) -> bool: ...  # noqa: D102


class _AgreeingEngine(_Engine, Protocol):
    """What the driver asks besides of an engine whose ranks agree on the period (``dpsgd``:
    its stop and requeue proposals, agreed along the rounds)."""

    def pending_proposal(self, step: int) -> int | None: ...  # noqa: D102

    def forget_proposals(self) -> None: ...  # noqa: D102


@dataclass(frozen=True)
class PeriodSwitch:
    """One decision and where it took effect: ``step``, the first step under
    ``decision.period`` (the engine's step numbers); ``local_compute_s`` and
    ``local_exchange_s``, this rank's medians (``decision`` holds the values the policy was
    given: for ``dpsgd`` the maxima over the ranks; a window without an exchange reports 0);
    ``local_peer_wait_s``, this rank's mean wait per exchange, since the previous decision (or
    the engine's start), for peers that posted the exchange after it: the time kept out of
    the exchange times (``SyncStats.peer_wait_seconds``, ``GossipStats.peer_wait_s``; 0
    without an exchange)."""

    step: int
    local_compute_s: float
    local_exchange_s: float
    decision: PeriodDecision
    local_peer_wait_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the decision's fields under ``"decision"``)."""
        return asdict(self)


class PeriodDriver:
    """Drives a :class:`~.tuner.PeriodTuner` for one engine (see the module's docstring).

    Args:
        settings: the tuner's settings (``"auto"``: ``AutoPeriod()``).
        agree: ``True`` for ``dpsgd`` (one period for all ranks, switched at the same step),
            ``False`` for ``adpsgd`` (each rank its own).
        rank: this rank (for the log).
        timeout: limit of the all-reduce (``agree``).
        group: the training thread's group over every rank for the all-reduce (``agree``;
            ``None``: the default group). Never a group of the engine's own.
        device: where the all-reduce's tensor lives (a CUDA device with NCCL).
        heartbeat: watched by the all-reduce (a silent rank is named); ``None``: the
            process's running heartbeat, if any.
    """

    def __init__(self, settings: AutoPeriod, *, agree: bool, rank: int = 0,
                 timeout: timedelta = timedelta(minutes=5), group: Any = None,
                 device: torch.device | str = "cpu", heartbeat: Heartbeat | None = None) -> None:
        self.settings = settings
        self.tuner = settings.tuner()
        self.agree = bool(agree)
        self.rank = rank
        self.timeout = timeout
        self.group = group
        self.device = torch.device(device)
        self.heartbeat = heartbeat
        #: every decision with the step it took effect at, oldest first
        self.switches: list[PeriodSwitch] = []
        #: ``(step, until)`` of every due decision postponed (``agree``) at engine step
        #: ``step`` because a stop or requeue was pending until engine step ``until``
        self.postponed: list[tuple[int, int]] = []
        self._since: float | None = None  # when this step's compute started
        self._inside = 0.0  # seconds inside before_step since then
        self._seen = (0, 0.0)  # the engine's exchange count and seconds at the last step
        self._compute_end: float | None = None
        # the engine's exchange count and summed peer wait at the last decision, and now
        self._waits_from = self._waits = (0, 0.0)

    @property
    def period(self) -> int:
        """The period in force (1 before the first decision)."""
        return self.tuner.period

    @property
    def decisions(self) -> tuple[PeriodDecision, ...]:
        """Every decision so far, oldest first."""
        return self.tuner.decisions

    # -- the engine's calls (training thread) ---------------------------------------------------
    def counts_from(self, exchanges: int, exchange_seconds: float,
                    peer_wait_seconds: float = 0.0) -> None:
        """The engine's cumulative exchange counters when it is built (they may carry an
        earlier fit's): later steps count what was added to them."""
        self._seen = (exchanges, exchange_seconds)
        self._waits_from = self._waits = (exchanges, peer_wait_seconds)

    def left(self, entered: float) -> None:
        """The engine's ``before_step``, entered at ``entered`` (``time.perf_counter()``), now
        returns: the step's compute starts now (the first step, or after a sync point), or
        the time inside it is not compute."""
        now = time.perf_counter()
        if self._since is None:
            self._since, self._inside = now, 0.0
        else:
            self._inside += now - entered

    def compute_ends(self) -> None:
        """The engine's ``after_step`` is called: the step's compute ends."""
        self._compute_end = time.perf_counter()

    def sync_point(self) -> None:
        """The engine was quiesced (a sync point): the next compute starts at the next
        ``before_step``."""
        self._since = None

    def step_done(self, engine: _Engine, step: int, exchanges: int,
                  exchange_seconds: float, peer_wait_seconds: float = 0.0
                  ) -> PeriodSwitch | None:
        """The engine's ``after_step(step)`` did its work: record the step (its compute, the
        exchanges completed since the last call: ``exchanges``, ``exchange_seconds`` and
        ``peer_wait_seconds``, the waits for late peers kept out of them, are the engine's
        cumulative counters), decide when due. Returns the new switch, if any."""
        end = self._compute_end if self._compute_end is not None else time.perf_counter()
        compute = 0.0 if self._since is None else max(end - self._since - self._inside, 0.0)
        count, seconds = exchanges - self._seen[0], exchange_seconds - self._seen[1]
        self._seen = (exchanges, exchange_seconds)
        self._waits = (exchanges, peer_wait_seconds)
        tuner = self.tuner
        each = max(seconds, 0.0) / count if count > 0 else None
        for _ in range(count - 1):  # more than one exchange completed during the step
            tuner.record_exchange(each)
        tuner.record(compute, each)
        due = tuner.due and engine.period_ends(step)
        switch = self._decide(engine, step) if due else None
        self._since, self._inside, self._compute_end = time.perf_counter(), 0.0, None
        return switch

    # -- deciding -------------------------------------------------------------------------------
    def _local(self) -> tuple[float, float] | None:
        """This rank's medians; ``None`` before any exchange was recorded (an exchange time of
        0 then, for ``agree``)."""
        try:
            return self.tuner.local_values()
        except RuntimeError:
            return None

    def _decide(self, engine: _Engine, step: int) -> PeriodSwitch | None:
        local = self._local()
        if self.agree:
            agreeing = cast(_AgreeingEngine, engine)  # (SyncGossip)
            engine.quiesce()
            c, x = local if local is not None else (0.0, 0.0)
            # the step of a stop or requeue still to come that this rank knows of (-1: none)
            pending = agreeing.pending_proposal(step)
            values = torch.tensor([c, x, -1.0 if pending is None else float(pending)],
                                  dtype=torch.float64, device=self.device)
            watched_collective(dist.all_reduce, values, op=dist.ReduceOp.MAX,
                               what=f"rank {self.rank}: agreeing on the gossip period after "
                               f"step {step} (gossip_every_n_steps='auto')",
                               timeout=self.timeout, group=self.group, heartbeat=self.heartbeat)
            c_max, x_max, until = (float(v) for v in values.tolist())
            if until > step:  # the same on every rank: postponed to that step
                self.tuner.postpone(int(until) - step)
                self.postponed.append((step, int(until)))
                log.info("rank %d: gossip_every_n_steps='auto' keeps period %d until step %d: "
                         "a stop or requeue is agreed for then", self.rank, self.tuner.period,
                         int(until))
                return None
            agreeing.forget_proposals()  # none pending anywhere: each was acted on
            decision = self.tuner.decide(max(c_max, _TINY_S), x_max)
        else:
            if local is None:
                return None  # no exchange yet: decide at a later step
            decision = self.tuner.decide(max(local[0], _TINY_S), local[1])
        engine.set_period(decision.period)
        lc, lx = local if local is not None else (0.0, 0.0)
        count, waited = (a - b for a, b in zip(self._waits, self._waits_from))
        self._waits_from = self._waits
        switch = PeriodSwitch(step + 1, lc, lx, decision,
                              max(waited, 0.0) / count if count > 0 else 0.0)
        self.switches.append(switch)
        log.info("rank %d: %s", self.rank, decision.describe())
        return switch
