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
PeerSilent`, so no two groups of survivors go on apart. Groups are made with
``new_group(ranks, use_local_synchronization=True)``: only the members meet, and every member
creates its groups in the same order.

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

from lightning_gossip.errors import PeerSilent

__all__ = ["Membership"]

POLL_S = 0.05
"""Seconds between two reads of the store while the survivors gather."""


class Membership:
    """The live ranks of one fit (``live``), the generation that made them, and its groups.

    Args:
        store: a store shared by all ranks (the rendezvous store, prefixed per fit).
        rank: this rank (global).
        world_size: the ranks the fit started with.
        timeout: the groups' timeout.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 timeout: timedelta) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        #: the ranks in the fit now, sorted
        self.live: tuple[int, ...] = tuple(range(world_size))
        #: how many membership changes this fit has had
        self.generation = 0
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

    def _key(self, generation: int, what: str) -> str:
        return f"gen{generation}/{what}"

    def decide(self, lost: Iterable[int], deadline_s: float,
               arrived: Callable[[Sequence[int]], bool] | None = None) -> tuple[int, ...]:
        """Agree with the other survivors on the live ranks after ``lost`` (see the module
        docstring); returns the new :attr:`live`. ``arrived(ranks)``: whether every one of
        ``ranks`` has written its view (default: read the store). Raises :class:`PeerSilent`
        when this rank is left out, or when the survivors do not gather within ``deadline_s``
        (naming those that did not come)."""
        gen = self.generation + 1
        view = tuple(r for r in self.live if r not in set(lost))
        if self.rank not in view:
            raise ValueError(f"rank {self.rank} cannot count itself lost")
        self.store.set(self._key(gen, f"view/{self.rank}"), json.dumps(view))
        keys = [self._key(gen, f"view/{r}") for r in view]
        came = arrived if arrived is not None else (lambda _: self.store.check(keys))
        deadline = time.monotonic() + deadline_s
        while not came(view):
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(view, keys) if not self.store.check([k])]
                raise PeerSilent(
                    f"rank {self.rank}: the survivors of the loss of rank(s) "
                    f"{', '.join(map(str, sorted(set(self.live) - set(view))))} did not gather "
                    f"within {deadline_s:.0f} s: rank(s) {', '.join(map(str, missing))} did not "
                    "come (lost too?)", missing)
            time.sleep(POLL_S)
        decided = self.store.compare_set(self._key(gen, "decision"), "", json.dumps(view))
        agreed = tuple(json.loads(decided.decode() if isinstance(decided, bytes) else decided))
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
        key = self._key(self.generation + 1, "decision")
        if not self.store.check([key]):
            return False
        decided = self.store.get(key)
        return self.rank not in json.loads(decided.decode() if isinstance(decided, bytes)
                                           else decided)

    def new_groups(self, backends: Sequence[str]) -> list[dist.ProcessGroup]:
        """One new group per entry of ``backends`` over :attr:`live` (only the members meet;
        every member calls this in the same order); the first becomes :attr:`group`."""
        groups = []
        for backend in backends:
            group = dist.new_group(list(self.live), timeout=self.timeout, backend=backend,
                                   use_local_synchronization=True)
            assert group is not None  # this rank is a member
            groups.append(group)
        self.group = groups[0]
        return groups
