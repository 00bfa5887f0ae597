"""A passive rank's control messages: one receive posted per active rank that may still send
(:class:`ControlInbox`), not one receive from any source.

Why not from any source: gloo ends a receive from a *given* rank when the group's connections
close (a peer's process exits, or this process releases the group at exit:
:mod:`lightning_gossip.liveness.at_exit`), but never a receive from any source, whose
completion would then abort the process if it came during the interpreter's finalization.
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.errors import GossipTimeout
from lightning_gossip.liveness.at_exit import spawn

__all__ = ["ControlInbox"]


class ControlInbox:
    """The control receives a passive rank has posted, one per active rank, and the messages
    that came, in the order they came.

    Args:
        group: the gloo control group.
        timeout: limit of each receive (then :class:`GossipTimeout` naming its rank).
        rank: this rank (for names and messages).

    :meth:`post` a receive from each active that may still send; :attr:`arrived` is set while a
    message (or a failed receive) waits in the inbox; :meth:`take` the oldest. gloo's receives
    complete only inside ``Work.wait()``, so each posted receive is waited for by a helper
    thread of its own, tracked for the interpreter's exit.
    """

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta, rank: int) -> None:
        self.group, self.timeout, self.rank = group, timeout, rank
        self.arrived = threading.Event()
        self._lock = threading.Lock()
        self._came: deque[tuple[int, Tensor, BaseException | None]] = deque()
        self._posted: set[int] = set()

    def post(self, src: int) -> None:
        """Post a receive of one control message from ``src`` unless one is posted already."""
        if src in self._posted:
            return
        self._posted.add(src)
        buf = torch.zeros(2, dtype=torch.int64)
        work = dist.irecv(buf, src=src, group=self.group)
        spawn(self._wait, f"lightning-gossip-control-{self.rank}-from-{src}",
              groups=(self.group,), args=(src, buf, work))

    def _wait(self, src: int, buf: Tensor, work: dist.Work) -> None:
        error: BaseException | None = None
        what = f"rank {self.rank} receiving a gossip control message from rank {src}"
        try:
            if work.wait(self.timeout) is False:
                error = GossipTimeout(f"{what} did not complete within {self.timeout}", [src])
        except RuntimeError as e:  # the connection closed (the peer exited), or the timeout
            error = GossipTimeout(f"{what} failed: {e}", [src])
            error.__cause__ = e
        with self._lock:
            self._came.append((src, buf, error))
            self.arrived.set()

    def take(self) -> tuple[int, Tensor, BaseException | None] | None:
        """The oldest message that came: ``(sender, [kind, phase], error)`` (``error``: the
        receive failed; its rank has no receive posted any more), or ``None``."""
        with self._lock:
            if not self._came:
                self.arrived.clear()
                return None
            item = self._came.popleft()
            self._posted.discard(item[0])
            if not self._came:
                self.arrived.clear()
            return item
