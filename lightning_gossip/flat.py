"""One flat fp32 vector over a model's parameters and floating-point buffers.

Gossip sends whole replicas, so it works on one contiguous vector instead of one message per
parameter. :class:`FlatState` knows which tensors of a module take part (parameters, and
floating-point buffers such as BatchNorm running statistics; integer buffers such as
``num_batches_tracked`` are left alone) and copies them into and out of fp32 vectors. Mixing
is always done in fp32, also for bf16/fp16 weights.

:func:`flatten_module_` goes one step further (flat storage): it moves those tensors' data into
one contiguous buffer per dtype, so that each tensor is a view of it. The tensor objects stay
the same (``tensor.data`` is re-pointed), so optimizers and other references keep working.
A :class:`FlatState` built over a flattened module then packs with one copy and adds or
overwrites with one in-place op per buffer instead of one per tensor; the values are the same.

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
    >>> flatten_module_(model)  # one fp32 buffer: the tensors become views of it
    1
    >>> state = FlatState(model)
    >>> state.is_flat, len(state.segments)
    (True, 1)
    >>> torch.equal(state.pack(), x + 1)  # same values, now one copy
    True
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lightning_gossip._compat import foreach_add_

__all__ = ["FlatState", "Segment", "flatten_module_", "mixed_tensors"]

#: dtypes that widen to fp32 exactly: ``target + plus`` into fp32 = ``fp32(target) + plus``
_WIDEN_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)


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


class Segment(NamedTuple):
    """A stretch ``[lo, hi)`` of the flat vector and the memory it mirrors: ``target`` is a 1-D
    view of a flat-storage buffer over consecutive tensors, or one tensor on its own."""

    lo: int
    hi: int
    target: Tensor


def _storage_ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _segments(tensors: list[Tensor], numels: list[int]) -> list[Segment]:
    """Group consecutive tensors that lie back to back in one storage (same dtype, contiguous)
    into one segment each; any other tensor is a segment of its own."""
    segs: list[Segment] = []
    lo = 0
    run: list[Tensor] = []
    run_lo = 0

    def close() -> None:
        if not run:
            return
        hi = run_lo + sum(t.numel() for t in run)
        if len(run) == 1:
            segs.append(Segment(run_lo, hi, run[0]))
        else:
            first = run[0]
            base = first.detach()
            target = base.new_empty(0).set_(base.untyped_storage(), first.storage_offset(),
                                            (hi - run_lo,), (1,))
            segs.append(Segment(run_lo, hi, target))
        run.clear()

    for t, n in zip(tensors, numels):
        if run:
            prev = run[-1]
            follows = (t.is_contiguous() and prev.is_contiguous() and t.dtype == prev.dtype
                       and t.device == prev.device and _storage_ptr(t) == _storage_ptr(prev)
                       and t.storage_offset() == prev.storage_offset() + prev.numel())
            if not follows:
                close()
        if not run:
            run_lo = lo
        run.append(t)
        lo += n
    close()
    return segs


class FlatState:
    """Copies a module's mixed tensors into and out of one flat fp32 vector.

    With flat storage (:func:`flatten_module_`, done by the gossip strategies at set-up) the
    tensors are views of one buffer per dtype: :meth:`pack` is then one copy, :meth:`add_` and
    :meth:`copy_` one in-place op per buffer. Without it, or when that layout was lost (the
    module moved with ``model.to(...)`` or a ``tensor.data`` re-assigned after
    construction), every method works tensor by tensor, with the same results.

    Args:
        module: the model whose replica is gossiped. The set of tensors is fixed at
            construction; build a new one if the module's tensors are replaced (a buffer
            re-assigned with ``module.name = new_tensor`` is not seen by an existing one).
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
        #: the stretches of the flat vector and the memory each mirrors (see :class:`Segment`)
        self.segments = _segments(self.tensors, self.numels)
        self._ptrs = [t.data_ptr() for t in self.tensors]
        self._warned = False

    # -- layout ---------------------------------------------------------------------------------
    @property
    def is_flat(self) -> bool:
        """Whether the tensors were found coalesced into flat storage (fewer segments than
        tensors, or one tensor in all) when this state was built."""
        return len(self.segments) < len(self.tensors) or len(self.tensors) == 1

    def _fast(self) -> bool:
        """Whether to work per segment: flat storage that is still in place."""
        if not self.is_flat:
            return False
        if all(t.data_ptr() == p for t, p in zip(self.tensors, self._ptrs)):
            return True
        if not self._warned:
            self._warned = True
            warnings.warn(
                "the model's tensors no longer lie in the flat storage set up by the gossip "
                "strategy (moved with model.to(...) or tensor.data re-assigned after set-up): "
                "gossip falls back to per-tensor copies (same values, slower)",
                stacklevel=3,
            )
        self.segments = [Segment(lo, lo + n, t) for lo, n, t in
                         zip(self._offsets(), self.numels, self.tensors)]
        self._ptrs = [t.data_ptr() for t in self.tensors]
        return False

    def _offsets(self) -> list[int]:
        out, lo = [], 0
        for n in self.numels:
            out.append(lo)
            lo += n
        return out

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
    def pack(self, out: Tensor | None = None, plus: Tensor | None = None) -> Tensor:
        """Copy the current values into ``out`` (or a new fp32 vector) and return it.

        ``plus``: an fp32 vector (not ``out``) to add on the way. The values are those of
        ``pack(out).add_(plus)``, bit for bit; with flat storage it is one pass per buffer
        (``out = target + plus``) instead of a copy and an add.
        """
        out = self.empty() if out is None else out
        if self._fast():
            for s in self.segments:
                dst = out[s.lo:s.hi].view(s.target.shape)
                if plus is None:
                    dst.copy_(s.target)
                elif s.target.dtype in _WIDEN_EXACTLY:  # computed in fp32, as copy_ + add_
                    torch.add(s.target, plus[s.lo:s.hi].view(s.target.shape), out=dst)
                else:  # fp64 would be added before rounding to fp32
                    dst.copy_(s.target).add_(plus[s.lo:s.hi].view(s.target.shape))
            return out
        if self._all_fp32:
            torch.cat([t.detach().reshape(-1) for t in self.tensors], out=out)
        else:
            for v, t in zip(out.split(self.numels), self.tensors):
                v.copy_(t.detach().reshape(-1))
        if plus is not None:
            out.add_(plus)
        return out

    @torch.no_grad()
    def copy_(self, flat: Tensor) -> None:
        """Overwrite the module's tensors with ``flat``."""
        if self._fast():
            for s in self.segments:
                s.target.copy_(flat[s.lo:s.hi].view(s.target.shape))
            return
        for t, v in zip(self.tensors, self.views(flat)):
            t.copy_(v)

    @torch.no_grad()
    def add_(self, flat: Tensor) -> None:
        """Add ``flat`` to the module's tensors (in their own dtype)."""
        if self._fast():
            for s in self.segments:
                s.target.add_(flat[s.lo:s.hi].view(s.target.shape).to(s.target.dtype))
        elif self._all_fp32:
            foreach_add_(self.tensors, self.views(flat))
        else:
            for t, v in zip(self.tensors, self.views(flat)):
                t.add_(v.to(t.dtype))


