"""The heartbeat: every rank's background thread beats in the c10d store (:class:`Heartbeat`),
readers find the silent or departed ranks (:class:`PeerSilent`), and :func:`current` is the one
this process runs. Its store operations go through :func:`~lightning_gossip.liveness.store.bounded`;
the collectives that watch it are in :mod:`~lightning_gossip.liveness.collectives`."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.distributed as dist

from lightning_gossip.errors import PeerSilent, RankExcluded
from lightning_gossip.liveness.at_exit import peer_lost, spawn
from lightning_gossip.liveness.store import bounded, store_clients
from lightning_gossip.liveness.waits import _ranks

DOWN = 1 << 40
"""Added to a rank's counter when it leaves after an error: readers see it at once."""


LINGER_S = 2.5
"""Seconds a rank that failed stays alive after marking itself gone (:meth:`Heartbeat.leave`):
a reader checks at most once a second and gives pending work a one-second grace."""

ERROR_CHARS = 400
"""The most characters of a failed rank's error that its peers repeat (:meth:`Heartbeat.
tell_error`)."""

_current: Heartbeat | None = None


def current() -> Heartbeat | None:
    """The heartbeat this process runs (the last one started and not stopped), or ``None``.

    The exchange primitives (:mod:`lightning_gossip.exchange`) watch it when no heartbeat is
    passed to them, so every gossip wait of a strategy is covered.
    """
    return _current


def _key(rank: int) -> str:
    # torchrun's agent keeps its store across restarts: one key space per restart round
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"lightning_gossip/heartbeat/{restart}/{rank}"


def _error_key(rank: int) -> str:
    return f"{_key(rank)}/error"


