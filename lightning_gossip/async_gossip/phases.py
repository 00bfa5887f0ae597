"""The phase clock: which gossip phase is open, which one is ending, which one is quiet.

Gossip runs in *phases*, numbered 0, 1, 2, ...; between two phases (validation,
checkpointing, the end of ``fit``) the network is quiet. The training thread opens a phase
(:meth:`PhaseClock.open`) and asks for its end (:meth:`PhaseClock.request_end`); the gossip
thread says when it has finished its part of it (:meth:`PhaseClock.mark_ended`): an active
rank after sending its BYEs, a passive rank once it has a BYE from each of its actives.

Example (one thread plays both sides here; the engine holds its lock around every call)::

    >>> clock = PhaseClock()
    >>> clock.open(); clock.is_open, clock.thread_phase, clock.open_for_thread()
    (True, 0, True)
    >>> clock.request_end()
    0
    >>> clock.end_requested_for_thread()
    True
    >>> clock.mark_ended(0); clock.is_ended(0), clock.quiet
    (True, True)
    >>> clock.close(); clock.is_open, clock.current, clock.thread_phase
    (False, 1, 1)
    >>> clock.open_for_thread()  # phase 1 not opened yet: the thread idles
    False
"""

from __future__ import annotations

__all__ = ["PhaseClock"]


class PhaseClock:
    """Phase numbers shared by the training thread and the gossip thread.

    Every field is read and written under the engine's lock (``SharedState.lock``), except
    the two the training thread alone uses.

    Attributes:
        current: the phase that is open, or the next one to open. Written by the training
            thread only (no lock needed).
        is_open: a phase is running (between :meth:`open` and :meth:`close`). Written by the
            training thread only.
        opened: the last phase the training thread opened (-1: none yet). Written by the
            training thread, under the lock.
        end_requested: the last phase the training thread asked to end (-1: none). Written
            by the training thread, under the lock.
        ended: the last phase the gossip thread has finished (-1: none). Written by the
            gossip thread, under the lock.
    """

    def __init__(self) -> None:
        self.current = 0
        self.is_open = False
        self.opened = -1
        self.end_requested = -1
        self.ended = -1

    # -- training thread ---------------------------------------------------------------------
    def open(self) -> None:
        """Open phase :attr:`current` (training thread, under the lock)."""
        self.is_open = True
        self.opened = self.current

    def request_end(self) -> int:
        """Ask the gossip thread to end phase :attr:`current`; return its number."""
        self.end_requested = self.current
        return self.current

    def close(self) -> None:
        """After the gossip thread ended the phase: the next one is :attr:`current` now."""
        self.current += 1
        self.is_open = False

    @property
    def quiet(self) -> bool:
        """The gossip thread has finished phase :attr:`current` (no more gossip in it)."""
        return self.ended >= self.current

    def is_ended(self, phase: int) -> bool:
        """The gossip thread has finished ``phase``."""
        return self.ended >= phase

    # -- gossip thread -----------------------------------------------------------------------
    @property
    def thread_phase(self) -> int:
        """The phase the gossip thread works on: the one after the last it ended."""
        return self.ended + 1

    def open_for_thread(self) -> bool:
        """The training thread has opened :attr:`thread_phase`: gossip may flow."""
        return self.opened >= self.thread_phase

    def end_requested_for_thread(self) -> bool:
        """The training thread asked to end :attr:`thread_phase`."""
        return self.end_requested >= self.thread_phase

    def mark_ended(self, phase: int) -> None:
        """The gossip thread has finished ``phase`` (gossip thread, under the lock)."""
        self.ended = phase
