"""One flat fp32 buffer over a model's parameters and floating-point buffers.

Gossip sends whole replicas, so it works on one contiguous vector instead of one message per
parameter. :class:`FlatState` knows which tensors of a module take part (parameters, and
floating-point buffers such as BatchNorm running statistics; integer buffers such as
``num_batches_tracked`` are left alone) and copies them into and out of fp32 vectors. Mixing
is always done in fp32, also for bf16/fp16 weights.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    >>> state = FlatState(model)
    >>> state.numel  # 3*2 + 2 weights/bias, 2 + 2 BatchNorm affine, 2 + 2 running stats
    16
    >>> x = state.pack()
    >>> state.add_(torch.ones_like(x))   # every mixed tensor += 1
    >>> torch.allclose(state.pack(), x + 1)
    True
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_gossip._compat import foreach_add_

__all__ = ["FlatState", "mixed_tensors"]


def mixed_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` for every tensor gossip mixes: parameters and floating buffers.

    Shared (tied) tensors appear once, under their first name.
    """
    out: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    for name, b in module.named_buffers():
        if b.is_floating_point() and id(b) not in seen:
            seen.add(id(b))
            out.append((name, b))
    return out


class FlatState:
    """Copies a module's mixed tensors into and out of one flat fp32 vector.

    Args:
        module: the model whose replica is gossiped. The set of tensors is fixed at
            construction; build a new one if the module's tensors are replaced.
    """

    def __init__(self, module: nn.Module) -> None:
        named = mixed_tensors(module)
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        if not self.tensors:
            raise ValueError("the model has no parameters or floating-point buffers to gossip")
        devices = {t.device for t in self.tensors}
        if len(devices) > 1:
            raise ValueError(
                f"gossip needs the whole replica on one device, found {sorted(map(str, devices))}"
            )
        self.device = self.tensors[0].device
        self.numels = [t.numel() for t in self.tensors]
        self.numel = sum(self.numels)
        self._all_fp32 = all(t.dtype == torch.float32 for t in self.tensors)

    # -- shapes ---------------------------------------------------------------------------------
    def empty(self) -> Tensor:
        """A new uninitialised fp32 vector of the right size on the model's device."""
        return torch.empty(self.numel, dtype=torch.float32, device=self.device)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Views of ``flat`` shaped like the module's tensors (no copy)."""
        return [v.view_as(t) for v, t in zip(flat.split(self.numels), self.tensors)]

    def signature(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, shape, dtype)`` per tensor: what must match on every rank."""
        return [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(self.names, self.tensors)]

    # -- copies ---------------------------------------------------------------------------------
    @torch.no_grad()
    def pack(self, out: Tensor | None = None) -> Tensor:
        """Copy the current values into ``out`` (or a new fp32 vector) and return it."""
        out = self.empty() if out is None else out
        if self._all_fp32:
            torch.cat([t.detach().reshape(-1) for t in self.tensors], out=out)
        else:
            for v, t in zip(out.split(self.numels), self.tensors):
                v.copy_(t.detach().reshape(-1))
        return out

    @torch.no_grad()
    def copy_(self, flat: Tensor) -> None:
        """Overwrite the module's tensors with ``flat``."""
        for t, v in zip(self.tensors, self.views(flat)):
            t.copy_(v)

    @torch.no_grad()
    def add_(self, flat: Tensor) -> None:
        """Add ``flat`` to the module's tensors (in their own dtype)."""
        if self._all_fp32:
            foreach_add_(self.tensors, self.views(flat))
        else:
            for t, v in zip(self.tensors, self.views(flat)):
                t.add_(v.to(t.dtype))
