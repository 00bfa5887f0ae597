"""The live ranks of an elastic fit, and the process groups over them.

When a rank is lost (killed, frozen past the heartbeat timeout, cut off), the survivors of an
elastic fit (``ADPSGDStrategy(elastic=True)``) meet in the rendezvous store, agree on who is
still there, and build new process groups over those ranks only; Lightning's collectives and
the gossip thread use those from then on. No process group is ever torn down (a gloo group with
a dead member is simply no longer used), and the default group's store keeps serving: it lives
in rank 0's process (Lightning's launcher, ``srun``), so the loss of rank 0 is not survivable
this way (the strategies fall back to the emergency checkpoint; see ``docs/faults.md``).

**The agreement.** Generation ``g + 1`` starts when a survivor has found ranks lost. Every
survivor writes its view (the ranks it believes live) under the generation and waits until
every rank of its view has written one; the first survivor to see its view complete decides
(an atomic ``compare_set``), and every survivor adopts that decision. A rank left out of the
decision (a live rank that others took for lost) fails with :class:`~lightning_gossip.errors.
PeerSilent`, so no two groups of survivors go on apart. Groups are built by name
(:func:`~lightning_gossip._compat.named_group`: ``<name>/gen<g>/default_pg/0``, then
``<name>/gen<g>/<i>``, keys in the fit's store): only the members meet, every member creates
its groups in the same order, and a process that joins later builds the same groups.

**A start with the ranks that came** (:meth:`Membership.found`): rank 0 decides generation 0
with the rank slots that came within a deadline (at least two); the others join later.

**A join.** A process that takes a free rank slot (a lost rank's, or one the fit has not
filled yet) asks in the store (:meth:`Membership.ask_to_join`); the members find the request
when they :meth:`poll` (a store read at most every :data:`POLL_EVERY_S` seconds), and the
next generation is decided the same way with the newcomer added (:meth:`decide` with
``joined``). The newcomer reads the decision (:meth:`Membership.await_admission`) and builds
the generation's groups with the members, its default group being the first of them
(:meth:`Membership.lightning_group` with ``newcomer``).

Example (one process, a store of its own: the only rank, nobody lost)::

    >>> from datetime import timedelta
    >>> import torch.distributed as dist
    >>> m = Membership(dist.HashStore(), rank=0, world_size=3, timeout=timedelta(seconds=5))
    >>> m.live, m.generation, m.full
    ((0, 1, 2), 0, True)
    >>> m.decide(lost=(1,), deadline_s=0.1, arrived=lambda ranks: True)  # the others agree
    (0, 2)
    >>> m.live, m.generation, m.full, m.lost
    ((0, 2), 1, False, (1,))
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from lightning_gossip import _compat
from lightning_gossip.errors import PeerSilent

__all__ = ["Membership"]

POLL_S = 0.05
"""Seconds between two reads of the store while the survivors gather."""

POLL_EVERY_S = 1.0
"""Members look for join requests and started generations about this often (:meth:`poll`)."""


def group_name(name: str, generation: int, index: int) -> str:
    """The name of group ``index`` of ``generation`` (the first: a joiner's default group).

    >>> group_name("run0", 2, 0), group_name("run0", 2, 1)
    ('run0/gen2/default_pg/0', 'run0/gen2/1')
    """
    return f"{name}/gen{generation}/" + ("default_pg/0" if index == 0 else str(index))


class Membership:
    """The live ranks of one fit (``live``), the generation that made them, and its groups.

    Args:
        store: a store shared by all ranks (the rendezvous store, prefixed per fit).
        rank: this rank (global).
        world_size: the rank slots of the fit (the ranks it was planned with).
        timeout: the groups' timeout.
        name: the fit's name, the same on every rank: it prefixes the groups' names, which
            are unique within a process.
        live: the ranks in the fit now (default: every slot).
        generation: the generation that decided ``live`` (a newcomer's: its admission's).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 timeout: timedelta, name: str = "fit",
                 live: Sequence[int] | None = None, generation: int = 0) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.name = name
        #: the ranks in the fit now, sorted
        self.live: tuple[int, ...] = tuple(sorted(range(world_size) if live is None
                                                  else live))
        #: how many membership changes this fit has had
        self.generation = int(generation)
        #: Lightning's collectives run over this group (``None``: the default group, everyone)
        self.group: dist.ProcessGroup | None = None

    @property
    def full(self) -> bool:
        """Every rank the fit started with is still in it."""
        return len(self.live) == self.world_size

    @property
    def lost(self) -> tuple[int, ...]:
        """The ranks lost so far."""
        return tuple(r for r in range(self.world_size) if r not in self.live)

    def decide(self, lost: Iterable[int], deadline_s: float,
               arrived: Callable[[Sequence[int]], bool] | None = None,
               joined: Iterable[int] = (),
               also_lost: Callable[[list[int]], Iterable[int]] | None = None
               ) -> tuple[int, ...]:
        """Agree with the other members on the live ranks after ``lost`` (and with ``joined``,
        newcomers that asked to join; see the module docstring); returns the new :attr:`live`.
        ``arrived(ranks)``: whether every one of ``ranks`` has written its view (default: read
        the store; a newcomer writes none). ``also_lost(missing)``: which of the members that
        have not come yet are lost too (a heartbeat's reading, asked every :data:`POLL_EVERY_S`
        seconds): they are dropped from this rank's view, so that two ranks lost a moment apart
        (a node's tasks) cost one agreement, not the fit. Raises :class:`PeerSilent` when this
        rank is left out, or when the members do not gather within ``deadline_s`` (naming those
        that did not come)."""
        gen = self.generation + 1
        members = tuple(r for r in self.live if r not in set(lost))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} cannot count itself lost")
        joined = tuple(joined)
        deadline = time.monotonic() + deadline_s
        look = time.monotonic() + POLL_EVERY_S
        while True:
            view = tuple(sorted(set(members) | set(joined)))
            self.store.set(_gen_key(gen, f"view/{self.rank}"), json.dumps(view))
            keys = [_gen_key(gen, f"view/{r}") for r in members]
            while not (arrived(members) if arrived is not None else self.store.check(keys)):
                if also_lost is not None and time.monotonic() > look:
                    look = time.monotonic() + POLL_EVERY_S
                    gone = set(also_lost([r for r, k in zip(members, keys)
                                          if not self.store.check([k])]))
                    if gone - {self.rank}:
                        members = tuple(r for r in members if r not in gone)
                        break  # write the smaller view and wait for its members
                if time.monotonic() > deadline:
                    missing = [r for r, k in zip(members, keys) if not self.store.check([k])]
                    raise PeerSilent(
                        f"rank {self.rank}: the survivors of the loss of rank(s) "
                        f"{', '.join(map(str, sorted(set(self.live) - set(view))))} did not "
                        f"gather within {deadline_s:.0f} s: rank(s) "
                        f"{', '.join(map(str, missing))} did not come (lost too?)", missing)
                time.sleep(POLL_S)
            else:
                break
        decided = self.store.compare_set(_gen_key(gen, "decision"), "", json.dumps(view))
        agreed = tuple(json.loads(_text(decided)))
        for r in set(agreed) - set(self.live):  # admitted: their requests are answered
            self.store.set(_join_key(r), f"admitted {gen}")
        self.store.set(LATEST, str(gen))
        if self.rank not in agreed:
            raise PeerSilent(
                f"rank {self.rank}: the other survivors of generation {gen} counted this rank "
                f"lost (they go on as ranks {', '.join(map(str, agreed))})",
                [r for r in self.live if r not in agreed])
        self.live, self.generation = agreed, gen
        return agreed

    def left_out(self) -> bool:
        """Whether the other ranks decided the next generation without this rank (it was
        silent too long: it must not take part any more). One store read."""
        decided = self.decided(self.store, self.generation + 1)
        return bool(decided) and self.rank not in decided

    def lightning_group(self, backend: str, newcomer: bool = False) -> dist.ProcessGroup:
        """The generation's first group, over :attr:`live`, by name: Lightning's collectives
        (only the members meet; it becomes :attr:`group`). A ``newcomer``'s becomes its default
        group (:func:`~lightning_gossip._compat.join_as_default_group`), as the members build
        theirs. Every member builds it before the generation's other groups
        (:meth:`named_group`)."""
        name = group_name(self.name, self.generation, 0)
        if newcomer:
            _compat.join_as_default_group(self.store, name, list(self.live), self.rank, backend,
                                          self.timeout)
            self.group = dist.group.WORLD
        else:
            self.group = _compat.named_group(list(self.live), self.rank, backend, self.store,
                                             name, self.timeout)
        return self.group

    def named_group(self, index: int, backend: str, ranks: Sequence[int] | None = None,
                    kind: str = "") -> dist.ProcessGroup:
        """The generation's group ``index`` (after :meth:`lightning_group`; ``kind``: one of
        several groups under that index, e.g. ``"node3"``) over ``ranks`` (default
        :attr:`live`), by name: only its members meet, every member builds the generation's
        groups in the same order, a newcomer as the members do."""
        name = group_name(self.name, self.generation, index) + (f"/{kind}" if kind else "")
        return _compat.named_group(list(self.live if ranks is None else ranks), self.rank,
                                   backend, self.store, name, self.timeout)

    # -- joins ------------------------------------------------------------------------------------
    def poll(self) -> tuple[int, ...] | None:
        """The ranks that asked to join, or that the other members admitted in the next
        generation before this member saw their request; ``None`` when no join is pending (a
        few store reads: callers call it every :data:`POLL_EVERY_S` seconds or so)."""
        free = [r for r in range(self.world_size) if r not in self.live]
        asked = tuple(r for r in free if self.store.check([_join_key(r)])
                      and _read(self.store, _join_key(r)) == ASKED)
        if asked:
            return asked
        # a join the others admitted before this member saw the request (it is answered now);
        # a generation that drops ranks is a loss: the heartbeat brings this member there
        decided = self.decided(self.store, self.generation + 1)
        if decided and set(self.live) <= set(decided):
            return tuple(r for r in decided if r not in self.live)
        return None

    def announce(self, joined: Iterable[int]) -> None:
        """Begin an admission of ``joined``: this rank's view of the next generation in the
        store now, before it ends its gossip phase, so that a member waiting at its epoch's end
        (which only takes part in an admission another began: :meth:`deciding`) comes to it.
        :meth:`decide` writes the same view again."""
        view = sorted(set(self.live) | set(joined))
        self.store.set(_gen_key(self.generation + 1, f"view/{self.rank}"), json.dumps(view))

    def deciding(self) -> bool:
        """Whether another member began deciding the next generation (its view is in the
        store: a recovery or an admission in progress, which this rank must take part in).

        >>> from datetime import timedelta
        >>> import torch.distributed as dist
        >>> store, t = dist.HashStore(), timedelta(seconds=5)
        >>> a, b = (Membership(store, rank=r, world_size=2, timeout=t) for r in (0, 1))
        >>> a.deciding()
        False
        >>> b.decide((), deadline_s=0.1, arrived=lambda ranks: True, joined=())
        (0, 1)
        >>> a.deciding(), b.deciding()  # rank 1 wrote its view of generation 1; rank 0 not
        (True, False)
        """
        gen = self.generation + 1
        return any(self.store.check([_gen_key(gen, f"view/{r}")]) for r in self.live
                   if r != self.rank)

    @staticmethod
    def decided(store: dist.Store, generation: int) -> tuple[int, ...]:
        """The live ranks ``generation`` decided (``()`` when it decided nothing yet)."""
        key = _gen_key(generation, "decision")
        return tuple(json.loads(_read(store, key))) if store.check([key]) else ()

    @classmethod
    def running(cls, store: dist.Store) -> tuple[int, ...] | None:
        """The live ranks of the fit whose membership ``store`` holds, once it has changed
        (a loss, a join); ``None`` when it never changed or has ended (:meth:`end`)."""
        if not store.check([LATEST]) or store.check([ENDED]):
            return None
        return cls.decided(store, int(_read(store, LATEST)))

    @classmethod
    def found(cls, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
              name: str, wait_s: float) -> Membership | None:
        """The first membership of a fit that may start without every rank slot filled:
        every process says that it came; rank 0 decides generation 0 with the slots that came,
        once all have, or once ``wait_s`` seconds have passed and at least two came (one has
        nobody to gossip with); the others read the decision. ``None`` for a process that came
        after it: it joins the running fit instead (:meth:`ask_to_join`). Raises
        :class:`PeerSilent` when no decision comes within ``wait_s`` plus ``timeout``.

        >>> from datetime import timedelta
        >>> import torch.distributed as dist
        >>> store, t = dist.HashStore(), timedelta(seconds=5)
        >>> store.set("came/2", "1")  # rank 2 came; rank 1 did not
        >>> m = Membership.found(store, rank=0, world_size=3, timeout=t, name="fit", wait_s=0.1)
        >>> m.live, m.generation, m.lost, Membership.running(store)
        ((0, 2), 0, (1,), (0, 2))
        >>> Membership.found(store, 1, 3, t, "fit", wait_s=0.1) is None  # came too late
        True
        """
        store.set(f"came/{rank}", "1")
        if rank == 0:
            start = time.monotonic()
            while True:
                came = [r for r in range(world_size) if store.check([f"came/{r}"])]
                waited = time.monotonic() - start
                if len(came) == world_size or (waited > wait_s and len(came) >= 2):
                    break
                if waited > wait_s + timeout.total_seconds():
                    raise PeerSilent(f"rank 0: no other rank came within {waited:.0f} s",
                                     list(range(1, world_size)))
                time.sleep(POLL_S)
            store.compare_set(_gen_key(0, "decision"), "", json.dumps(came))
            store.set(LATEST, "0")  # (after the decision: whoever reads it finds the decision)
        deadline = time.monotonic() + wait_s + timeout.total_seconds()
        while not store.check([LATEST]):
            if time.monotonic() > deadline:
                raise PeerSilent(f"rank {rank}: rank 0 did not start the fit within "
                                 f"{wait_s + timeout.total_seconds():.0f} s", [0])
            time.sleep(POLL_S)
        live = cls.decided(store, 0)
        return cls(store, rank, world_size, timeout, name, live=live) if rank in live else None

    def end(self) -> None:
        """The fit is over: a process that comes to join it later starts on its own."""
        self.store.set(ENDED, "1")

    @staticmethod
    def ask_to_join(store: dist.Store, rank: int) -> None:
        """A newcomer asks for rank slot ``rank`` (free: a lost rank's, or never filled)."""
        store.set(_join_key(rank), ASKED)

    @classmethod
    def await_admission(cls, store: dist.Store, rank: int, world_size: int,
                        timeout: timedelta, name: str, deadline_s: float) -> Membership:
        """A newcomer's :class:`Membership` once the members admitted it (after
        :meth:`ask_to_join`): its :attr:`live` and :attr:`generation` are the decision's.
        Raises :class:`PeerSilent` when no decision admits it within ``deadline_s``."""
        deadline = time.monotonic() + deadline_s
        key = _join_key(rank)
        while True:
            answer = _read(store, key) if store.check([key]) else ""
            if answer.startswith("admitted "):
                gen = int(answer.split()[1])
                agreed = cls.decided(store, gen)
                return cls(store, rank, world_size, timeout, name, live=agreed, generation=gen)
            if time.monotonic() > deadline:
                raise PeerSilent(f"rank {rank}: the fit did not admit this process within "
                                 f"{deadline_s:.0f} s (asked for rank slot {rank})", [])
            time.sleep(POLL_S)


ASKED = "asked"
"""A join request's value until a decision answers it (``"admitted <generation>"``)."""
LATEST, ENDED = "latest", "ended"
"""Keys: the last generation decided; the fit is over."""


def _gen_key(generation: int, what: str) -> str:
    return f"gen{generation}/{what}"


def _join_key(rank: int) -> str:
    return f"join/{rank}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _read(store: dist.Store, key: str) -> str:
    return _text(store.get(key))
