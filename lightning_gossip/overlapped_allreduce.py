"""A gradient all-reduce overlapped with backward: buckets of gradients launched from gradient
hooks as backward produces them, the way ``DistributedDataParallel`` does, waited for before the
optimizer step (hierarchical gossip's ``node_allreduce="overlapped"``).

The parameters are split into buckets of about ``bucket_bytes`` of fp32, in reverse order
(backward produces the last layers' gradients first). While :meth:`OverlappedAllReduce.run`
runs a closure (forward and backward), a hook on every parameter marks its gradient ready; a
bucket whose gradients are all ready is packed (fp32, plus one "has a gradient" flag per
parameter) and its all-reduce started, in bucket order only, so every rank starts the same
collectives in the same order. After the closure the buckets not yet started (a parameter
without a gradient on this rank, or a backward that ran before the closure, as in manual
optimization) start, every one is waited for, and the sums divided by ``divisor`` go back into
the gradients. The values are those of one flat all-reduce of every gradient after backward
(:meth:`~lightning_gossip.node_averaging.NodeAverager.average_gradients`): the same
packing, the same per-element sums (bit for bit where the backend sums each element in the same
order whatever the message size, e.g. two ranks), the same treatment of missing gradients.

Torch only: the collective is ``launch`` (returns a waitable work) and ``wait``; no Lightning.

    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> sums = []
    >>> def launch(flat):  # a one-rank "all-reduce": the sum is the value itself
    ...     sums.append(flat.numel())
    ...     return None
    >>> avg = OverlappedAllReduce(list(lin.parameters()), divisor=1, launch=launch,
    ...                           wait=lambda works: None, bucket_bytes=8)
    >>> _ = avg.run(lambda: lin(torch.ones(1, 3)).sum().backward())
    >>> sums  # bias (2 values + 1 flag) then weight (6 + 1), started during backward
    [3, 7]
    >>> lin.bias.grad
    tensor([1., 1.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["DEFAULT_BUCKET_BYTES", "NodeAllreduce", "OverlappedAllReduce", "plan_buckets"]

#: ``node_allreduce=`` of the strategies: after backward (one flat all-reduce), or in buckets
#: started from gradient hooks during backward (:class:`OverlappedAllReduce`)
NodeAllreduce = Literal["after_backward", "overlapped"]

#: the default bucket size (fp32 bytes): small enough that several buckets hide behind the
#: backward of a model of a few MB, large enough that each message is not latency-bound
DEFAULT_BUCKET_BYTES = 1 << 20


def plan_buckets(numels: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors in buckets of at least ``bucket_bytes`` (fp32) each (the last may
    be smaller), in reverse order: the last tensor first.

    >>> plan_buckets([4, 4, 100, 4], bucket_bytes=32)
    [[3, 2], [1, 0]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        current.append(i)
        size += 4 * numels[i]
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class OverlappedAllReduce:
    """The average of the gradients of ``params`` over the ranks, overlapped with backward.

    Args:
        params: the parameters (the same ones, in the same order, on every rank).
        divisor: the sums are divided by this (the number of ranks).
        launch: starts the sum of a flat fp32 tensor in place over the ranks; returns what
            ``wait`` waits for.
        wait: waits for a list of what ``launch`` returned (with the caller's timeout and
            liveness checks).
        bucket_bytes: the bucket size (:func:`plan_buckets`); default
            :data:`DEFAULT_BUCKET_BYTES` (read when built).
    """

    def __init__(self, params: Sequence[Tensor], divisor: int, launch: Callable[[Tensor], Any],
                 wait: Callable[[list[Any]], None], bucket_bytes: int | None = None) -> None:
        self.params = list(params)
        self.divisor = divisor
        self.launch = launch
        self.wait = wait
        self.buckets = plan_buckets([p.numel() for p in self.params],
                                    bucket_bytes or DEFAULT_BUCKET_BYTES)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        #: buckets started from a gradient hook (during backward) in the last :meth:`run`
        self.started_in_backward = 0
        self._reset()

    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._missing = [len(idx) for idx in self.buckets]
        self._next = 0
        self._pending: list[tuple[int, Tensor, Any]] = []

    def run(self, closure: Callable[[], Any]) -> Any:
        """Run ``closure`` (forward and backward) with the hooks on, then finish the average;
        returns what ``closure`` returned."""
        self._reset()
        self.started_in_backward = 0
        handles = [p.register_post_accumulate_grad_hook(self._on_ready) for p in self.params]
        try:
            result = closure()
        finally:
            for h in handles:
                h.remove()
        self._finish()
        return result

    def _on_ready(self, param: Tensor) -> None:
        i = self._index[id(param)]
        if self._ready[i]:
            raise RuntimeError(
                "node_allreduce='overlapped': a parameter's gradient was accumulated twice in "
                "one optimizer step's closure (two backward passes); its bucket was already "
                "sent. Use node_allreduce='after_backward'.")
        self._ready[i] = True
        self._missing[self._bucket_of[i]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._start(self._next)
            self.started_in_backward += 1

    @torch.no_grad()
    def _start(self, b: int) -> None:
        """Pack bucket ``b`` (zeros and flag 0 for a parameter without a gradient) and start
        its sum; buckets start in order only."""
        assert b == self._next
        params = [self.params[i] for i in self.buckets[b]]
        grads = [p.grad for p in params]
        device = params[0].device
        flat = torch.cat([
            g.detach().reshape(-1).float() if g is not None
            else torch.zeros(p.numel(), device=device)
            for p, g in zip(params, grads)
        ] + [torch.tensor([float(g is not None) for g in grads], device=device)])
        self._pending.append((b, flat, self.launch(flat)))
        self._next = b + 1

    @torch.no_grad()
    def _finish(self) -> None:
        while self._next < len(self.buckets):
            self._start(self._next)
        pending, self._pending = self._pending, []
        self.wait([work for _, _, work in pending])
        for b, flat, _ in pending:
            params = [self.params[i] for i in self.buckets[b]]
            flat.div_(self.divisor)
            *values, present = flat.split([p.numel() for p in params] + [len(params)])
            for p, v, has in zip(params, values, present.tolist()):
                g = p.grad
                if g is None and has > 0:
                    p.grad = g = torch.zeros_like(p)
                if g is not None:
                    g.copy_(v.view_as(g))
