"""An outer optimizer on the periodic global average (SlowMo, Wang et al. 2020; DiLoCo,
Douillard et al. 2023): momentum over the moves of the exact average.

Every ``global_average_every_n_steps`` the gossip strategies replace each replica by the exact
average ``x_avg`` of all replicas. With an :class:`OuterOptimizer` the replicas go instead to a
point computed from the *anchor* ``x_prev`` (where every replica was set at the previous global
average, kept in fp32 and the same on every rank) and ``x_avg``::

    delta = x_prev - x_avg                     # the outer "gradient"
    m     = momentum * m + delta               # the momentum buffer
    x_new = x_prev - lr * (delta + momentum * m)   # nesterov=True
    x_new = x_prev - lr * m                        # nesterov=False

and ``x_new`` becomes the next anchor. It is computed as ``x_avg - (lr * step - delta)``, so
that ``lr=1, momentum=0`` returns ``x_avg`` bit for bit (``delta - delta`` is an exact zero).
Torch tensors only: no process group, no Lightning.

    >>> import torch
    >>> outer = OuterOptimizer(lr=1.0, momentum=0.0)
    >>> outer.start(torch.tensor([0.0, 0.0]))
    >>> outer.step(torch.tensor([1.0, -2.0]))      # the plain average
    tensor([ 1., -2.])
    >>> outer = OuterOptimizer(lr=0.5, momentum=0.5, nesterov=False)
    >>> outer.start(torch.tensor([0.0]))
    >>> outer.step(torch.tensor([2.0]))            # m = -2: 0 - 0.5 * -2
    tensor([1.])
    >>> outer.step(torch.tensor([1.0]))            # m = 0.5 * -2 + 0 = -1: 1 - 0.5 * -1
    tensor([1.5000])
    >>> OuterOptimizer(lr=0.0)
    Traceback (most recent call last):
    ...
    ValueError: outer_lr must be a positive finite number, got 0.0
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["CHECKPOINT_KEY", "OuterOptimizer", "check_outer"]

#: where a checkpoint holds the outer optimizer's :meth:`~OuterOptimizer.state_dict`
CHECKPOINT_KEY = "lightning_gossip_outer_optimizer"


class OuterOptimizer:
    """SGD with (Nesterov) momentum whose gradient is the move of the global average.

    Args:
        lr: the outer learning rate (positive; 1 with ``momentum=0`` is the plain average).
        momentum: the momentum ``beta`` in ``[0, 1)``.
        nesterov: Nesterov momentum (``x_prev - lr * (delta + beta * m)``) or heavy ball
            (``x_prev - lr * m``).
    """

    #: where a checkpoint holds :meth:`state_dict` (:data:`CHECKPOINT_KEY`)
    CHECKPOINT_KEY = CHECKPOINT_KEY

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = True) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (
                math.isfinite(lr) and lr > 0):
            raise ValueError(f"outer_lr must be a positive finite number, got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (
                0 <= momentum < 1):
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {momentum!r}")
        if not isinstance(nesterov, bool):
            raise ValueError(f"outer_nesterov must be True or False, got {nesterov!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = nesterov
        #: where every replica was set at the last global average (fp32; ``None`` before
        #: :meth:`start`)
        self.anchor: Tensor | None = None
        #: the momentum buffer ``m`` (``None`` before the first step, and with momentum 0)
        self.buffer: Tensor | None = None
        #: global averages taken (restored from a checkpoint with the rest)
        self.steps = 0
        self._restored = False

    def __repr__(self) -> str:
        return (f"OuterOptimizer(lr={self.lr!r}, momentum={self.momentum!r}, "
                f"nesterov={self.nesterov!r})")

    def start(self, point: Tensor) -> None:
        """The start of a fit, where every replica holds ``point``: it becomes the anchor and
        the momentum starts from zero, unless :meth:`load_state_dict` restored a state since
        the last start (a resume), which is kept."""
        if self._restored:
            self._restored = False
            assert self.anchor is not None
            if self.anchor.numel() != point.numel():
                raise ValueError(
                    f"the outer optimizer's state restored from the checkpoint has "
                    f"{self.anchor.numel()} values, but the model has {point.numel()}")
            return
        self.anchor = point.detach().float().clone()
        self.buffer = None
        self.steps = 0

    @torch.no_grad()
    def step(self, average: Tensor) -> Tensor:
        """The point every replica goes to, given the new exact ``average`` (a new fp32
        tensor on ``average``'s device); it becomes the anchor."""
        if self.anchor is None:
            raise RuntimeError("OuterOptimizer.step before start(): no anchor")
        avg = average.detach().float()
        anchor = self.anchor.to(avg.device)
        delta = anchor - avg
        direction = delta  # momentum 0: no buffer kept
        if self.momentum > 0:
            buf = torch.zeros_like(delta) if self.buffer is None else self.buffer.to(avg.device)
            self.buffer = buf.mul_(self.momentum).add_(delta)
            direction = delta + self.momentum * buf if self.nesterov else buf
        new = avg - (self.lr * direction - delta)
        self.anchor = new.clone()
        self.steps += 1
        return new

    def state_dict(self) -> dict[str, Any]:
        """The anchor and momentum buffer (on the CPU) and the count of steps: what a resume
        needs. The options are not saved (a resume may change them)."""
        return {"anchor": None if self.anchor is None else self.anchor.detach().cpu().clone(),
                "buffer": None if self.buffer is None else self.buffer.detach().cpu().clone(),
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values; the next :meth:`start` keeps them."""
        anchor, buffer = state.get("anchor"), state.get("buffer")
        if anchor is None:
            return  # saved before the first start: nothing to keep
        if buffer is not None and buffer.numel() != anchor.numel():
            raise ValueError("outer optimizer state: anchor and momentum buffer differ in size")
        self.anchor = anchor.float().clone()
        self.buffer = None if buffer is None else buffer.float().clone()
        self.steps = int(state.get("steps", 0))
        self._restored = True


def check_outer(lr: float | None, momentum: float, nesterov: bool,
                every_n_steps: int | None) -> OuterOptimizer | None:
    """The outer optimizer of the options ``outer_lr``, ``outer_momentum``, ``outer_nesterov``
    (``None`` without ``outer_lr``), which acts at a periodic global average every
    ``every_n_steps`` (``ValueError`` naming the option).

    >>> check_outer(0.7, 0.9, True, every_n_steps=50)
    OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    >>> check_outer(0.7, 0.0, True, every_n_steps=None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: outer_lr=0.7 acts at the periodic global average: give global_average_every_...
    """
    if lr is None:
        if momentum != 0 or nesterov is not True:
            raise ValueError(
                "outer_momentum and outer_nesterov configure the outer optimizer: give "
                f"outer_lr too (got outer_momentum={momentum!r}, outer_nesterov={nesterov!r} "
                "without outer_lr)")
        return None
    if every_n_steps is None:
        raise ValueError(f"outer_lr={lr!r} acts at the periodic global average: give "
                         "global_average_every_n_steps too")
    return OuterOptimizer(lr, momentum, nesterov)
