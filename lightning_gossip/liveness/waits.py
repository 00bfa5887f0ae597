"""Waits on peers that watch the heartbeats (:func:`wait_for_peers`, and :func:`wait_done` for
a result computed by a communication thread: one wait loop, :func:`_watch`), the search for the
rank to blame for a failed wait (:func:`blame`, :func:`find_silent`), and the SIGTERM check of
the strategies (:class:`SigtermWatch`, :func:`make_sigterm_check_local`).

The waits read a rank's heartbeat through :class:`PeerWatch`, the four things they ask of it;
:class:`~lightning_gossip.liveness.heartbeat.Heartbeat` (whose module imports this one) is one,
so this module needs nothing of it, not even for annotations: the liveness modules form no
import cycle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from lightning_gossip.errors import GossipTimeout, NonFiniteFromPeer, PeerSilent
from lightning_gossip.liveness.at_exit import EXITING, track


class PeerWatch(Protocol):
    """What a wait asks of a rank's heartbeat
    (:class:`~lightning_gossip.liveness.heartbeat.Heartbeat` is one)."""

    #: seconds between two beats of a rank
    interval: float

    def silent(self, ranks: Iterable[int], threshold: float | None = None) -> list[int]:
        """The ranks among ``ranks`` whose beat is late by more than ``threshold`` seconds
        (or that marked themselves gone)."""
        ...

    def describe(self, silent: Sequence[int], threshold: float | None = None) -> str:
        """A sentence naming the ``silent`` ranks, for an error message."""
        ...

    def check(self, where: str) -> None:
        """Raise the error of a finding of the heartbeat's monitor (a silent peer), naming
        ``where`` the rank was."""
        ...

#: seconds a wait still gives its works once a peer is found silent (its last message may be
#: on its way)
GRACE_S = 1.0


def wait_for_peers(works: Sequence[dist.Work], peers: Iterable[int], heartbeat: PeerWatch | None,
                   timeout: timedelta, what: str,
                   should_stop: Callable[[], bool] | None = None, polled: bool = False) -> bool:
    """Wait for every work to complete, failing fast if a peer it depends on goes silent.

    Args:
        works: the pending ``dist.Work`` objects (sends and receives).
        peers: the ranks these works depend on (checked for liveness).
        heartbeat: the rank's :class:`Heartbeat`; ``None`` disables the liveness check (then
            this is a plain wait with a timeout).
        timeout: overall limit; then :class:`GossipTimeout` naming ``what`` and ``peers``.
        what: what is being waited for, for error messages ("rank 3 receiving ...").
        should_stop: polled too; when it returns ``True`` the wait is abandoned and ``False``
            is returned (the works are left pending).
        polled: poll the works' ``is_completed()`` instead of waiting in a helper thread (for
            collectives only: gloo's send and receive complete inside ``wait()``). A wait
            that may be abandoned on a live peer (an elastic fit's node collectives) then
            leaves no thread blocked in gloo, which would abort the process if its wait ended
            while the interpreter shuts down (``docs/exit-status.md``).

    Returns:
        ``True`` when every work completed.
    """
    peers = sorted(set(peers))
    deadline = time.monotonic() + timeout.total_seconds()
    if (heartbeat is None and should_stop is None) or all(w.is_completed() for w in works):
        _wait_blocking(works, timeout, what, peers)
        return True
    if polled:
        if not _watch(_Polled(works), peers, heartbeat, deadline, timeout, what, should_stop):
            return False
        try:
            _wait_blocking(works, timeout, what, peers)  # complete: returns or raises at once
        except GossipTimeout as e:
            raise blame(e, peers, heartbeat, what)  # noqa: B904 - blame chains it
        return True
    # gloo's send/recv works complete only inside ``wait()`` (``is_completed`` stays False), so
    # a helper thread waits and this thread watches it, the deadline, the stop flag and the
    # heartbeats. An abandoned helper ends with its works (or at ``timeout``).
    waiter = _Waiter(works, timeout, what, peers)
    if not _watch(waiter.done, peers, heartbeat, deadline, timeout, what, should_stop):
        return False
    if waiter.error is not None:
        raise blame(waiter.error, peers, heartbeat, what)
    return True


def blame(error: BaseException, peers: Iterable[int], heartbeat: PeerWatch | None,
          what: str) -> BaseException:
    """The error to raise for ``error``, a failed wait on several ``peers``: when it does not
    say which peer failed (a broken connection: gloo names an address, not a rank), look at
    the heartbeats for a little while for the rank that caused it.

    A rank that failed with an error marks itself gone (found at once); a killed one stops
    beating, found once its beat is ``2.5 * interval`` late (at most ``3.5 * interval`` of
    looking: 17.5 s with the default ``heartbeat_timeout`` of 60 s). Returns a
    :class:`PeerSilent` naming them, else ``error`` unchanged (also without a heartbeat, for
    one peer, which the message names already, and for errors that name their culprits).
    """
    peers = sorted(set(peers))
    names_culprit = isinstance(error, (PeerSilent, NonFiniteFromPeer))
    if heartbeat is None or len(peers) < 2 or names_culprit or not isinstance(
            error, (GossipTimeout, RuntimeError)):
        return error
    threshold = 2.5 * heartbeat.interval
    try:
        silent = find_silent(heartbeat, peers, threshold + heartbeat.interval, threshold,
                             poll_s=min(0.5, heartbeat.interval / 2))
    except PeerSilent as e:  # the store is unreachable: its host is the culprit
        e.__cause__ = error
        return e
    if not silent:
        return error
    found = PeerSilent(f"{what}: {heartbeat.describe(silent, threshold)} (the wait "
                       f"failed: {str(error)[:300]})", silent)
    found.__cause__ = error
    return found


def find_silent(heartbeat: PeerWatch, peers: Iterable[int], within_s: float,
                threshold: float | None = None, poll_s: float = 0.05) -> list[int]:
    """The ranks among ``peers`` that :meth:`PeerWatch.silent` reports (with ``threshold``),
    looking every ``poll_s`` seconds for up to ``within_s`` seconds (at least once); empty
    when none is found by then. Raises :class:`PeerSilent` when the store is unreachable.

    For a wait that already failed and did not say on whom (a broken connection): the rank
    that caused it marks itself gone as it exits, or stops beating.
    """
    peers = list(peers)
    deadline = time.monotonic() + within_s
    while True:
        silent = heartbeat.silent(peers, threshold=threshold)
        if silent or time.monotonic() >= deadline:
            return silent
        time.sleep(poll_s)


class _Polled:
    """``works`` seen as the event :func:`_watch` waits on: set once every work reports itself
    completed (also when it failed), polled every 0.1 ms at first, every 5 ms at most."""

    def __init__(self, works: Sequence[dist.Work]) -> None:
        self.works, self._pause = list(works), 1e-4

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not all(w.is_completed() for w in self.works):
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self._pause, left))
            self._pause = min(2 * self._pause, 0.005)
        return True


class _Waiter:
    """A daemon thread that waits for ``works`` (blocking) and records the outcome."""

    def __init__(self, works: Sequence[dist.Work], timeout: timedelta, what: str,
                 peers: Sequence[int]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        args = (list(works), timeout, what, list(peers))
        track(threading.Thread(target=self._run, args=args, daemon=True,
                               name="lightning-gossip-wait")).start()

    def _run(self, works: list, timeout: timedelta, what: str, peers: list[int]) -> None:
        try:
            _wait_blocking(works, timeout, what, peers)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.done.set()


def wait_done(done: threading.Event, peers: Iterable[int], heartbeat: PeerWatch | None,
              timeout: timedelta, what: str,
              should_stop: Callable[[], bool] | None = None) -> bool:
    """Wait for ``done`` (set by a thread that waits on the network), failing fast if a peer
    goes silent (:class:`PeerSilent`) and after ``timeout`` (:class:`GossipTimeout`);
    ``False`` when ``should_stop`` returned ``True`` first (as :func:`wait_for_peers`).

    An event already set costs nothing (no store read): the common case when the
    communication thread finished while the training thread computed.
    """
    if done.is_set():
        return True
    return _watch(done, sorted(set(peers)), heartbeat,
                  time.monotonic() + timeout.total_seconds(), timeout, what, should_stop)


def _watch(done: threading.Event | _Polled, peers: Sequence[int], heartbeat: PeerWatch | None,
           deadline: float, timeout: timedelta, what: str,
           should_stop: Callable[[], bool] | None = None) -> bool:
    """The one deadline-and-heartbeat wait: wait for ``done`` until the monotonic ``deadline``
    (then :class:`GossipTimeout` naming ``what`` and ``peers``, after ``timeout``), polling
    ``should_stop`` (``True``: return ``False`` at once), :data:`~lightning_gossip.liveness.
    at_exit.EXITING` (the interpreter exits: return ``False`` at once, or without
    ``should_stop`` raise :class:`GossipTimeout`) and, about once a second, the
    heartbeats of ``peers`` (a silent one: :class:`PeerSilent`, unless ``done`` is set within
    :data:`GRACE_S`) and the liveness monitor's finding (any silent rank: :class:`PeerSilent`
    naming it, the same way; a peer may be waiting for the others in its emergency
    checkpoint). Returns ``True`` once ``done`` is set."""
    poll = 0.005 if heartbeat is None else min(0.05, heartbeat.interval)
    # a wait that ends within a beat costs no store read
    next_check = 0.0 if heartbeat is None else time.monotonic() + min(1.0, heartbeat.interval)
    while not done.wait(poll):
        now = time.monotonic()
        if now >= deadline:
            raise GossipTimeout(f"{what} did not complete within {timeout} "
                                f"(waiting on rank(s) {_ranks(peers)})", peers)
        if should_stop is not None and should_stop():
            return False
        if EXITING.is_set():  # the interpreter exits: nobody is left to wait for the result
            if should_stop is not None:
                return False
            raise GossipTimeout(f"{what}: abandoned, the process is exiting", peers)
        if heartbeat is not None and now >= next_check:
            next_check = now + min(1.0, heartbeat.interval)
            silent = heartbeat.silent(peers)
            if silent and not done.wait(GRACE_S):
                raise PeerSilent(f"{what}: {heartbeat.describe(silent)}", silent)
            if not silent and getattr(heartbeat, "has_finding", False) and not done.wait(
                    GRACE_S):  # a peer waits for this rank's emergency checkpoint, say
                heartbeat.check(what)
    return True


def _wait_blocking(works: Sequence[dist.Work], timeout: timedelta, what: str,
                   peers: Sequence[int]) -> None:
    for w in works:
        try:
            ok = w.wait(timeout)
        except RuntimeError as e:  # gloo raises on timeout or when a peer went away
            raise GossipTimeout(f"{what} failed or timed out after {timeout} "
                                f"(waiting on rank(s) {_ranks(peers)}): {e}", peers) from e
        if ok is False:
            raise GossipTimeout(f"{what} did not complete within {timeout} "
                                f"(waiting on rank(s) {_ranks(peers)})", peers)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks) if ranks else "none"
