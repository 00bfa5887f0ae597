"""The exchange rounds of :class:`~lightning_gossip.strategies.DPSGDStrategy`, as a mixin: start
an exchange with the neighbours (flat or sharded over the node), count it, and apply its delta
when it is due (``overlap``, ``delay_by_one``) or at once (blocking)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gossip.exchange import NeighborExchange
from lightning_gossip.hierarchy import ShardedExchange


@dataclass
class _Round:
    """One in-flight exchange: the step it belongs to, and its buffers."""

    step: int
    exchange: NeighborExchange | ShardedExchange


class _RoundsMixin:
    """Exchange-round bookkeeping of :class:`DPSGDStrategy`."""

    def _started(self, step: int) -> bool:
        return any(r.step == step for r in self._pending)

    def _start(self, step: int) -> _Round:
        assert self._flat is not None and self.topology is not None and self._group is not None
        if self.sharded:
            return self._start_sharded(step)
        peers = self.topology.peers(self.global_rank, step)
        bufs = self._spare.pop() if self._spare else [self._flat.empty()]
        send = self._flat.pack(out=bufs[0])
        exchange = NeighborExchange(send, peers, self._group, recv_buffers=bufs[1:])
        self._count(exchange)
        rnd = _Round(step, exchange)
        if self.overlap:
            self._pending.append(rnd)
        return rnd

    def _padded(self) -> Tensor:
        """A zeroed fp32 vector of ``devices * shard`` values (the replica, zero-padded)."""
        assert self._flat is not None and self.layout is not None
        size = self.layout.devices * self.layout.shard_size(self._flat.numel)
        return torch.zeros(size, dtype=torch.float32, device=self._flat.device)

    def _start_sharded(self, step: int) -> _Round:
        assert self._flat is not None and self.topology is not None
        assert self.layout is not None and self._groups is not None
        bufs = self._spare.pop() if self._spare else [self._padded()]
        snapshot = bufs[0]
        self._flat.pack(out=snapshot[: self._flat.numel])
        exchange = ShardedExchange(snapshot, self.layout,
                                   self.topology.peers(self.layout.node, step), self._groups,
                                   self._wire, buffers=bufs[1:])
        self._count(exchange.exchange)
        rnd = _Round(step, exchange)
        if self.overlap:
            self._pending.append(rnd)
        return rnd

    def _count(self, exchange: NeighborExchange) -> None:
        sends = len(exchange.peers.send_to)
        self._exchanges += 1
        self._messages += sends
        self._sent_bytes += sends * exchange.send.numel() * exchange.send.element_size()

    @property
    def gossip_stats(self) -> dict[str, float]:
        """What this rank's gossip sent so far (this process): ``sent_bytes`` (payload of the
        replica messages, without the node's all-reduce and all-gather), ``messages`` and
        ``exchanges`` (rounds started)."""
        return {"sent_bytes": float(self._sent_bytes), "messages": float(self._messages),
                "exchanges": float(self._exchanges)}

    def _recycle(self, rnd: _Round) -> None:
        ex = rnd.exchange
        if isinstance(ex, ShardedExchange):
            self._spare.append([ex.snapshot, *ex.buffers])
        else:
            self._spare.append([ex.send] + [b for _, b in ex.recv])

    def _sharded_delta(self, rnd: _Round) -> Tensor:
        """``sum_j W_ij (x_j - x_i)`` of the round (the node's, all-gathered), unpadded."""
        assert self._flat is not None and isinstance(rnd.exchange, ShardedExchange)
        if self._scratch is None:
            self._scratch = self._padded()
        delta = rnd.exchange.delta(self.timeout, rnd.step, out=self._scratch)
        return delta[: self._flat.numel]

    def _apply_delta(self, rnd: _Round) -> None:
        """``x <- x + (W_t x_t - x_t)``: add the mixing's change to the current weights."""
        assert self._flat is not None
        if isinstance(rnd.exchange, ShardedExchange):
            self._flat.add_(self._sharded_delta(rnd))
            self._recycle(rnd)
            return
        rnd.exchange.wait(self.timeout, step=rnd.step)
        delta = rnd.exchange.mixed(out=self._mix_buffer())
        delta.sub_(rnd.exchange.send)
        self._flat.add_(delta)
        self._recycle(rnd)

    def _finish_blocking(self, rnd: _Round) -> None:
        """``x <- W_t x'``: replace the weights by the mixed ones."""
        assert self._flat is not None
        if isinstance(rnd.exchange, ShardedExchange):  # x' + sum_j W_ij (x'_j - x'_i)
            self._apply_delta(rnd)
            return
        rnd.exchange.wait(self.timeout, step=rnd.step)
        self._flat.copy_(rnd.exchange.mixed(out=self._mix_buffer()))
        self._recycle(rnd)

    def _mix_buffer(self) -> Tensor:
        assert self._flat is not None
        if self._scratch is None:
            self._scratch = self._flat.empty()
        return self._scratch
