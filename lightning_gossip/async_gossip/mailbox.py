"""The delta mailbox: what the two threads of a rank hand each other.

The gossip thread never writes parameters (changing them between forward and backward breaks
autograd). It works on its own flat copy of the replica (:attr:`DeltaMailbox.view`) and posts
the deltas of its exchanges here; the training thread adds them to the weights at a step
boundary and leaves a fresh snapshot for the next exchange.

* ``acc``: deltas posted since the last step boundary (the gossip thread adds to it).
* ``ready``: with ``delay_by_one``, the deltas that arrived before the last boundary; they
  are applied at the next one, so every exchange has a whole step to hide behind.
* ``fresh``: the snapshot the training thread leaves (weights + deltas not yet applied);
  the gossip thread adopts it as its :attr:`~DeltaMailbox.view` for its next exchange.

With a *shard* ``[lo, hi)`` (hierarchical AD-PSGD) the gossip thread exchanges and posts deltas
for that slice only; the training thread takes the due slice deltas out
(:meth:`DeltaMailbox.take_due`) for the node's all-gather instead of applying them itself.

Example (CPU; one thread plays both sides here, the engine holds its lock around every call)::

    >>> import torch
    >>> from lightning_gossip.flat import FlatState
    >>> model = torch.nn.Linear(1, 1, bias=False)
    >>> _ = torch.nn.init.constant_(model.weight, 1.0)
    >>> box = DeltaMailbox(FlatState(model), delay_by_one=False)
    >>> box.leave_snapshot(step=1)                 # training thread, at a step boundary
    >>> box.take_snapshot(), box.view.tolist()     # gossip thread: steps covered, view
    (1, [1.0])
    >>> box.post_delta(torch.tensor([0.5]), covered=1)   # after an exchange
    >>> box.apply_due(); model.weight.item()       # training thread, next boundary
    1.5
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gossip.flat import FlatState

__all__ = ["DeltaMailbox"]


class DeltaMailbox:
    """Delta and snapshot buffers shared by the training thread and the gossip thread.

    Args:
        flat: the replica.
        delay_by_one: apply deltas one step boundary later than they arrive.
        shard: ``(lo, hi)``, the slice of the replica this rank gossips (default: all of it).

    Every method runs under the engine's lock (``SharedState.lock``), so the fields below are
    guarded by it; the buffers the gossip thread uses outside the lock are marked.

    Attributes:
        view: the gossip thread's copy of the replica. Used by the gossip thread outside the
            lock during an exchange; the training thread packs it only between phases, when
            the gossip thread is idle (:meth:`reset`).
        fresh: the snapshot left for the gossip thread. Written by the training thread
            (:meth:`leave_snapshot`); swapped with ``view`` by the gossip thread
            (:meth:`take_snapshot`), which also adds deltas that arrive while it waits.
        fresh_ready: ``fresh`` holds a snapshot not yet taken. Set by the training thread,
            cleared by the gossip thread (and by the training thread between phases).
        fresh_step: the number of steps the snapshot in ``fresh`` covers (training thread).
        gossiped: steps covered by the last exchanged snapshot. Raised by the gossip thread
            after an exchange; reset by the training thread between phases.
        acc: deltas not yet applied; ``acc_dirty`` says it is non-zero. Added to by the
            gossip thread, applied and zeroed by the training thread.
        ready: (``delay_by_one``) deltas due at the next boundary; ``ready_dirty`` says it is
            non-zero. Training thread only.
    """

    def __init__(self, flat: FlatState, delay_by_one: bool,
                 shard: tuple[int, int] | None = None) -> None:
        self.flat = flat
        self.delay_by_one = delay_by_one
        self.lo, self.hi = shard if shard is not None else (0, flat.numel)
        self.view = flat.pack()
        self.fresh = flat.empty()
        self.fresh_ready = False
        self.fresh_step = 0
        self.gossiped = 0
        self.acc = torch.zeros_like(self.view)
        self.acc_dirty = False
        self.ready = torch.zeros_like(self.view)
        self.ready_dirty = False

    # -- training thread -----------------------------------------------------------------------
    def reset(self, steps: int) -> None:
        """At the start of a phase: the view is the replica, nothing is pending."""
        self.fresh_ready = False
        self.flat.pack(out=self.view)  # the gossip thread is idle between phases
        self.gossiped = steps

    def apply_due(self) -> None:
        """Add the deltas that are due to the weights (see :meth:`due_now`)."""
        if not self.delay_by_one:
            if self.acc_dirty:
                self.flat.add_(self.acc)
                self.acc.zero_()
                self.acc_dirty = False
            return
        if self.ready_dirty:
            self.flat.add_(self.ready)
            self.ready.zero_()
            self.ready_dirty = False
        if self.acc_dirty:  # what arrived since the last boundary is due at the next one
            self.ready, self.acc = self.acc, self.ready
            self.ready_dirty, self.acc_dirty = True, False

    def due_now(self) -> bool:
        """Whether :meth:`apply_due` has anything to do."""
        return self.acc_dirty or (self.delay_by_one and self.ready_dirty)

    def leave_snapshot(self, step: int) -> None:
        """Pack a fresh snapshot, including the deltas not yet in the weights."""
        self.flat.pack(out=self.fresh)
        if self.acc_dirty:
            self.fresh.add_(self.acc)
        if self.ready_dirty:
            self.fresh.add_(self.ready)
        self.fresh_step = step
        self.fresh_ready = True

    def apply_all(self, steps: int) -> None:
        """At the end of a phase (the gossip thread is quiet): apply every pending delta."""
        self.flat.add_(self.acc)
        self.acc.zero_()
        if self.delay_by_one:
            self.flat.add_(self.ready)
            self.ready.zero_()
        self.acc_dirty = self.ready_dirty = False
        self.fresh_ready = False
        self.gossiped = steps

    def take_due(self, out: Tensor) -> None:
        """Like :meth:`apply_due`, but the due deltas of the shard go into ``out[:hi - lo]``
        (the rest of ``out`` is zeroed) instead of into the weights."""
        out.zero_()
        lo, hi = self.lo, self.hi
        if not self.delay_by_one:
            if self.acc_dirty:
                out[:hi - lo].copy_(self.acc[lo:hi])
                self.acc.zero_()
                self.acc_dirty = False
            return
        if self.ready_dirty:
            out[:hi - lo].copy_(self.ready[lo:hi])
            self.ready.zero_()
            self.ready_dirty = False
        if self.acc_dirty:
            self.ready, self.acc = self.acc, self.ready
            self.ready_dirty, self.acc_dirty = True, False

    def take_all(self, out: Tensor, steps: int) -> None:
        """Like :meth:`apply_all`, but every pending delta of the shard goes into ``out``."""
        out.zero_()
        n = self.hi - self.lo
        out[:n].add_(self.acc[self.lo:self.hi])
        out[:n].add_(self.ready[self.lo:self.hi])
        self.acc.zero_()
        self.ready.zero_()
        self.acc_dirty = self.ready_dirty = False
        self.fresh_ready = False
        self.gossiped = steps

    # -- gossip thread -------------------------------------------------------------------------
    def take_snapshot(self) -> int:
        """Adopt the fresh snapshot as :attr:`view`, if there is one; return the steps covered."""
        if not self.fresh_ready:
            return self.gossiped
        self.view, self.fresh = self.fresh, self.view
        self.fresh_ready = False
        return self.fresh_step

    def post_delta(self, delta: Tensor, covered: int) -> None:
        """Hand over the delta (of the shard: ``hi - lo`` values) of an exchange whose snapshot
        covered ``covered`` steps."""
        self.acc[self.lo:self.hi].add_(delta)
        if self.fresh_ready:  # a snapshot left meanwhile lacks this delta
            self.fresh[self.lo:self.hi].add_(delta)
        self.acc_dirty = True
        self.gossiped = max(self.gossiped, covered)