def _overlapping(tensors: list[Tensor]) -> set[int]:
    """``id`` of every tensor whose memory overlaps another's (views of one another)."""
    spans = sorted(
        (_storage_ptr(t), t.storage_offset() * t.element_size(),
         (t.storage_offset() + t.numel()) * t.element_size(), id(t))
        for t in tensors if t.numel() and t.is_contiguous()
    )
    out: set[int] = set()
    ptr, end, owner = None, 0, 0  # the span reaching furthest so far in this storage
    for p, start, stop, ident in spans:
        if p == ptr and start < end:
            out.update((owner, ident))
        if p != ptr or stop > end:
            ptr, end, owner = p, stop, ident
    return out


@torch.no_grad()
def flatten_module_(module: nn.Module) -> int:
    """Move ``module``'s mixed tensors (:func:`mixed_tensors`) into one contiguous buffer per
    dtype and device, each tensor becoming a view of it; return how many buffers hold them.

    The tensor objects are kept (their ``.data`` is re-pointed), so build the optimizers
    afterwards or before: both see the same ``Parameter`` objects. Values, shapes, names and
    ``state_dict`` keys do not change; integer buffers are left alone. Tensors that are not
    contiguous (e.g. channels-last weights) and tensors sharing memory with another mixed tensor
    keep their own memory. Calling it again on a flattened module changes nothing.

    Limits: ``module.to(...)`` to another device or dtype afterwards, or ``tensor.data = ...``,
    gives those tensors new memory (a :class:`FlatState` notices and falls back to per-tensor
    copies); a buffer re-assigned as a new tensor (``module.name = new``) lives outside the
    buffer and is not seen by a :class:`FlatState` built before.
    """
    tensors = [t for _, t in mixed_tensors(module)]
    numels = [t.numel() for t in tensors]
    if not tensors:
        return 0
    dtypes = {(t.dtype, t.device) for t in tensors}
    if len(_segments(tensors, numels)) <= len(dtypes):
        return len(dtypes)  # already flat
    shared = _overlapping(tensors)
    movable = [t for t in tensors if t.is_contiguous() and id(t) not in shared]
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in movable:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), members in groups.items():
        buffer = torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)
        lo = 0
        for t in members:
            view = buffer[lo:lo + t.numel()].view(t.shape)
            view.copy_(t.detach())
            t.data = view
            lo += t.numel()
    return len(groups)
