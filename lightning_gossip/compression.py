"""Wire dtypes for gossip: what a rank sends, and how it is mixed without bias
(:func:`pairwise_delta`, the one mean-preserving delta of both engines).

``DPSGDStrategy(wire_dtype="bf16")`` sends ``q_i = Q(x_i)``, the replica rounded to bf16 (half
the bytes of fp32), and mixes in the mean-preserving form

    ``x_i <- x_i + sum_j W_ij (q_j - q_i)``

where rank ``i`` uses the very ``q_i`` it sent. For a doubly stochastic ``W`` the changes of all
ranks sum to zero (``sum_ij W_ij q_j = sum_j q_j = sum_ij W_ij q_i``), so the mean of the
replicas is untouched up to fp32 rounding, however coarse ``Q`` is. Only differences of
quantized values move a replica, so replicas closer than about one rounding step of the wire
dtype stop moving towards each other: consensus reaches a floor of about ``(2^-9)^2`` (bf16)
in relative consensus distance rather than zero.

AD-PSGD's pairwise average is the same step with one peer and ``W_ij = 1/2``: each partner adds
``(q_j - q_i) / 2`` with the ``q`` it sent (``q = x`` in fp32), and the two changes cancel
exactly (``fl(a - b) = -fl(b - a)``).

Example::

    >>> import torch
    >>> check_wire_dtype("bf16")
    torch.bfloat16
    >>> q = quantize(torch.tensor([1.0, 1.001, 70000.0]), torch.float16)
    >>> q.dtype, float(q[2])  # fp16 saturates instead of overflowing to inf
    (torch.float16, 65504.0)
    >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    >>> pairwise_delta(a, [(b, 0.5)], out=torch.empty(2)).tolist()  # 0.5 * (b - a)
    [1.0, 1.5]
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["WIRE_DTYPES", "WireDtype", "check_wire_dtype", "pairwise_delta", "quantize",
           "wire_bytes"]

#: a ``wire_dtype=`` name
WireDtype = Literal["fp32", "bf16", "fp16"]

#: the names ``wire_dtype=`` accepts, and the dtype each sends
WIRE_DTYPES: dict[WireDtype, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def check_wire_dtype(name: WireDtype | str) -> torch.dtype:
    """The torch dtype of a ``wire_dtype`` name; ``ValueError`` naming the choices otherwise."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {tuple(WIRE_DTYPES)}, got {name!r}")
    return WIRE_DTYPES[name]  # type: ignore[index]  # a WireDtype once checked


def quantize(x: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """``x`` rounded to ``dtype`` (round to nearest); fp16 saturates at its largest finite value."""
    if dtype == torch.float16:
        big = torch.finfo(torch.float16).max
        x = x.clamp(-big, big)
    if out is None:
        return x.to(dtype)
    return out.copy_(x)


def pairwise_delta(mine: Tensor, theirs: list[tuple[Tensor, float]], out: Tensor) -> Tensor:
    """``sum_j w_j (theirs_j - mine)`` in fp32 into ``out``: the mean-preserving mixing step.

    ``mine`` is what this rank sent (the same values its peers mix in), each ``theirs_j`` what
    peer ``j`` sent, with weight ``w_j = W_ij``. Both engines mix with it: ``SyncGossip``'s
    sharded rounds, and ``AsyncGossip``'s pairwise average (one peer, ``w = 1/2``; there
    ``out`` is written in place, with no scratch buffer).
    """
    if not theirs:
        return out.zero_()
    # exact: a difference of two bf16/fp16 values fits fp32; in fp32 fl(a - b) = -fl(b - a)
    (first, w), rest = theirs[0], theirs[1:]
    if first.dtype == mine.dtype == out.dtype:
        torch.sub(first, mine, out=out)  # one pass (AD-PSGD's fp32 exchange, every time)
    else:  # widen first: a bf16 - bf16 subtraction would round to bf16
        out.copy_(first).sub_(mine)
    out.mul_(w)
    if rest:
        scratch = torch.empty_like(out)
        for buf, w in rest:
            scratch.copy_(buf).sub_(mine)
            out.add_(scratch, alpha=w)
    return out


def wire_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of one message of ``numel`` values in ``dtype``."""
    return numel * torch.empty((), dtype=dtype).element_size()
