"""The background engine of AD-PSGD: atomic pairwise averaging in a communication thread.

No Lightning here: :class:`AsyncGossip` is driven by a training thread that calls
:meth:`AsyncGossip.after_step` at every step boundary and :meth:`AsyncGossip.quiesce` at sync
points. The protocol (see ``docs/adpsgd.md``):

* Roles from :class:`~lightning_gossip.pairing.Pairing`: *active* ranks start exchanges,
  *passive* ranks answer them, one at a time, so every pairwise average is atomic and no cycle of
  waiting ranks can form.
* The training thread never blocks on communication. At a step boundary it adds the deltas the
  thread produced since the last boundary to the weights and, if the thread took the previous
  snapshot, leaves a fresh one. The thread never writes parameters (autograd would break).
* An active thread, for every new snapshot: sends ``[REQUEST, phase]`` to its next partner on a
  gloo *control* group, swaps snapshots on the *data* group, and computes
  ``delta = (theirs - mine) / 2``. The partner computes the opposite delta, so the sum of all
  replicas is conserved exactly.
* A passive thread receives control messages from any source and serves them in order.
* Phases: at a sync point every active finishes its exchange and sends ``[BYE, phase]`` to every
  passive it may contact; a passive is quiet once it has a BYE from each of its actives.
* Bounded staleness: the training thread waits while more than ``max_staleness`` of its steps
  are not yet in a snapshot that was exchanged.
* Gossip period (``period``, the strategies' ``gossip_every_n_steps``): an active rank leaves a
  fresh snapshot, so starts an exchange, at most once every ``period`` steps; ``max_staleness``
  then counts exchanges (the training thread waits once more than
  ``(max_staleness + 1) * period - 1`` of its steps are in no exchanged snapshot).
* Every wait has a timeout; an exception in the thread is re-raised in the training thread.

The parts, one module each:

* :mod:`~lightning_gossip.async_gossip.engine`: :class:`AsyncGossip`, the training thread's API.
* :mod:`~lightning_gossip.async_gossip.phases`: :class:`PhaseClock`, which phase is open,
  ending, quiet.
* :mod:`~lightning_gossip.async_gossip.mailbox`: :class:`DeltaMailbox`, accumulated deltas, the
  ``delay_by_one`` buffer and the fresh-snapshot hand-off.
* :mod:`~lightning_gossip.async_gossip.cuda_handoff`: :class:`StreamHandoff`, CUDA events
  between the threads (no-ops on CPU).
* :mod:`~lightning_gossip.async_gossip.loops`: :class:`ActiveLoop` and :class:`PassiveLoop`,
  the gossip thread; :class:`MessageKind`, the control messages.
* :mod:`~lightning_gossip.async_gossip.state`: :class:`SharedState`, the one lock and what it
  guards, the waits; :class:`GossipStats`.

Example (inside an initialised process group)::

    engine = AsyncGossip(FlatState(model), rank, Pairing("ring", world), control, data,
                         timeout=timedelta(minutes=5))
    engine.start()
    dist.barrier()               # all ranks open a phase together
    for t, batch in enumerate(loader):
        engine.before_step(t)    # opens the phase (the first time)
        train_step(batch)
        engine.after_step(t)     # apply deltas, offer a snapshot, bound staleness
    engine.quiesce()             # network quiet: evaluate, checkpoint, average...
    engine.close()
"""

from __future__ import annotations

from lightning_gossip.async_gossip.cuda_handoff import StreamHandoff
from lightning_gossip.async_gossip.engine import AsyncGossip
from lightning_gossip.async_gossip.loops import ActiveLoop, GossipLoop, MessageKind, PassiveLoop
from lightning_gossip.async_gossip.mailbox import DeltaMailbox
from lightning_gossip.async_gossip.phases import PhaseClock
from lightning_gossip.async_gossip.state import GossipStats, SharedState

__all__ = ["ActiveLoop", "AsyncGossip", "DeltaMailbox", "GossipLoop", "GossipStats",
           "MessageKind", "PassiveLoop", "PhaseClock", "SharedState", "StreamHandoff"]
