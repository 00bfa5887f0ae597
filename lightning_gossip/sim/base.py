"""The state every simulator shares: ``N`` stacked replicas and a per-learner local SGD.

Replicas live in one ``(N, d)`` fp32 tensor (float buffers in a second one); per-learner
gradients come from :func:`torch.func.vmap` over :func:`torch.func.grad`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_gossip._compat import batch_norm_base
from lightning_gossip.sim.workloads import LossFn
from lightning_gossip.topology import check_world_size

__all__ = ["Simulator"]


@dataclass
class _Layout:
    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    size: int

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> _Layout:
        names, shapes, offsets, off = [], [], [], 0
        for name, t in tensors.items():
            names.append(name)
            shapes.append(t.shape)
            offsets.append(off)
            off += t.numel()
        return cls(names, shapes, offsets, off)

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.names:
            return torch.zeros(0)
        return torch.cat([tensors[n].detach().reshape(-1).float() for n in self.names])

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-name views of ``flat`` of shape ``(k, size)`` as ``(k, *shape)``."""
        k = flat.shape[0]
        return {
            n: flat[:, o:o + math.prod(s)].reshape(k, *s)
            for n, s, o in zip(self.names, self.shapes, self.offsets)
        }


class Simulator:
    """Shared state of ``world_size`` virtual learners: stacked replicas and a local SGD.

    All learners start from ``model``'s weights (the strategies broadcast rank 0's initial
    weights). The local optimizer is SGD with optional momentum and weight decay, as
    :class:`torch.optim.SGD` computes it; its state is per learner and never mixed.

    Args:
        model: the network; only its structure and initial weights are used. Models whose
            forward pass updates buffers (BatchNorm in training mode) are not supported.
        loss_fn: ``loss_fn(model_output, targets) -> scalar``.
        world_size: number of learners.
        lr, momentum, weight_decay: SGD hyper-parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        world_size: int,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        world_size = check_world_size(world_size)
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("lr, momentum and weight_decay must be >= 0")
        for mod in model.modules():
            if isinstance(mod, batch_norm_base()) and mod.track_running_stats:
                raise ValueError(
                    "the simulator does not support BatchNorm with running statistics (its "
                    "forward pass updates buffers); use track_running_stats=False or GroupNorm"
                )
        self.world_size = int(world_size)
        self.model = copy.deepcopy(model).float()
        self.loss_fn = loss_fn
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        params = dict(self.model.named_parameters())
        bufs = dict(self.model.named_buffers())
        self._p_layout = _Layout.of(params)
        float_bufs = {k: v for k, v in bufs.items() if v.is_floating_point()}
        self._b_layout = _Layout.of(float_bufs)
        self._other_bufs = {k: v for k, v in bufs.items() if not v.is_floating_point()}
        n = self.world_size
        self.replicas = self._p_layout.flatten(params).unsqueeze(0).repeat(n, 1).contiguous()
        self.buffers = self._b_layout.flatten(float_bufs).unsqueeze(0).repeat(n, 1).contiguous()
        self._momentum_buf: torch.Tensor | None = None
        self._grad_fn = vmap(grad(self._loss), in_dims=(0, 0, 0, 0))

    # -- functional pieces -----------------------------------------------------------------
    def _loss(self, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.model, ({**params, **buffers, **self._other_bufs},), (x,))
        return self.loss_fn(out, y)

    def gradients(
        self, flat_params: torch.Tensor, flat_buffers: torch.Tensor, x: torch.Tensor,
        y: torch.Tensor,
    ) -> torch.Tensor:
        """Per-learner gradients ``(k, d)`` at parameters ``(k, d)`` on batches ``(k, B, ...)``."""
        g = self._grad_fn(
            self._p_layout.views(flat_params), self._b_layout.views(flat_buffers), x, y
        )
        return torch.cat([g[n].reshape(len(x), -1) for n in self._p_layout.names], dim=1)

    def _sgd(self, idx: torch.Tensor | slice, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """One torch.optim.SGD step for learners ``idx``: returns the new parameters."""
        if self.weight_decay:
            g = g + self.weight_decay * x
        if self.momentum:
            if self._momentum_buf is None:
                self._momentum_buf = torch.zeros_like(self.replicas)
                self._momentum_started = torch.zeros(self.world_size, dtype=torch.bool)
            buf = self._momentum_buf[idx]
            started = self._momentum_started[idx].unsqueeze(1)
            buf = torch.where(started, self.momentum * buf + g, g)
            self._momentum_buf[idx] = buf
            self._momentum_started[idx] = True
            g = buf
        return x - self.lr * g

    # -- inspection --------------------------------------------------------------------------
    def mean_params(self) -> torch.Tensor:
        """The average of all replicas, flat ``(d,)``."""
        return self.replicas.mean(dim=0)

    def absolute_consensus_distance(self) -> torch.Tensor:
        """``(1/n) sum_i ||x_i - mean(x)||^2`` over the parameters.

        Absolute: not divided by ``||mean(x)||^2`` as the strategies'
        :func:`lightning_gossip.consensus.consensus_distance` is.
        """
        return ((self.replicas - self.mean_params()) ** 2).sum(dim=1).mean()

    def state_dict(self, rank: int) -> dict[str, torch.Tensor]:
        """Learner ``rank``'s parameters and buffers, named as in the model's ``state_dict``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for {self.world_size} learners")
        params = self._p_layout.views(self.replicas[rank:rank + 1])
        out = {k: v[0].clone() for k, v in params.items()}
        buffers = self._b_layout.views(self.buffers[rank:rank + 1])
        out.update({k: v[0].clone() for k, v in buffers.items()})
        return out

    def set_replicas(self, params: torch.Tensor, buffers: torch.Tensor | None = None) -> None:
        """Replace the stacked replicas (shape ``(n, d)``), e.g. to start from offsets."""
        params = torch.as_tensor(params, dtype=torch.float32)
        if params.shape != self.replicas.shape:
            raise ValueError(
                f"expected shape {tuple(self.replicas.shape)}, got {tuple(params.shape)}"
            )
        self.replicas = params.clone().contiguous()
        if buffers is not None:
            buffers = torch.as_tensor(buffers, dtype=torch.float32)
            if buffers.shape != self.buffers.shape:
                raise ValueError(
                    f"expected buffers of shape {tuple(self.buffers.shape)}, "
                    f"got {tuple(buffers.shape)}"
                )
            self.buffers = buffers.clone().contiguous()

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """Loss and accuracy (``nan`` unless targets are class indices) of the averaged model."""
        params = {k: v[0] for k, v in self._p_layout.views(self.mean_params()[None]).items()}
        bufs = {k: v[0] for k, v in self._b_layout.views(self.buffers.mean(0)[None]).items()}
        with torch.no_grad():
            out = functional_call(self.model, ({**params, **bufs, **self._other_bufs},), (x,))
            loss = float(self.loss_fn(out, y))
            acc = float("nan")
            if out.ndim == 2 and y.ndim == 1 and not y.is_floating_point():
                acc = float((out.argmax(dim=1) == y).float().mean())
        return loss, acc

