"""Waits on peers that watch the heartbeats (:func:`wait_for_peers`), and the rank-local
SIGTERM check of the strategies (:func:`make_sigterm_check_local`)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_gossip.exchange import GossipTimeout
from lightning_gossip.liveness.heartbeat import Heartbeat, PeerSilent, _ranks

#: seconds a wait still gives its works once a peer is found silent (its last message may be
#: on its way)
GRACE_S = 1.0


def wait_for_peers(works: Sequence[dist.Work], peers: Iterable[int], heartbeat: Heartbeat | None,
                   timeout: timedelta, what: str,
                   should_stop: Callable[[], bool] | None = None) -> bool:
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

    Returns:
        ``True`` when every work completed.
    """
    peers = sorted(set(peers))
    deadline = time.monotonic() + timeout.total_seconds()
    if (heartbeat is None and should_stop is None) or all(w.is_completed() for w in works):
        _wait_blocking(works, timeout, what, peers)
        return True
    # gloo's send/recv works complete only inside ``wait()`` (``is_completed`` stays False), so
    # a helper thread waits and this thread watches it, the deadline, the stop flag and the
    # heartbeats. An abandoned helper ends with its works (or at ``timeout``).
    waiter = _Waiter(works, timeout, what, peers)
    # a wait that ends within a beat costs no store read
    next_check = 0.0 if heartbeat is None else time.monotonic() + min(1.0, heartbeat.interval)
    while not waiter.done.wait(0.005 if heartbeat is None else min(0.05, heartbeat.interval)):
        now = time.monotonic()
        if now >= deadline:
            raise GossipTimeout(f"{what} did not complete within {timeout} "
                                f"(waiting on rank(s) {_ranks(peers)})")
        if should_stop is not None and should_stop():
            return False
        if heartbeat is not None and now >= next_check:
            next_check = now + min(1.0, heartbeat.interval)
            silent = heartbeat.silent(peers)
            if silent and not waiter.done.wait(GRACE_S):
                raise PeerSilent(f"{what}: {heartbeat.describe(silent)}", silent)
    if waiter.error is not None:
        raise waiter.error
    return True


class _Waiter:
    """A daemon thread that waits for ``works`` (blocking) and records the outcome."""

    def __init__(self, works: Sequence[dist.Work], timeout: timedelta, what: str,
                 peers: Sequence[int]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        args = (list(works), timeout, what, list(peers))
        threading.Thread(target=self._run, args=args, daemon=True,
                         name="lightning-gossip-wait").start()

    def _run(self, works: list, timeout: timedelta, what: str, peers: list[int]) -> None:
        try:
            _wait_blocking(works, timeout, what, peers)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.done.set()


def make_sigterm_check_local(trainer: Any) -> None:
    """Make a SIGTERM end the rank that received it, at its next batch, on its own.

    Lightning 2.6 handles SIGTERM with collectives: its signal handler broadcasts from rank 0
    (a rank other than 0 blocks there, inside the handler, until rank 0 joins: a SIGTERM to
    one rank hangs it for the whole ``timeout``), and the training loop broadcasts rank 0's flag
    before every batch (a per-step collective: under AD-PSGD it forces lockstep and can
    deadlock). Here the per-batch broadcast becomes a local check that raises
    ``SIGTERMException``; its first call (before the first batch, after Lightning registered
    its handlers) replaces the SIGTERM handler by one that only records the signal and
    forwards it to the launcher's children (as Lightning's does). The strategy's
    ``on_exception`` then tells the peers (:meth:`Heartbeat.leave`), which fail within about a
    second, naming this rank. Lightning restores the previous handlers at teardown.
    """
    from lightning_gossip import _compat

    received = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        if not received.is_set():
            launcher = getattr(trainer.strategy, "launcher", None)
            kill = getattr(launcher, "kill", None)
            if kill is not None:
                kill(signum)
        received.set()

    installed = []

    def local_sigterm_check() -> None:
        if not installed and threading.current_thread() is threading.main_thread():
            installed.append(signal.signal(signal.SIGTERM, on_sigterm))
        if received.is_set() or getattr(trainer, "received_sigterm", False):
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException()

    _compat.replace_sigterm_broadcast(trainer, local_sigterm_check)


def _wait_blocking(works: Sequence[dist.Work], timeout: timedelta, what: str,
                   peers: Sequence[int]) -> None:
    for w in works:
        try:
            ok = w.wait(timeout)
        except RuntimeError as e:  # gloo raises on timeout or when a peer went away
            raise GossipTimeout(f"{what} failed or timed out after {timeout} "
                                f"(waiting on rank(s) {_ranks(peers)}): {e}") from e
        if ok is False:
            raise GossipTimeout(f"{what} did not complete within {timeout} "
                                f"(waiting on rank(s) {_ranks(peers)})")