class Heartbeat:
    """Publishes this rank's beat in a c10d store and tells which peers went silent.

    Args:
        store: a store shared by all ranks (the default group's, or a prefixed one).
        rank: this rank.
        world_size: number of ranks.
        timeout: seconds without a beat after which a peer counts as silent.
        interval: seconds between this rank's beats; default ``timeout / 10`` within
            [0.2, 5] s.
        writer_store: the store the beating thread writes to (default ``store``); a separate
            client keeps a slow write from delaying the readers.
        store_host: the rank that hosts the store (``0`` under Lightning's launcher), named
            when the store cannot be reached; ``None`` when it is a launcher (torchrun's agent).
        monitor: also watch every other rank while beating (the liveness monitor): a thread
            reads the peers' beats every ``interval`` seconds and records the first silent
            (or departed) ones, which :meth:`check` then raises as :class:`PeerSilent` in the
            thread that calls it (the strategies call it at every step boundary), so a silent
            rank is noticed also when nobody waits on it. See :meth:`check`.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float = 60.0,
                 interval: float | None = None, writer_store: dist.Store | None = None,
                 store_host: int | None = None, monitor: bool = True) -> None:
        if timeout <= 0:
            raise ValueError(f"heartbeat timeout must be positive, got {timeout}")
        self.store = store
        self.writer_store = writer_store if writer_store is not None else store
        self.store_host = store_host
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.interval = float(interval) if interval is not None else min(
            5.0, max(0.2, self.timeout / 10))
        # reader side (any thread that waits): last counter seen, when it last moved and this
        # process's starved seconds (:attr:`starved_s`) at that moment
        self._seen: dict[int, tuple[int, float, float]] = {}
        self._starved = 0.0
        self._seen_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_error: BaseException | None = None
        self._unreachable = False  # a bounded store call failed: the host is gone or frozen
        self._down: set[int] = set()
        self.monitor = bool(monitor)
        # the liveness monitor's finding: (ranks, why), written once per start by its thread
        self._found: tuple[tuple[int, ...], str] | None = None
        self._generation = 0  # a monitor thread of an earlier start() ends when this moves on
        #: ranks no longer watched (lost from an elastic fit: :meth:`forget`)
        self.forgotten: set[int] = set()
        #: the other ranks counted this one lost (:meth:`forget` on their side): it must go
        self.excluded = False

    @classmethod
    def connect(cls, rank: int, world_size: int, timeout: float = 60.0,
                fallback: dist.Store | None = None, monitor: bool = True) -> Heartbeat:
        """A heartbeat on dedicated clients of the rendezvous store (``MASTER_ADDR/PORT``).

        Their operations time out after ``timeout`` seconds, so a frozen store host is reported
        within about ``timeout`` too. Without ``MASTER_ADDR``/``MASTER_PORT`` (or when the
        connection fails) ``fallback`` (e.g. the default group's store) is used for both.
        """
        clients, host = store_clients(world_size, timeout, fallback)
        return cls(clients[0], rank, world_size, timeout, writer_store=clients[1],
                   store_host=host, monitor=monitor)

    # -- writer -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Beat once now, then every ``interval`` seconds from a daemon thread (idempotent);
        with ``monitor``, also start watching the other ranks (a finding of an earlier start
        is forgotten)."""
        global _current
        if self._thread is not None:
            return
        if (count := int(self.writer_store.add(_key(self.rank), 1))) >= DOWN:
            # this process left an earlier fit after an error (or was left behind): it is back
            self.writer_store.add(_key(self.rank), -(count // DOWN) * DOWN)
        _current = self
        self._stop.clear()
        self._found, self.excluded = None, False
        self._generation += 1
        self._thread = spawn(self._run, f"lightning-gossip-heartbeat-{self.rank}",
                             stop=self._stop.set)  # joined before the interpreter finalizes
        self._start_monitor()

    def _start_monitor(self) -> None:
        if self.monitor and self.world_size > 1:
            spawn(self._watch, f"lightning-gossip-monitor-{self.rank}", stop=self._stop.set,
                  args=(self._generation,))

    def forget(self, ranks: Iterable[int], mark: bool = True) -> None:
        """Stop watching ``ranks`` (lost from an elastic fit, or ``mark`` false: slots free when
        a newcomer joined); the monitor starts again. ``mark``: mark them gone, so that one that
        wakes up learns it was left behind (:attr:`excluded`)."""
        ranks = set(ranks)
        for r in ranks - self.forgotten if mark else ():
            self.writer_store.add(_key(r), DOWN)
        self.forgotten |= ranks
        self._generation += 1
        self._found = None
        if self._thread is not None:
            self._start_monitor()

    def stop(self) -> None:
        """Stop beating (idempotent). Peers that still wait on this rank will see it silent."""
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        self._generation += 1  # the monitor thread ends, and records nothing more
        if self._thread is not None and self._thread is not threading.current_thread():
            # a beat stuck on an unreachable store host never returns in time: do not wait
            self._thread.join(timeout=0.1 if self._unreachable else self.interval + 1.0)
        self._thread = None

    def leave(self, failed: bool, linger_s: float = LINGER_S) -> None:
        """Stop beating; with ``failed`` also tell every reader at once that this rank is gone
        (they fail at their next check, within about a second), then stay alive ``linger_s``
        seconds, so that a launcher that stops every rank when this one exits (torchrun's
        agent) does not stop them before they read the mark. Nothing is written or waited for
        when the store is unreachable (:meth:`store_call`). Never raises."""
        self.stop()
        if failed and not self._unreachable:
            try:
                bounded(lambda: self.writer_store.add(_key(self.rank), DOWN),
                        min(self.timeout, 10.0), "marking this rank as gone")
            except Exception:  # noqa: BLE001 - the store is gone or frozen: readers notice too
                return
            time.sleep(max(0.0, linger_s))

    def tell_error(self, error: BaseException) -> None:
        """Leave this rank's own ``error`` (its type and message, cut to
        :data:`ERROR_CHARS`) in the store, so that the peers that find this rank gone name it
        with its error (:meth:`describe`) even if this process is killed before it prints its
        traceback (a launcher that stops every task once one exits with an error, such as
        ``srun --kill-on-bad-exit``, may stop it while it tells the others or lingers).
        Call it before :meth:`leave` (``failed``). Never raises (bounded, like :meth:`leave`)."""
        if self._unreachable:
            return
        text = " ".join(f"{type(error).__name__}: {error}".split())[:ERROR_CHARS]
        try:
            bounded(lambda: self.writer_store.set(_error_key(self.rank), text),
                    min(self.timeout, 10.0), "leaving this rank's error in the store")
        except Exception:  # noqa: BLE001 - the store is gone or frozen: the traceback remains
            pass

    def _told(self, ranks: Sequence[int]) -> str:
        """The errors ``ranks`` left (:meth:`tell_error`), ``"rank 1: ValueError: ..."``, one
        after another; empty when none did or the store cannot be read in a few seconds."""
        keys = [_error_key(r) for r in ranks]
        try:
            found = bounded(lambda: [self.store.get(k).decode(errors="replace")
                                     if self.store.check([k]) else "" for k in keys],
                            min(self.timeout, 5.0), "reading the errors of ranks that left")
        except Exception:  # noqa: BLE001 - the names are enough then
            return ""
        return "; ".join(f"rank {r}: {text}" for r, text in zip(ranks, found) if text)

    @property
    def store_unreachable(self) -> bool:
        """Whether a bounded store call of this rank failed (:meth:`store_call`): the store's
        host is gone or frozen, so :meth:`leave` neither writes the failure mark nor waits for
        the beating thread, and the survivors' emergency meeting (which goes through the store)
        is not tried."""
        return self._unreachable

    @property
    def running(self) -> bool:
        """Whether the beating thread runs."""
        return self._thread is not None

    def _beat(self) -> None:  # a mark of the others (:meth:`forget`): they went on without it
        self.excluded |= int(self.writer_store.add(_key(self.rank), 1)) >= DOWN

    @property
    def starved_s(self) -> float:
        """Seconds this process's beating thread woke up late, in total (beyond a grace of
        ``interval`` per beat): time the machine did not give this process. :meth:`silent`
        does not count them against a peer (a loaded machine delays every beat alike), so a
        live rank on a starved machine is not taken for a frozen one.
        """
        return self._starved

    def _run(self) -> None:
        due = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            late = now - due
            if late > self.interval:
                self._starved += late - self.interval
            due = now + self.interval
            try:
                self._beat()
            except Exception as e:  # noqa: BLE001 - the store host is gone; readers report it
                self._store_error = e
                return

    # -- liveness monitor ---------------------------------------------------------------------
    def _watch(self, generation: int) -> None:
        """The monitor thread: every ``interval`` read every other rank's beat (one store read
        per peer, the reads a wait makes) and record the first finding (:meth:`check`).

        A rank silent for ``timeout`` is recorded at once, together with any that left after
        an error. A rank that left after an error (:meth:`leave`) while no rank is silent is
        recorded only after :attr:`down_grace_s`: it is often another survivor that has just
        named a silent rank, which this reader is about to find silent too (its clock for
        that rank started up to one read later), and the silent rank is the one to name.
        """
        peers = [r for r in range(self.world_size) if r != self.rank and r not in self.forgotten]
        down_since: dict[int, float] = {}
        while not self._stop.wait(self.interval):
            if generation != self._generation:
                return
            try:
                silent = self.silent(peers)
            except PeerSilent as e:  # the store is unreachable: its host is named
                self._found = (e.ranks, str(e))
                peer_lost()
                return
            if generation != self._generation:  # stopped and restarted during the read
                return
            with self._seen_lock:
                down = [r for r in silent if r in self._down]
            now = time.monotonic()
            down_since = {r: down_since.get(r, now) for r in down}
            quiet = [r for r in silent if r not in down]
            if quiet or any(now - t >= self.down_grace_s for t in down_since.values()):
                self._found = (tuple(silent), self.describe(silent))
                peer_lost()
                return

    @property
    def down_grace_s(self) -> float:
        """Seconds the liveness monitor waits before it names a rank that left after an error
        while no rank is silent (see :meth:`_watch`): two reads and a second."""
        return 2 * self.interval + 1.0

    @property
    def found(self) -> tuple[int, ...]:
        """The ranks the liveness monitor found silent or departed since :meth:`start`
        (empty when none); :meth:`check` raises for them."""
        found = self._found
        return () if found is None else found[0]

    @property
    def has_finding(self) -> bool:
        """The liveness monitor found a silent or departed rank (or an unreachable store,
        whose host may be unnamed) since :meth:`start`, or this rank is :attr:`excluded`:
        :meth:`check` would raise."""
        return self._found is not None or self.excluded

    def check(self, where: str) -> None:
        """Raise :class:`PeerSilent` naming the ranks the liveness monitor found silent or
        departed (see ``monitor``), or :class:`RankExcluded` (:attr:`excluded`); no-op
        otherwise. Called at every step boundary (a read of one attribute), so a rank that
        nobody waits on is noticed within about ``timeout + interval`` plus one step. ``where``
        says what this rank was doing ("rank 0 at step 12")."""
        if self.excluded:
            raise RankExcluded(f"{where}: the other ranks of this elastic fit counted this rank "
                               "lost (silent for longer than heartbeat_timeout) and went on "
                               "without it; it cannot rejoin the fit", (self.rank,))
        found = self._found
        if found is not None:
            raise PeerSilent(f"{where}: found by the liveness monitor: {found[1]}", found[0])

    # -- reader -----------------------------------------------------------------------------------
    def silent(self, ranks: Iterable[int], threshold: float | None = None) -> list[int]:
        """The ranks among ``ranks`` whose beat has not moved for ``threshold`` seconds
        (default ``timeout``), and those that left after an error (:meth:`leave`).

        The first call for a rank starts its clock; seconds in which this process was starved
        of CPU (:attr:`starved_s`) do not count. Raises :class:`PeerSilent` (naming the
        store's host, or all of ``ranks``) when the store cannot be reached.
        """
        ranks = list(ranks)
        limit = self.timeout if threshold is None else threshold
        now = time.monotonic()
        starved = self._starved
        out = []
        others = [r for r in ranks if r != self.rank]
        counts = self.store_call(lambda: [int(self.store.add(_key(r), 0)) for r in others],
                                 "reading the heartbeats", ranks)
        for r, count in zip(others, counts):
            with self._seen_lock:
                if count >= DOWN:
                    self._down.add(r)
                    out.append(r)
                    continue
                self._down.discard(r)
                last = self._seen.get(r)
                if last is None or last[0] != count:
                    self._seen[r] = (count, now, starved)
                elif now - last[1] - (starved - last[2]) > limit:
                    out.append(r)
        return out

    def store_call(self, operation: Callable[[], Any], what: str,
                   ranks: Sequence[int] = ()) -> Any:
        """``operation()`` (on a store that the rank hosting it serves), bounded by
        ``timeout`` (:func:`bounded`); :class:`PeerSilent` naming the store's host (or
        ``ranks`` when a launcher hosts it) when the store fails or does not answer."""
        try:
            return bounded(operation, self.timeout, what)
        except Exception as e:  # noqa: BLE001
            self._unreachable = True
            host = (f"rank {self.store_host}" if self.store_host is not None
                    else "the launcher (torchrun's agent)")
            culprits = [self.store_host] if self.store_host is not None else list(ranks)
            raise PeerSilent(
                f"rank {self.rank}: the rendezvous store hosted by {host} is unreachable "
                f"({e}); that process has exited or is frozen", culprits) from e

    def describe(self, silent: Sequence[int], threshold: float | None = None) -> str:
        """Why ``silent`` (from :meth:`silent` with the same ``threshold``) count as silent,
        naming them."""
        with self._seen_lock:
            down = [r for r in silent if r in self._down]
        quiet = [r for r in silent if r not in down]
        parts = []
        if down:
            told = self._told(down)
            parts.append(f"rank(s) {_ranks(down)} failed with an error and left the run"
                         + (f" ({told})" if told else ""))
        if quiet:
            limit = self.timeout if threshold is None else threshold
            parts.append(f"rank(s) {_ranks(quiet)} sent no heartbeat for more than "
                         f"{limit:g} s (frozen, killed or cut off)")
        return "; ".join(parts)


def store_call(operation: Callable[[], Any], what: str) -> Any:
    """``operation()`` on the rendezvous store, bounded like a heartbeat read when this process
    runs a heartbeat (:meth:`Heartbeat.store_call`; a frozen store host is named after about
    ``heartbeat_timeout``), else run as is. The shared samplers claim every batch this way."""
    beat = current()
    return operation() if beat is None else beat.store_call(operation, what)
