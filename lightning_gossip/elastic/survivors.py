"""The survivors' side of a lost rank in an elastic fit (``ADPSGDStrategy(elastic=True)`` and
``DPSGDStrategy(elastic=True)``): :class:`Survivors`, owned by the strategy as
``strategy.survivors``, built from values and the fit's :class:`~.session.ElasticSession`.

A loss surfaces in the training thread as :class:`~lightning_gossip.errors.PeerSilent` (the
liveness monitor's finding at a step boundary, a gossip wait on the lost rank, a watched
collective at a meeting). :meth:`Survivors.recover` then, on every survivor: (1) stops the gossip
engine without ending its phase, applying the deltas already received (:meth:`~lightning_gossip.
async_gossip.AsyncGossip.abandon`; ``dpsgd``: its rounds in flight dropped); (2) agrees with the
others on the live ranks (:class:`~lightning_gossip.elastic.membership.Membership`) and stops
watching the lost ones; (3) builds new groups over the live ranks (Lightning's collectives,
gossip control and data; hierarchical: the lost rank's whole node leaves, :mod:`~.nodes`) and
puts them in the session; (4) returns the lost ranks' claimed but untrained batches to the
shared cursor; (5) starts a new gossip engine over the live ranks (:class:`Engines`: ``adpsgd``
its phase open, :class:`~.engines.PairwiseEngines`; ``dpsgd`` from a step the survivors agree
on, :class:`~.rounds.RoundEngines`) and makes it the session's; (6) warns (rank 0), naming the
lost ranks and the step, and logs ``gossip/live_learners``.

A process that takes a lost rank's slot (:mod:`~.newcomer`) asks in the store;
:meth:`Survivors.poll` finds the request at a step boundary (``dpsgd``: the members look at an
agreed step, :meth:`~.rounds.ElasticRounds.admit_joins`; a hierarchical ``adpsgd`` node's ranks
in their gradient all-reduce, :meth:`Survivors.admit_agreed`) and :meth:`Survivors.admit` lets
it in: steps 1-3 with the newcomer added, then the members' exact average and the lowest member's
checkpoint are handed over (:func:`~.newcomer.hand_over`). The loss of the rank that hosts the
rendezvous store (rank 0 under Lightning's launcher and ``srun``) is not survived: the fit falls
back to the emergency checkpoint (``docs/faults.md``).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from lightning_gossip.cursor.store import default_store
from lightning_gossip.elastic.claim_ledger import ClaimLedger
from lightning_gossip.elastic.joins import NodeJoins
from lightning_gossip.elastic.membership import POLL_EVERY_S, Membership
from lightning_gossip.elastic.nodes import ElasticGroups, generation_groups
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.errors import PeerSilent, RankExcluded, lost_ranks
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.liveness import Heartbeat, keep_alive_at_exit
from lightning_gossip.liveness.store import bounded

__all__ = ["LIVE_METRIC", "Engine", "Engines", "Survivors"]

log = logging.getLogger(__name__)

LIVE_METRIC = "gossip/live_learners"
"""The metric an elastic fit logs at its start and after every loss: the live ranks."""

T = TypeVar("T")


class Engine(Protocol):
    """What the survivors do with a gossip engine (:class:`~lightning_gossip.async_gossip.
    AsyncGossip` or :class:`~lightning_gossip.sync_gossip.SyncGossip`)."""

    process_groups: tuple[Any, ...]

    def abandon(self) -> Any:
        """Stop, a peer being lost: no wait on the others. Returns what the next engine
        must :meth:`carry` (``None``: nothing)."""

    def carry(self, leftover: Any) -> None:
        """Take what the abandoned engine returned (only called with something)."""

    def quiesce(self) -> None:
        """Finish the exchanges in flight (every member is there)."""

    def close(self) -> None:
        """Stop."""


class Engines(Protocol):
    """How the survivors build the fit's next engine (one signature for both strategies:
    :class:`~.engines.PairwiseEngines`, :class:`~.rounds.RoundEngines`)."""

    def over(self, live: Sequence[int], groups: ElasticGroups) -> Engine | None:
        """A started engine over the live ranks ``live`` and their ``groups``; ``None``:
        nothing to gossip with (a lone learner)."""


class Survivors:
    """Recovery from lost ranks and admission of newcomers (see the module docstring).

    Args:
        session: the fit's session: its step is read, its engine, membership and groups are
            replaced through it.
        run: the fit's name, the same on every rank (it prefixes its keys in the store).
        rank, world_size, timeout: those of the fit's
            :class:`~lightning_gossip.elastic.membership.Membership`.
        heartbeat: this rank's heartbeat (its finding names the lost ranks; it must run).
        backend: the backend of Lightning's collectives and of the gossip data group.
        engines: builds the engine over the live ranks after a loss or a join.
        epoch: the current epoch (the lost ranks' untrained batches of it go back to the
            shared cursor, through the :meth:`ledger` of the training loader).
        loggers: where :data:`LIVE_METRIC` goes (rank 0's loggers; empty elsewhere).
        membership: a newcomer's or founder's, with its first ``groups``; default: a new one,
            every rank live.
        hand_over: ``(old group, new group, newcomers, lowest)``: the members' side of a join
            (:func:`~.newcomer.hand_over` with the fit's values); ``None``: joins are refused.
        poll_joins: admit newcomers from :meth:`poll` (``False``: the owner calls :meth:`admit`
            itself, at a step every member agreed on: synchronous gossip).
        on_group: ``(group)``: told the new group of Lightning's collectives after every loss
            and join (the module's metrics gather over it); ``None``: nobody.
        layout: the fit's nodes: what leaves together (hierarchical: a node, :mod:`~.nodes`);
            ``None``: each rank alone.
        synchronous: hierarchical ``dpsgd``: each generation builds that strategy's groups
            too (:func:`~.nodes.generation_groups`).
        node: hierarchical: this rank's node averaging (:class:`~lightning_gossip.
            node_averaging.NodeAverager`); with joins, its every gradient all-reduce carries
            the join flags (:class:`~.joins.NodeJoins`), so that the node's ranks admit a
            node's newcomers together (:meth:`admit_agreed`).
    """

    def __init__(self, session: ElasticSession, run: str, rank: int, world_size: int,
                 timeout: timedelta, *, heartbeat: Heartbeat | None, backend: str,
                 engines: Engines, epoch: Callable[[], int], loggers: Sequence[Any] = (),
                 membership: Membership | None = None, groups: ElasticGroups | None = None,
                 hand_over: Callable[[Any, Any, list[int], bool], None] | None = None,
                 poll_joins: bool = True, on_group: Callable[[Any], None] | None = None,
                 layout: NodeLayout | None = None, synchronous: bool = False,
                 node: Any = None) -> None:
        if heartbeat is None:
            raise ValueError("an elastic fit finds lost ranks by their heartbeat: "
                             "heartbeat_timeout must not be None")
        store = dist.PrefixStore(f"elastic/{run}/", default_store())
        self.session = session
        self.membership = membership or Membership(store, rank, world_size, timeout, run)
        session.begin(self.membership, groups)
        self.hand_over, self.poll_joins, self.on_group = hand_over, poll_joins, on_group
        #: the fit's nodes (a flat fit: each rank alone); its generations' groups
        #: (:func:`~.nodes.generation_groups`: with ``synchronous``, hierarchical dpsgd's too)
        self.layout = layout or NodeLayout.flat(world_size, rank)
        self.synchronous = synchronous
        #: the generation this process's membership began at (a newcomer's admission; 0 for a
        #: process that started the fit): its node's claim keys are named by it
        #: (:attr:`~.claim_ledger.ClaimLedger.incarnation`)
        self.incarnation = self.membership.generation
        self._polled = 0.0  # when the membership was last polled for joins
        #: hierarchical: how a node's ranks agree on joins (``None``: flat, or no joins)
        self.node_joins: NodeJoins | None = None
        if node is not None and hand_over is not None and poll_joins:
            self.node_joins = NodeJoins(session, self.layout, self.asked_to_join)
            node.ride(self.node_joins)
        #: one entry per join: ``(step, newcomers, wall time the admission began, seconds)``
        self.joins: list[tuple[int, tuple[int, ...], float, float]] = []
        self.heartbeat = heartbeat
        self.backend = backend
        #: the rank whose loss cannot be survived: it hosts the store (``None``: a launcher)
        self.store_host = heartbeat.store_host
        #: how long the survivors may take to gather after a loss
        self.deadline_s = 3 * heartbeat.timeout + 30.0
        self.engines = engines
        self.epoch = epoch
        #: the training loader's claims (:meth:`ledger`; ``None``: not the shared cursor)
        self.claims: ClaimLedger | None = None
        self._timeout = timeout
        self._left, self._left_checked = False, 0.0  # membership.left_out(), when read
        self.gone = False  # this rank left the fit (the others went on without it)
        self.loggers = list(loggers)
        #: one entry per loss survived: ``(step, lost ranks, wall time (time.time()) the
        #: recovery began, seconds it took)``
        self.losses: list[tuple[int, tuple[int, ...], float, float]] = []
        self.log_live(len(self.membership.live), session.step)

    def ledger(self, key: str, on_wait: Callable[[], None] | None = None,
               lockstep: bool = False) -> ClaimLedger:
        """A :class:`~lightning_gossip.elastic.claim_ledger.ClaimLedger` for the training
        loader's shared cursor (``key``: the run's), whose end-of-epoch wait recovers from
        losses (``on_wait``: run at each of its polls instead, e.g. a round of synchronous
        gossip that recovers from losses itself; ``lockstep``: a node collective, which a
        node's ranks run in step). The claimant is this rank's node's leader."""
        self.claims = ClaimLedger(default_store(), key, self.layout.leader_of(self.membership.rank),
                                  live=self._live_unless_left_out, on_wait=on_wait or self.poll,
                                  timeout=self._timeout.total_seconds(), lockstep=lockstep,
                                  incarnation=self.incarnation)
        return self.claims

    def _live_unless_left_out(self) -> tuple[int, ...]:
        """The live claimants (ranks, or nodes' claimants); none when the others went on
        without this rank (a rank that wakes up after a freeze must not take the batches
        returned on its behalf)."""
        now = time.monotonic()
        if not self.heartbeat.excluded and now >= self._left_checked + 1.0:  # 1 read a second
            self._left_checked, self._left = now, self.membership.left_out()
        return () if self.heartbeat.excluded or self._left else self.layout.leaders(self.live)

    def epoch_opened(self, epoch: int) -> None:
        """This rank began training ``epoch`` (:meth:`~lightning_gossip.elastic.claim_ledger.
        ClaimLedger.open`)."""
        if self.claims is not None:
            self.claims.open(epoch)

    def batch_trained(self, epoch: int) -> None:
        """This rank trained one more batch of ``epoch`` (in the order it claimed them)."""
        if self.claims is not None and self.claims.rank == self.membership.rank:
            self.claims.record_finished(epoch)

    def log_live(self, live: int, step: int) -> None:
        """Log :data:`LIVE_METRIC` (``live`` ranks at ``step``)."""
        for logger in self.loggers:
            logger.log_metrics({LIVE_METRIC: float(live)}, step=step)

    def _warn(self, message: str) -> None:
        """Warn on rank 0 only (the other ranks' logs would repeat it)."""
        if self.membership.rank == 0:
            warnings.warn(message, stacklevel=3)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group of Lightning's collectives (``None`` while no rank was lost)."""
        return self.membership.group

    @property
    def live(self) -> tuple[int, ...]:
        """The live ranks."""
        return self.membership.live

    def survivable(self, lost: Sequence[int]) -> bool:
        """Whether the loss of ``lost`` can be survived: not the store's host, not this rank
        (the others counted it lost: :class:`~lightning_gossip.errors.RankExcluded`)."""
        return self.membership.rank not in lost and (self.store_host is None
                                                      or self.store_host not in lost)

    def poll(self, at_end: bool = False) -> None:
        """Recover when the liveness monitor found lost ranks (a read of one attribute
        otherwise), admit the processes that asked to join (a store read at most once a
        second): called at step boundaries and (``at_end``) while waiting at an epoch end.
        Hierarchical: only at an epoch's end, an admission another member began
        (:meth:`~.joins.NodeJoins.look`); the node's ranks look in their gradient all-reduce
        (:meth:`admit_agreed`)."""
        beat = self.heartbeat
        joins = self.hand_over is not None and self.poll_joins
        if beat.has_finding:
            try:
                beat.check(f"rank {self.membership.rank} at step {self.session.step}")
            except PeerSilent as e:
                self.survive(e)
        now = time.monotonic()
        if not joins or beat.has_finding:
            return
        if self.node_joins is not None:
            if at_end and (joined := self.node_joins.look()):
                self.retry(self.admit, joined)
            return
        if now < self._polled + POLL_EVERY_S:
            return
        self._polled = now
        asked = self.asked_to_join()
        # a rank that arrived at its epoch's end only joins an admission another member began:
        # the others may have left that end for the epoch's meetings (docs/faults.md, SLURM)
        late = self.claims is not None and self.claims.arrived == self.epoch()
        if asked is not None and (not late or self.asked_to_join(self.membership.deciding)):
            self.retry(self.admit, asked)

    def admit_agreed(self) -> None:
        """Hierarchical: admit the whole nodes this rank's node agreed on in the step's
        gradient all-reduce (:meth:`~.joins.NodeJoins.take`); called right after every
        optimizer step, so the node's ranks come to the admission at the same point of their
        node collectives. Nothing when flat, or when the node agreed on none."""
        if self.node_joins is not None and (joined := self.node_joins.take()):
            self.retry(self.admit, joined)

    def poll_at_end(self) -> None:
        """:meth:`poll` while this rank waits at an epoch's end for the others."""
        self.poll(at_end=True)

    def asked_to_join(self, read: Callable[[], Any] | None = None) -> Any:
        """The rank slots processes asked for (:meth:`~lightning_gossip.elastic.membership.
        Membership.poll`; or what ``read`` reads); ``None`` when none did, or when the store
        could not be read within the heartbeat timeout (a frozen or dead store host is not
        waited for: the heartbeat monitor names it)."""
        try:
            return bounded(read or self.membership.poll, self.heartbeat.timeout,
                           "looking for joins")
        except Exception:  # noqa: BLE001
            return None

    def end(self) -> None:
        """The fit is over: later newcomers start on their own (never raises: after a lost
        store host nobody can join anyway). Not from a rank that left it (the others go on:
        a relaunched process must find their fit running, not ended)."""
        if self.gone:
            return
        try:
            bounded(self.membership.end, self.heartbeat.timeout, "ending the fit's membership")
        except Exception as e:  # noqa: BLE001
            log.debug("rank %d: could not mark the fit ended: %s", self.membership.rank, e)

    def survive(self, error: BaseException) -> None:
        """Recover from the loss ``error`` names, or re-raise it (not a loss; a lost store)."""
        lost = lost_ranks(error)
        if lost is None:  # e.g. gloo's "connection closed by peer": the heartbeat names it
            lost = self._await_finding()
        whole = None if lost is None else self.layout.whole_nodes(lost)  # a node leaves whole
        if whole is None or not self.survivable(whole):
            node_left = whole is not None and self.membership.rank in set(whole) - set(lost)
            if node_left or self.heartbeat.excluded:  # this rank goes; the others go on
                self.gone = True
                self._keep_at_exit(self.session.engine)
            if node_left:
                raise RankExcluded(f"rank {self.membership.rank}: rank(s) "
                                   f"{', '.join(map(str, lost))} of its node were lost; the "
                                   "node leaves the elastic fit", lost) from error
            raise error
        self.recover(lost)

    def _keep_at_exit(self, engine: Engine | None) -> None:
        """Never destroy Lightning's group and ``engine``'s groups: a gloo thread may still
        wait on a rank that is gone, and destroying them at exit aborts the process."""
        kept = (engine, *engine.process_groups) if engine else ()
        for part in (self.membership.group, *kept):  # a group None: the default group
            keep_alive_at_exit(part)

    def _await_finding(self) -> tuple[int, ...] | None:
        """The ranks the liveness monitor finds lost within a heartbeat timeout, or ``None``."""
        beat = self.heartbeat
        deadline = time.monotonic() + beat.timeout + 2 * beat.interval + 1.0
        while not beat.has_finding and time.monotonic() < deadline:
            time.sleep(0.1)
        return beat.found or None

    def retry(self, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``operation(*args, **kwargs)``; when it fails because ranks were lost, recover and
        run it again over the survivors (the meetings at epoch ends and before validation)."""
        while True:
            try:
                return operation(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - survive() re-raises what is not a loss
                self.survive(e)

    def _regroup(self) -> ElasticGroups:
        """The new generation's groups, put in the session; Lightning's told to
        :attr:`on_group`."""
        groups = generation_groups(self.layout, self.membership, self.backend,
                                   synchronous=self.synchronous)
        self.session.regroup(groups)
        if self.on_group is not None:
            self.on_group(groups.lightning)
        return groups

    def recover(self, lost: Sequence[int]) -> None:
        """Go on without ``lost`` (see the module docstring)."""
        start, wall = time.monotonic(), time.time()
        membership, session = self.membership, self.session
        before = membership.live
        free = [r for r in lost if r not in before]  # slots nobody fills: not watched
        lost = tuple(r for r in self.layout.whole_nodes(lost) if r in before
                     and r != membership.rank)
        if not lost:
            self.heartbeat.forget(free, mark=False)  # a stale finding: watch on
            return
        step = session.step
        old = session.swap_engine(None)
        leftover = old.abandon() if old is not None else None
        self._keep_at_exit(old)
        live = membership.decide(lost, self.deadline_s, also_lost=self.heartbeat.silent)
        gone = tuple(r for r in before if r not in live)
        self.heartbeat.forget(gone)
        groups = self._regroup()
        for rank in gone if self.claims is not None else ():
            self.claims.return_units(self.epoch(), rank)
        engine = self.engines.over(live, groups)
        if engine is not None and leftover is not None:
            engine.carry(leftover)  # sharded deltas not yet in the weights (AsyncGossip)
        session.swap_engine(engine)
        took = time.monotonic() - start
        self.losses.append((step, gone, wall, took))
        self._warn(f"elastic fit: rank(s) {', '.join(map(str, gone))} lost at step {step} "
                   f"of rank {membership.rank}; training goes on with {len(live)} rank(s) "
                   f"({', '.join(map(str, live))}) after {took:.1f} s")
        self.log_live(len(live), step)

    def admit(self, joined: Sequence[int]) -> None:
        """Let the processes that asked for rank slots ``joined`` in (see the module docstring;
        every member comes here, also one that found the join decided by the others)."""
        start, wall = time.monotonic(), time.time()
        membership, session = self.membership, self.session
        step = session.step
        assert self.hand_over is not None
        before, old_group = membership.live, membership.group
        membership.announce(joined)  # members waiting at an epoch's end come (docs/faults.md)
        old = session.swap_engine(None)
        if old is not None:  # every member is here: end the phase cleanly (no waits left)
            try:
                old.quiesce()
            except BaseException:
                session.swap_engine(old)  # a loss in the meantime: recover() abandons it
                raise
            old.close()
        live = membership.decide((), self.deadline_s, joined=joined)
        new = [r for r in live if r not in before]
        self.heartbeat.forgotten.difference_update(new)
        self.heartbeat.forget(())  # watch them: they beat since before they asked
        groups = self._regroup()
        self.hand_over(old_group, groups.lightning, new, membership.rank == min(before))
        session.swap_engine(self.engines.over(live, groups))
        took = time.monotonic() - start
        self.joins.append((step, tuple(new), wall, took))
        self._warn(f"elastic fit: rank(s) {', '.join(map(str, new))} joined at step {step} "
                   f"of rank {membership.rank}; training goes on with {len(live)} rank(s) "
                   f"after {took:.1f} s")
        self.log_live(len(live), step)
