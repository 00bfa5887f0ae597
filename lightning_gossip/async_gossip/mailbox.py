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

A step boundary costs the training thread at most one add and one snapshot copy over the
replica: a delta buffer is never zeroed. Its dirty flag says whether it holds deltas; a clean
one holds stale values that nobody reads, and the next :meth:`~DeltaMailbox.post_delta`
overwrites it instead of adding. With ``delay_by_one`` the snapshot is packed and the pending
``ready`` added in one pass (:meth:`~lightning_gossip.flat.FlatState.pack` with ``plus``). The
values are those of zero-filled buffers, bit for bit (but for a -0.0 weight at a phase end, see
:meth:`~DeltaMailbox.apply_all`).

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
    >>> box.acc_dirty, box.acc.tolist()           # applied: clean, not zeroed (never read)
    (False, [0.5])
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
        acc: deltas not yet applied, valid only while ``acc_dirty``: a clean ``acc`` holds
            stale values (in the shard; zeros outside it, never written). Written (clean) or
            added to (dirty) by the gossip thread; applied, and marked clean, by the training
            thread.
        ready: (``delay_by_one``) deltas due at the next boundary, valid only while
            ``ready_dirty``. Training thread only.
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
        """Add the deltas that are due to the weights (see :meth:`due_now`): one add."""
        if not self.delay_by_one:
            if self.acc_dirty:
                self.flat.add_(self.acc)
                self.acc_dirty = False  # not zeroed: the next post overwrites it
            return
        if self.ready_dirty:
            self.flat.add_(self.ready)
            self.ready_dirty = False
        self._promote()

    def _promote(self) -> None:
        """(``delay_by_one``, ``ready`` clean) what arrived since the last boundary is due at
        the next one: swap the buffers."""
        if self.acc_dirty:
            self.ready, self.acc = self.acc, self.ready
            self.ready_dirty, self.acc_dirty = True, False

    def due_now(self) -> bool:
        """Whether :meth:`apply_due` has anything to do."""
        return self.acc_dirty or (self.delay_by_one and self.ready_dirty)

    def leave_snapshot(self, step: int) -> None:
        """Pack a fresh snapshot, including the deltas not yet in the weights.

        After :meth:`apply_due` at most one buffer is pending (``ready``, with
        ``delay_by_one``): one pass, the copy and the add fused. Sharded, the pending deltas
        are added to the shard's slice only (the gossip thread reads no other).
        """
        pending = [buf for buf, dirty in ((self.acc, self.acc_dirty),
                                          (self.ready, self.ready_dirty)) if dirty]
        lo, hi = self.lo, self.hi
        if pending and hi - lo == self.flat.numel:
            self.flat.pack(out=self.fresh, plus=pending.pop(0))
        else:
            self.flat.pack(out=self.fresh)
        for buf in pending:  # same order as adding acc, then ready
            self.fresh[lo:hi].add_(buf[lo:hi])
        self.fresh_step = step
        self.fresh_ready = True

    def apply_all(self, steps: int) -> None:
        """At the end of a phase (the gossip thread is quiet): apply every pending delta.

        A clean buffer is skipped (zero-filled ones were added, which turned a -0.0 weight
        into +0.0; it now stays -0.0, the only difference).
        """
        if self.acc_dirty:
            self.flat.add_(self.acc)
        if self.ready_dirty:
            self.flat.add_(self.ready)
        self.acc_dirty = self.ready_dirty = False
        self.fresh_ready = False
        self.gossiped = steps

    def take_due(self, out: Tensor) -> None:
        """Like :meth:`apply_due`, but the due deltas of the shard go into ``out[:hi - lo]``
        (the rest of ``out`` is zeroed, and all of it when nothing is due) instead of into the
        weights."""
        lo, hi = self.lo, self.hi
        out[hi - lo:].zero_()
        due: Tensor | None = None
        if not self.delay_by_one:
            if self.acc_dirty:
                due, self.acc_dirty = self.acc, False
        elif self.ready_dirty:
            due, self.ready_dirty = self.ready, False
        if due is None:
            out[:hi - lo].zero_()
        else:
            out[:hi - lo].copy_(due[lo:hi])
        if self.delay_by_one:
            self._promote()

    def take_all(self, out: Tensor, steps: int) -> None:
        """Like :meth:`apply_all`, but every pending delta of the shard goes into ``out``."""
        lo, hi = self.lo, self.hi
        out[hi - lo:].zero_()
        pending = [buf[lo:hi] for buf, dirty in ((self.acc, self.acc_dirty),
                                                 (self.ready, self.ready_dirty)) if dirty]
        if len(pending) == 2:
            torch.add(pending[0], pending[1], out=out[:hi - lo])
        elif pending:
            out[:hi - lo].copy_(pending[0])
        else:
            out[:hi - lo].zero_()
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
        mine = self.acc[self.lo:self.hi]
        if self.acc_dirty:
            mine.add_(delta)
        else:  # overwrite the stale values; ``delta + 0.0`` is what a zeroed buffer would hold
            torch.add(delta, 0.0, out=mine)  # (-0.0 becomes +0.0), in one pass like a copy
        if self.fresh_ready:  # a snapshot left meanwhile lacks this delta
            self.fresh[self.lo:self.hi].add_(delta)
        self.acc_dirty = True
        self.gossiped = max(self.gossiped, covered)
