"""The exchange rounds of :class:`~lightning_gossip.strategies.DPSGDStrategy`, as a mixin: start
an exchange with the neighbours (flat or sharded over the node), count it, and apply its delta
when it is due (``overlap``, ``delay_by_one``) or at once (blocking).

Rounds are finished off the training thread: a :class:`~lightning_gossip.exchange.CommWorker`
waits on the messages, checks them and mixes them into the round's own delta buffer while the
training thread computes, so the training thread's share of a step is one snapshot copy
(:meth:`FlatState.pack`, and for a sharded round the copy of its slice onto the wire, quantized
for a compressed ``wire_dtype``), and one add (:meth:`FlatState.add_`). With gloo the worker
also posts a flat round's messages (gloo's send starts writing on the calling thread); with
NCCL, and for sharded rounds, the training thread posts them.

Sharded rounds (:class:`~lightning_gossip.hierarchy.ShardedExchange`) are finished by the same
worker: the wait, the pairwise (mean-preserving) delta of this rank's slice, and with several
processes per node the all-gather of the slices. That all-gather runs on the node's second
group, :attr:`~lightning_gossip.hierarchy.NodeGroups.node_gossip`, which only the
communication thread uses: the training thread keeps the node group for the gradients and
buffers, so no group ever sees collectives from two threads. With NCCL (untested: no GPU in
the test suite) that group is its own communicator; as for flat rounds the worker's kernels go
to the device's default stream of its thread, the stream the training thread uses too (so
the snapshot is complete before the worker reads it, and the delta before the add). But NCCL
does not promise progress for two communicators driven from two threads in different orders
on different ranks, so with an NCCL node group the training thread issues the all-gather
itself (on the node group, right before the add) and the worker only waits and mixes.

Every round also carries a side message, the smallest "stop at step s" and "requeue at step s"
this rank knows of (SIGTERM, SLURM's auto-requeue signal: :mod:`.dpsgd_stop`), on the same group
and to the same peers; the worker waits for it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.exchange import CommWorker, Job, NeighborExchange
from lightning_gossip.hierarchy import ShardedExchange
from lightning_gossip.liveness import keep_alive_at_exit
from lightning_gossip.strategies.dpsgd_stop import NO_STOP as NO_STOP
from lightning_gossip.strategies.dpsgd_stop import _StopAgreementMixin, _StopMessages


@dataclass
class _Round:
    """One in-flight exchange: the step it belongs to, and its buffers."""

    step: int
    exchange: NeighborExchange | ShardedExchange
    delta: Tensor | None = None  # where the worker mixes (sharded: the snapshot, padded)
    stop: _StopMessages | None = None
    job: Job | None = None


class _RoundsMixin(_StopAgreementMixin):
    """Exchange-round bookkeeping of :class:`DPSGDStrategy`."""

    def _started(self, step: int) -> bool:
        return any(r.step == step for r in self._pending)

    # ------------------------------------------------------------------------------------------
    # Starting a round (training thread): the snapshot copy, then post
    # ------------------------------------------------------------------------------------------
    def _start(self, step: int) -> _Round:
        assert self._flat is not None and self.topology is not None and self._group is not None
        if self.sharded:
            return self._start_sharded(step)
        peers = self.topology.peers(self.global_rank, step)
        bufs = self._spare.pop() if self._spare else [self._flat.empty(), self._flat.empty()]
        send = self._flat.pack(out=bufs[0])
        exchange = NeighborExchange(send, peers, self._group, recv_buffers=bufs[2:],
                                    post_now=self._post_on_training_thread)
        self._count(exchange)
        rnd = _Round(step, exchange, delta=bufs[1], stop=self._post_stop(step))
        rnd.job = self._comm().submit(lambda: self._finish_round(rnd), exchange.others,
                                      exchange.describe(step))
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
        snapshot = bufs[0]  # a recycled one holds an earlier round's delta: pack, zero the pad
        self._flat.pack(out=snapshot[: self._flat.numel])
        snapshot[self._flat.numel:].zero_()
        exchange = ShardedExchange(snapshot, self.layout,
                                   self.topology.peers(self.layout.node, step), self._groups,
                                   self._wire, buffers=bufs[1:])
        self._count(exchange.exchange)
        # the worker writes the delta over the snapshot (dead once the slice is on the wire)
        rnd = _Round(step, exchange, delta=snapshot, stop=self._post_stop(step))
        rnd.job = self._comm().submit(lambda: self._finish_sharded(rnd), exchange.others,
                                      exchange.describe(step))
        if self.overlap:
            self._pending.append(rnd)
        return rnd

    @property
    def _post_on_training_thread(self) -> bool:
        """Whether a flat round's replica messages are posted by the training thread: with
        NCCL (the send must be ordered on the training thread's CUDA stream, untested); with
        gloo the communication thread posts them (gloo's send writes to the socket on the
        calling thread: about 3 ms of a 42 MB step on this machine). Rounds are posted in
        order either way: the worker runs its jobs first in, first out."""
        assert self._group is not None
        return dist.get_backend(self._group) == "nccl"

    def _gather_on_worker(self) -> bool:
        """Whether the worker all-gathers a sharded round's slices (not with NCCL: see the
        module docstring); one process per node has nothing to gather."""
        assert self._groups is not None
        return self._groups.node_gossip is not None

    def _comm(self) -> CommWorker:
        if self._worker is None or not self._worker.alive:
            self._worker = CommWorker(name=f"lightning-gossip-comm-{self.global_rank}")
        return self._worker

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

    # ------------------------------------------------------------------------------------------
    # Finishing a flat round (communication thread): wait, check, mix into the round's delta
    # ------------------------------------------------------------------------------------------
    def _finish_round(self, rnd: _Round) -> None:
        """Wait for the round's messages (plainly: :meth:`Job.result` watches the peers),
        check them, and mix: ``delta = W_t x_t - x_t`` (overlap) or ``W_t x'_t`` (blocking)."""
        ex = rnd.exchange
        assert isinstance(ex, NeighborExchange) and rnd.delta is not None
        ex.wait(self.timeout, step=rnd.step, watch_peers=False, check=False)  # posts first
        self._merge_stop(rnd, watch_peers=False)
        ex.check_mixed(ex.mixed(out=rnd.delta, delta=self.overlap))

    def _finish_sharded(self, rnd: _Round) -> None:
        """Wait for a sharded round's messages (plainly, as :meth:`_finish_round`), then
        ``delta = sum_j W_ij (x_j - x_i)`` over the node replica, written over the snapshot:
        this rank's slice, and the all-gather on the worker's own node group."""
        ex = rnd.exchange
        assert isinstance(ex, ShardedExchange) and rnd.delta is not None
        ex.delta(self.timeout, rnd.step, out=rnd.delta, watch_peers=False,
                 gather=self._gather_on_worker())
        self._merge_stop(rnd, watch_peers=False)

    def _collect(self, rnd: _Round) -> Tensor:
        """The training thread's wait for a round: its mixed result (flat), or its delta
        (sharded, unpadded)."""
        assert rnd.job is not None and rnd.delta is not None and self._flat is not None
        ex = rnd.exchange
        if not isinstance(ex, ShardedExchange):
            rnd.job.result(self.timeout, self.heartbeat)
            return rnd.delta
        try:
            rnd.job.result(self.timeout, self.heartbeat)
        except BaseException:
            if self._gather_on_worker():  # the worker may be in the all-gather: keep its group
                assert self._groups is not None
                keep_alive_at_exit(self._groups.node_gossip)
            raise
        if self.layout is not None and self.layout.devices > 1 and not self._gather_on_worker():
            size = ex.shard.numel()
            mine = rnd.delta[self.layout.local * size:(self.layout.local + 1) * size]
            self._node_all_gather(mine.clone(), rnd.delta)  # NCCL: the training thread's
        return rnd.delta[: self._flat.numel]

    def _recycle(self, rnd: _Round) -> None:
        """Keep the buffers of a collected round (its job is done) for a later one."""
        ex = rnd.exchange
        if isinstance(ex, ShardedExchange):
            self._spare.append([ex.snapshot, *ex.buffers])
        else:
            assert rnd.delta is not None
            self._spare.append([ex.send, rnd.delta] + [b for _, b in ex.recv])

    def _apply_delta(self, rnd: _Round) -> None:
        """``x <- x + (W_t x_t - x_t)``: add the mixing's change to the current weights."""
        assert self._flat is not None
        self._flat.add_(self._collect(rnd))
        self._recycle(rnd)

    def _finish_blocking(self, rnd: _Round) -> None:
        """``x <- W_t x'``: replace the weights by the mixed ones."""
        assert self._flat is not None
        if isinstance(rnd.exchange, ShardedExchange):  # x' + sum_j W_ij (x'_j - x'_i)
            self._apply_delta(rnd)
            return
        self._flat.copy_(self._collect(rnd))
        self._recycle(rnd)
