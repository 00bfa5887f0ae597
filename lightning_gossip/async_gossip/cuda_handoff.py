"""Ordering GPU work between the training thread and the gossip thread (no-ops on CPU).

The gossip thread runs its kernels on a side CUDA stream. A buffer handed from one thread to
the other is only safe to read once the kernels that wrote it have run, so the writer records
an event on its stream and the reader makes its own stream wait for that event (the CPU does
not block). On CPU every method does nothing.

Example (on CPU)::

    >>> import torch
    >>> handoff = StreamHandoff(torch.device("cpu"))
    >>> handoff.stream is None
    True
    >>> handoff.to_thread(); handoff.wait_for_training()  # nothing to order on CPU
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["StreamHandoff"]


class StreamHandoff:
    """CUDA events between the two threads of one rank.

    Args:
        device: where the replica lives; CUDA devices get a side stream for the gossip thread.

    Attributes:
        stream: the gossip thread's side stream (``None`` on CPU).

    The events are written and read under the engine's lock: the one towards the gossip
    thread is recorded by the training thread (:meth:`to_thread`), the one towards the
    training thread by the gossip thread (:meth:`to_training`).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._to_thread: torch.cuda.Event | None = None    # training thread writes
        self._to_training: torch.cuda.Event | None = None  # gossip thread writes

    @contextlib.contextmanager
    def on_side_stream(self) -> Iterator[None]:
        """Run the body (the gossip thread's loop) on :attr:`stream` (nothing on CPU)."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    # -- training thread -----------------------------------------------------------------------
    def to_thread(self) -> None:
        """Mark buffers the training thread just wrote (snapshot, view) as handed over."""
        if self.cuda:
            self._to_thread = torch.cuda.Event()
            self._to_thread.record()

    def wait_for_thread(self) -> None:
        """Before reading the deltas: order after the gossip thread's last hand-over."""
        if self.cuda and self._to_training is not None:
            torch.cuda.current_stream().wait_event(self._to_training)

    # -- gossip thread -------------------------------------------------------------------------
    def wait_for_training(self) -> None:
        """Before reading a snapshot: order after the training thread's last hand-over."""
        if self.cuda and self._to_thread is not None:
            torch.cuda.current_stream().wait_event(self._to_thread)

    def to_training(self) -> None:
        """Mark the deltas the gossip thread just wrote as handed over."""
        if self.cuda:
            self._to_training = torch.cuda.Event()
            self._to_training.record()
