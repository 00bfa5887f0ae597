"""Wire dtypes for synchronous gossip: what a rank sends, and how it is mixed without bias.

``DPSGDStrategy(wire_dtype="bf16")`` sends ``q_i = Q(x_i)``, the replica rounded to bf16 (half
the bytes of fp32), and mixes in the mean-preserving form

    ``x_i <- x_i + sum_j W_ij (q_j - q_i)``

where rank ``i`` uses the very ``q_i`` it sent. For a doubly stochastic ``W`` the changes of all
ranks sum to zero (``sum_ij W_ij q_j = sum_j q_j = sum_ij W_ij q_i``), so the mean of the
replicas is untouched up to fp32 rounding, however coarse ``Q`` is. Only differences of
quantized values move a replica, so replicas closer than about one rounding step of the wire
dtype stop moving towards each other: consensus reaches a floor of about ``(2^-9)^2`` (bf16)
in relative consensus distance rather than zero.

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

import torch
from torch import Tensor

__all__ = ["WIRE_DTYPES", "check_wire_dtype", "pairwise_delta", "quantize", "wire_bytes"]

#: the names ``wire_dtype=`` accepts, and the dtype each sends
WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def check_wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``wire_dtype`` name; ``ValueError`` naming the choices otherwise."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {tuple(WIRE_DTYPES)}, got {name!r}")
    return WIRE_DTYPES[name]


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
    peer ``j`` sent, with weight ``w_j = W_ij``.
    """
    out.zero_()
    if not theirs:
        return out
    mine32 = mine if mine.dtype == out.dtype else mine.to(out.dtype)
    scratch = torch.empty_like(out)
    for buf, w in theirs:
        scratch.copy_(buf).sub_(mine32)  # exact: a difference of two bf16/fp16 values fits fp32
        out.add_(scratch, alpha=w)
    return out


def wire_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of one message of ``numel`` values in ``dtype``."""
    return numel * torch.empty((), dtype=dtype).element_size()
