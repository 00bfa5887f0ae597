"""An elastic plain PyTorch loop: ``attach(model, optimizer, elastic=True)`` and the Fabric
strategies' ``elastic=True`` (:class:`ElasticLoop`, owned by
:class:`~lightning_gossip.plain_loop.Gossip` as ``gossip.elastic``, built from values and the
Gossip's :class:`~.session.ElasticSession`).

A plain loop calls gossip at every optimizer step (the optimizer's pre- and post-step hooks, or
the Fabric strategy's ``optimizer_step``) and at its sync points (``quiesce``, ``average``,
``consensus``, ``finish``, a barrier). Those calls are where an elastic loop finds lost ranks
and goes on without them, with the Trainer strategies' recovery
(:class:`~.survivors.Survivors`: the engine abandoned, the live ranks agreed in the store, new
groups over them in the session, a new engine over them):

* at a step's start (:meth:`ElasticLoop.before_step`) a loss the liveness monitor found is
  recovered from (:meth:`~.survivors.Survivors.poll`); then ``adpsgd`` opens a gossip phase if
  none is open (after a barrier of the live ranks, run again over the survivors when a loss
  interrupts it), ``dpsgd`` posts the step's round (:class:`~.rounds.ElasticRounds`: when the
  post fails on a lost peer the survivors agree on the step their rounds go on from, and the
  round is posted at that step);
* at a step's end (:meth:`ElasticLoop.after_step`) ``dpsgd`` mixes the round, ``adpsgd``
  applies the deltas received; a loss met there is recovered from the same way (``dpsgd``: the
  local step is kept, the round's mixing is lost);
* at a sync point (:meth:`ElasticLoop.sync`) ``dpsgd``'s live ranks first settle on one step
  (:class:`~.even_rounds.EvenRounds`: after a loss their loops may be a round apart, and any
  rank that comes early runs gossip-only rounds until the others come), then the sync point's
  work runs (the engine's quiesce, then a collective of the live ranks' group: the exact
  average, or a barrier), again over the survivors when a loss interrupts it. The collective
  is what makes the sync point safe: a rank whose engine ended its phase without meeting the
  lost rank still meets the loss there, with the others, instead of passing the sync point on
  the old engine.

What an elastic loop does not get that an elastic Trainer fit has: the lost rank's data is not
taken over (the loop owns its data: no shared cursor), and no process joins (the members never
look for join requests: a relaunched process cannot take a lost rank's slot). Its collectives
other than the sync points (the user's own ``all_reduce``) are the loop's: run them on
:attr:`ElasticLoop.group`.

The options an elastic loop refuses are checked at construction, before any collective::

    >>> check_loop_options("dpsgd", topology="ring", heartbeat_timeout=None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: attach(elastic=True) finds lost ranks by their heartbeat: give heartbeat_timeout ...
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_gossip.elastic.nodes import ElasticGroups
from lightning_gossip.elastic.rounds import ElasticRounds, RoundEngines
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.elastic.survivors import Engines, Survivors
from lightning_gossip.liveness import Heartbeat, watched_collective

__all__ = ["ElasticLoop", "check_loop_options", "check_no_joins", "next_run"]

T = TypeVar("T")

_runs = itertools.count()  # this process's elastic loops (their keys in the store)


def next_run() -> str:
    """The name of this process's next elastic loop (its keys in the store: ``loop<n>``),
    counted the same way on every rank (every rank attaches in the same order)."""
    return f"loop{next(_runs)}"


def check_loop_options(strategy: str, *, topology: object, heartbeat_timeout: float | None,
                       hierarchical: bool = False,
                       global_average_every_n_steps: int | None = None,
                       owner: str = "attach") -> None:
    """Raise ``ValueError`` for what an elastic plain loop cannot do (``owner`` names the
    caller in the message): it finds lost ranks by their heartbeat (``heartbeat_timeout``
    needed); ``dpsgd`` rebuilds the topology over the survivors by its name (a name needed);
    ``hierarchical`` and the periodic global average are not offered with it yet (the Trainer
    strategies have the first).

    >>> check_loop_options("dpsgd", topology="ring", heartbeat_timeout=30.0)
    >>> check_loop_options("adpsgd", topology="ring", heartbeat_timeout=30.0,
    ...                    hierarchical=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: attach(elastic=True, hierarchical=True) is not offered yet: use the Trainer ...
    """
    if heartbeat_timeout is None:
        raise ValueError(f"{owner}(elastic=True) finds lost ranks by their heartbeat: give "
                         "heartbeat_timeout (seconds), e.g. 30")
    if strategy == "dpsgd" and not isinstance(topology, str):
        raise ValueError(f"{owner}(elastic=True) rebuilds the dpsgd topology over the survivors "
                         f"by its name: give a name, not {type(topology).__name__}")
    if hierarchical:
        raise ValueError(f"{owner}(elastic=True, hierarchical=True) is not offered yet: use the "
                         "Trainer strategies (DPSGDStrategy, ADPSGDStrategy) for an elastic "
                         "hierarchical fit")
    if global_average_every_n_steps is not None:
        raise ValueError(f"{owner}(elastic=True) takes no global_average_every_n_steps (nor "
                         "an outer optimizer): average at the loop's own sync points "
                         "(Gossip.become_average)")


def check_no_joins(start_timeout: float | None, owner: str = "attach") -> None:
    """Raise ``ValueError`` for ``start_timeout`` (the Trainer strategies' start with the ranks
    that came, whose latecomers join the running fit): a plain loop's processes start together
    and no process joins a running loop.

    >>> check_no_joins(None)
    >>> check_no_joins(60.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: attach(start_timeout=60.0) is not offered: a plain loop's processes start ...
    """
    if start_timeout is not None:
        raise ValueError(
            f"{owner}(start_timeout={start_timeout!r}) is not offered: a plain loop's processes "
            "start together, and no process joins a running loop (a relaunched process cannot "
            "take a lost rank's slot); the Trainer strategies (DPSGDStrategy, ADPSGDStrategy "
            "with elastic=True) offer both")


class ElasticLoop:
    """The elastic side of a plain loop's gossip (see the module docstring).

    Args:
        session: the loop's session (its step, engine, membership and groups).
        kind: ``"dpsgd"`` or ``"adpsgd"``.
        run: the loop's name, the same on every rank (:func:`next_run`).
        rank, world_size: this rank and the rank slots.
        timeout: the limit of every wait (and the groups' timeout).
        heartbeat: this rank's heartbeat, running (it finds the lost ranks).
        backend: the backend of the survivors' sync-point and gossip data groups.
        engines: the survivors' engines (:class:`~.engines.PairwiseEngines` for ``adpsgd``,
            :class:`~.rounds.RoundEngines` for ``dpsgd``).
        start: the groups the loop started with (``lightning``: the sync points' group).
    """

    def __init__(self, session: ElasticSession, kind: str, *, run: str, rank: int,
                 world_size: int, timeout: timedelta, heartbeat: Heartbeat | None,
                 backend: str, engines: Engines, start: ElasticGroups) -> None:
        self.session, self.kind, self.rank = session, kind, rank
        self.timeout, self.heartbeat = timeout, heartbeat
        #: sync points passed (the same on every rank: each rank calls the same sequence)
        self.syncs = 0
        #: the recovery from lost ranks (no joins: ``hand_over`` is ``None``)
        self.survivors = Survivors(session, run, rank, world_size, timeout, heartbeat=heartbeat,
                                   backend=backend, engines=engines, epoch=self.sync_count,
                                   groups=start, poll_joins=False)
        #: ``dpsgd``'s rounds around the survivors (``None`` for ``adpsgd``)
        self.rounds: ElasticRounds | None = None
        if kind == "dpsgd":
            assert isinstance(engines, RoundEngines)
            self.rounds = ElasticRounds(session, self.survivors, engines, run=run, rank=rank,
                                        world_size=world_size, timeout=timeout,
                                        end_round=self.end_round)

    @property
    def group(self) -> Any:
        """The live ranks' group, where the sync points meet (the start group until a loss;
        ``None``: the default group)."""
        groups = self.session.groups
        assert groups is not None  # (the survivors began the session with the start groups)
        return groups.lightning

    @property
    def live(self) -> tuple[int, ...]:
        """The live ranks."""
        return self.survivors.live

    def sync_count(self) -> int:
        """:attr:`syncs` (the survivors' "epoch": no claims are kept, so it is only named)."""
        return self.syncs

    def end_round(self, step: int) -> None:
        """``dpsgd``'s round of ``step`` is done (also a gossip-only one): count it."""
        self.session.move_to(step + 1)

    # -- the step ---------------------------------------------------------------------------------
    def before_step(self) -> None:
        """Before the optimizer step: recover from a loss found meanwhile, then open the
        gossip phase (``adpsgd``) or post the step's round (``dpsgd``)."""
        self.survivors.poll()
        if self.rounds is None:
            self.survivors.retry(self._open_phase)
            return
        while True:  # a post that met a loss: the round goes at the step the survivors agreed
            generation = self.session.generation
            self.rounds.before_step(self.session.step)
            if self.session.generation == generation:
                return

    def _open_phase(self) -> None:
        """``adpsgd``: a barrier of the live ranks, then the engine's phase, when none is open
        (the survivors' engine opens its phase itself)."""
        engine = self.session.engine
        if engine is not None and not engine.in_phase:
            self.barrier_now("waiting for every live rank at the barrier that opens a gossip "
                             "phase")
        if engine is not None:
            engine.before_step(self.session.step)

    def after_step(self) -> None:
        """After the optimizer step: mix the round (``dpsgd``) or apply the deltas
        (``adpsgd``), the step counted also when a loss interrupts it."""
        step, engine = self.session.step, self.session.engine
        if self.rounds is not None:
            self.rounds.finish(step, engine)
            return
        self.session.move_to(step + 1)
        self.survivors.retry(self._apply, step)

    def _apply(self, step: int) -> None:
        """``adpsgd``: the engine's (after a loss, the survivors') ``after_step``."""
        engine = self.session.engine
        if engine is not None:
            engine.after_step(step)

    # -- sync points ------------------------------------------------------------------------------
    def sync(self, operation: Callable[[], T]) -> T:
        """A sync point of every live rank: ``dpsgd``'s ranks settle on one step first, then
        ``operation()`` runs. It must end with a collective over :attr:`group` (so that no rank
        passes the sync point on the lost rank's engine unaware of the loss) and read the
        session's engine and :attr:`group` when it runs: after a loss that interrupts it, the
        survivors recover and run it again (``dpsgd``: after settling again, under the new
        generation's name, since a survivor that recovered elsewhere goes on with its
        rounds)."""
        try:
            while True:
                if self.rounds is not None:
                    self.rounds.open_epoch(self.syncs)  # (settle acts on an open "epoch" only)
                    self.rounds.settle(self.syncs)
                try:
                    return operation()
                except Exception as e:  # noqa: BLE001 - survive() re-raises what is not a loss
                    self.survivors.survive(e)
        finally:
            self.syncs += 1

    def quiesce_engine(self) -> None:
        """Finish the exchanges in flight of the session's engine (none: nothing)."""
        engine = self.session.engine
        if engine is not None:
            engine.quiesce()

    def barrier_now(self, what: str) -> None:
        """A barrier of the live ranks on :attr:`group`, watched: a rank that stops beating
        makes it fail naming that rank (within about the heartbeat timeout), never hang."""
        watched_collective(dist.barrier, what=f"rank {self.rank}: {what}", timeout=self.timeout,
                           group=self.group, heartbeat=self.heartbeat)

    def quiesce(self) -> None:
        """A sync point: the engine's exchanges in flight finished and applied, then a
        barrier of the live ranks."""
        self.sync(self._quiesce_and_meet)

    def _quiesce_and_meet(self) -> None:
        self.quiesce_engine()
        self.barrier_now("waiting for every live rank after finishing the exchanges in flight")

    def barrier(self) -> None:
        """A sync point: every live rank meets (:meth:`barrier_now` under :meth:`sync`)."""
        self.sync(self._barrier)

    def _barrier(self) -> None:
        self.barrier_now("waiting for every live rank at a barrier")

    def close(self) -> None:
        """The loop is over: mark the membership ended (never raises)."""
        self.survivors.end()
