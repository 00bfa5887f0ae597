"""The SIGTERM check of the gossip strategies: :class:`SigtermWatch` records SIGTERM (and,
deferred, SLURM's requeue signal), :func:`make_sigterm_check_local` puts a check without
collectives in place of Lightning's per-batch SIGTERM broadcast (``docs/faults.md``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_gossip import _compat

__all__ = ["SigtermWatch", "make_sigterm_check_local"]


class SigtermWatch:
    """Records SIGTERM (and, deferred, SLURM's requeue signal) for a strategy's own check.

    Lightning 2.6 handles SIGTERM with collectives: its signal handler broadcasts from rank 0
    (a rank other than 0 blocks there, inside the handler, until rank 0 joins: a SIGTERM to
    one rank hangs it for the whole ``timeout``), and the training loop broadcasts rank 0's flag
    before every batch (a per-step collective). Its SLURM auto-requeue handler writes a
    checkpoint (a collective under the gossip strategies) inside the handler, wherever each
    rank is. The first :meth:`poll` (before the first batch, after Lightning registered its
    handlers, on the main thread) replaces the SIGTERM handler by one that only records the
    signal and forwards it to the launcher's children (as Lightning's does), and with
    ``defer_requeue`` Lightning's auto-requeue handler by one that only records it
    (:attr:`requeue_signal`). Lightning restores the previous handlers at teardown.
    """

    def __init__(self, trainer: Any, defer_requeue: bool = False) -> None:
        self.trainer = trainer
        self.defer_requeue = defer_requeue
        #: the requeue signal whose Lightning handler was replaced (``None``: none)
        self.requeue_signal: int | None = None
        self._received = threading.Event()
        self._requeue = threading.Event()
        self._installed = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self._received.is_set():
            launcher = getattr(self.trainer.strategy, "launcher", None)
            kill = getattr(launcher, "kill", None)
            if kill is not None:
                kill(signum)
        self._received.set()

    def _on_requeue(self, signum: int, frame: Any) -> None:
        self._requeue.set()

    def poll(self) -> bool:
        """Whether this rank received SIGTERM (installing the handlers on the first call)."""
        if not self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
            if self.defer_requeue:
                self.requeue_signal = _compat.slurm_requeue_signal(self.trainer)
                if self.requeue_signal is not None:
                    signal.signal(self.requeue_signal, self._on_requeue)
            self._installed = True
        return self._received.is_set() or bool(getattr(self.trainer, "received_sigterm", False))

    @property
    def requeue_requested(self) -> bool:
        """Whether this rank received the (deferred) requeue signal."""
        return self._requeue.is_set()


def make_sigterm_check_local(trainer: Any,
                             stop_now: Callable[[bool], bool] | None = None,
                             requeue_now: Callable[[bool], bool] | None = None) -> SigtermWatch:
    """Replace Lightning's per-batch SIGTERM broadcast by a check without collectives.

    Before every batch the check polls a :class:`SigtermWatch` and raises Lightning's
    ``SIGTERMException`` when ``stop_now(received)`` is true; without ``stop_now`` a rank that
    received SIGTERM stops on its own at its next batch (AD-PSGD): the strategy's
    ``on_exception`` then tells the peers
    (:meth:`~lightning_gossip.liveness.Heartbeat.leave`), which fail within about a
    second, naming this rank. ``DPSGDStrategy`` passes a ``stop_now`` that makes every rank stop
    at the same step, agreed through its gossip messages.

    With ``requeue_now``, Lightning's SLURM auto-requeue handler (which would checkpoint inside
    the signal handler) is replaced too, and before every batch, first, ``requeue_now(received)``
    (``received``: this rank got the requeue signal) writes the requeue checkpoint when the
    strategy says every rank is there; it returns whether the job was requeued, and then the
    check raises ``SIGTERMException`` (every rank stops at that batch).
    """
    watch = SigtermWatch(trainer, defer_requeue=requeue_now is not None)

    def local_sigterm_check() -> None:
        received = watch.poll()
        requeued = (requeue_now is not None and watch.requeue_signal is not None
                    and requeue_now(watch.requeue_requested))
        if requeued or (stop_now(received) if stop_now is not None else received):
            raise SIGTERMException()

    _compat.replace_sigterm_broadcast(trainer, local_sigterm_check)
    return watch
