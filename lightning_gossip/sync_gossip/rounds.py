"""One synchronous round in flight, and the buffers rounds reuse.

A round is started on the training thread (the snapshot copy, then the posts) and finished on
the engine's :class:`~lightning_gossip.exchange.CommWorker` (wait, check, mix into the round's
own delta buffer); the training thread then adds that delta (:meth:`FlatState.add_`) or copies
the mixed replica in (blocking rounds). :class:`RoundCounters` is what rounds sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lightning_gossip.exchange import Job, NeighborExchange
from lightning_gossip.sync_gossip.sharded import ShardedExchange
from lightning_gossip.sync_gossip.stop import StopMessages

__all__ = ["Round", "SyncStats"]


@dataclass
class Round:
    """One in-flight exchange: the step it belongs to, and its buffers."""

    step: int
    exchange: NeighborExchange | ShardedExchange
    delta: Tensor | None = None  # where the worker mixes (sharded: the snapshot, padded)
    stop: StopMessages | None = None
    job: Job | None = None
    #: seconds of its exchange (the worker's, from the moment every peer had posted the round
    #: to the mixed data; plus the training thread's node all-gather), written by the worker
    #: before its job is done
    exchange_s: float = 0.0
    #: seconds the worker waited before that for peers that posted the round later (their
    #: compute, not the link's)
    peer_wait_s: float = 0.0

    def timed(self, started: float, ready: float, done: float) -> None:
        """The worker's times (``time.perf_counter()``): it started on the round at
        ``started``, every peer had posted it at ``ready``, the mixed data was there at
        ``done``."""
        self.peer_wait_s = max(ready - started, 0.0)
        self.exchange_s = max(done - max(ready, started), 0.0)

    def buffers(self) -> list[Tensor]:
        """The round's buffers, to be reused by a later round once its job is done:
        ``[snapshot, wire...]`` (sharded) or ``[send, delta, recv...]`` (flat)."""
        ex = self.exchange
        if isinstance(ex, ShardedExchange):
            return [ex.snapshot, *ex.buffers]
        assert self.delta is not None
        return [ex.send, self.delta] + [b for _, b in ex.recv]


@dataclass
class SyncStats:
    """What one rank's synchronous gossip sent (this process): ``sent_bytes`` (payload of the
    replica messages, without the node's all-reduce and all-gather), ``messages`` and
    ``exchanges`` (rounds started); ``exchange_seconds`` and ``exchanges_timed``, the summed
    wire time of the rounds applied so far and their number (each round's time from the moment
    every peer had posted it to holding every peer's data, mixed, with a sharded round's node
    all-gather; written by the training thread as it applies a round); ``peer_wait_seconds``,
    the summed waits before that for peers that posted their rounds later."""

    sent_bytes: int = 0
    messages: int = 0
    exchanges: int = 0
    exchange_seconds: float = 0.0
    exchanges_timed: int = 0
    peer_wait_seconds: float = 0.0

    def timed(self, seconds: float, peer_wait: float = 0.0) -> None:
        """Count one applied round's exchange time (and its wait for late peers)."""
        self.exchange_seconds += seconds
        self.peer_wait_seconds += peer_wait
        self.exchanges_timed += 1

    def count(self, exchange: NeighborExchange) -> None:
        """Count a round's replica messages (the ones this rank sends)."""
        sends = len(exchange.peers.send_to)
        self.exchanges += 1
        self.messages += sends
        self.sent_bytes += sends * exchange.send.numel() * exchange.send.element_size()

    def as_dict(self) -> dict[str, float]:
        """The counters as floats (what the strategies log)."""
        return {"sent_bytes": float(self.sent_bytes), "messages": float(self.messages),
                "exchanges": float(self.exchanges),
                "exchange_seconds": float(self.exchange_seconds),
                "exchanges_timed": float(self.exchanges_timed),
                "peer_wait_seconds": float(self.peer_wait_seconds)}
