"""Simulate many decentralized learners in one process.

``N`` virtual learners keep their replicas stacked in one ``(N, d)`` fp32 tensor; per-learner
gradients come from :func:`torch.func.vmap` over :func:`torch.func.grad`, and replicas are mixed
with the very :class:`~lightning_gossip.topology.Topology` objects the strategies use, so the
simulator answers "how would this topology train with 1,024 learners?" on a laptop.

Two algorithms:

* :class:`DPSGDSimulator`: synchronous D-PSGD with exactly the update of
  :class:`~lightning_gossip.DPSGDStrategy` at optimizer step ``t`` with ``W_t =
  topology.mixing_matrix(t)``:

  - ``overlap=True`` (default): ``x_{t+1} = x'_t + (W_t x_t - x_t)``, where ``x'_t`` is the
    local optimizer step from ``x_t`` (plain SGD: ``x_{t+1} = W_t x_t - lr * g(x_t)``);
  - ``overlap=False``: ``x_{t+1} = W_t x'_t``.

  Parameters and floating-point buffers are mixed, in fp32.

* :class:`ADPSGDSimulator`: asynchronous AD-PSGD in virtual time. Learner ``i`` needs
  ``compute_times[i]`` time units per step (optionally with random jitter); its gradient is
  computed on the replica as it was when the step started and applied to the replica as it is
  when the step ends (staleness). After each of its steps an *active* learner (the same
  :class:`~lightning_gossip.pairing.Pairing` the real strategy uses) averages atomically with
  one passive partner. With ``delay=0`` the average lands at once; with ``delay=k`` the
  exchange launched after step ``s`` lands at the end of the active's step ``s + k`` (the real
  strategy overlaps one exchange with one step: ``delay=1``), both sides receiving
  ``(theirs - mine) / 2`` as computed at launch, so the sum of replicas is conserved.

Everything is deterministic for a seed.

Example::

    >>> import torch
    >>> from lightning_gossip.sim import DPSGDSimulator
    >>> model = torch.nn.Linear(4, 1)
    >>> sim = DPSGDSimulator(model, torch.nn.functional.mse_loss, "random_ring", 64, lr=0.1)
    >>> x, y = torch.randn(64, 8, 4), torch.randn(64, 8, 1)   # one minibatch per learner
    >>> sim.step(x, y)
    >>> sim.replicas.shape, sim.step_count
    (torch.Size([64, 5]), 1)
    >>> float(sim.consensus_distance()) > 0
    True
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_gossip import topology as _topology
from lightning_gossip.pairing import Pairing

__all__ = [
    "ADPSGDSimulator",
    "ComputeModel",
    "DPSGDSimulator",
    "DataShards",
    "Mixer",
    "SimResult",
    "Simulator",
    "digits_problem",
    "run_adpsgd",
    "run_dpsgd",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchFn = Callable[[np.ndarray, np.ndarray], tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# Mixing with a Topology's matrices
# ---------------------------------------------------------------------------------------------


class Mixer:
    """Applies ``X <- W_t X`` for a :class:`Topology` to stacked replicas ``X`` of shape ``(n, d)``.

    Sparse matrices (rings, tori, exponential graphs) go through a CSR matmul in ``O(nnz * d)``, the uniform matrix of ``complete`` through a mean, anything else through a
    dense fp32 matmul. A static topology's matrix is converted once.

    Example::

        >>> import torch
        >>> from lightning_gossip.topology import build
        >>> m = Mixer(build("ring", 8))
        >>> x = torch.eye(8)
        >>> torch.allclose(m.mix(x, step=0), torch.as_tensor(build("ring", 8).mixing_matrix(0),
        ...                                                       dtype=torch.float32))
        True
    """

    def __init__(self, topo: _topology.Topology, dtype: torch.dtype = torch.float32) -> None:
        self.topology = topo
        self.dtype = dtype
        self._static: tuple | None = None

    def _plan(self, step: int) -> tuple:
        if not self.topology.is_time_varying and self._static is not None:
            return self._static
        w = self.topology.mixing_matrix(step)
        n = w.shape[0]
        if n > 1 and np.ptp(w) == 0.0:
            plan: tuple = ("mean",)
        else:
            rows, cols = np.nonzero(w)
            if len(rows) > 0.25 * n * n:
                plan = ("dense", torch.as_tensor(w, dtype=self.dtype))
            else:
                crow = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])
                with warnings.catch_warnings():  # "sparse CSR support is in beta"
                    warnings.simplefilter("ignore", UserWarning)
                    csr = torch.sparse_csr_tensor(
                        torch.as_tensor(crow, dtype=torch.int64),
                        torch.as_tensor(cols, dtype=torch.int64),
                        torch.as_tensor(w[rows, cols], dtype=self.dtype),
                        size=(n, n),
                    )
                plan = ("sparse", csr)
        if not self.topology.is_time_varying:
            self._static = plan
        return plan

    def mix(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Return ``W_step @ x`` (a new tensor) for ``x`` of shape ``(n, d)``."""
        plan = self._plan(step)
        if plan[0] == "mean":
            return x.mean(dim=0, keepdim=True).expand_as(x).clone()
        return plan[1] @ x


# ---------------------------------------------------------------------------------------------
# Data and compute-time models
# ---------------------------------------------------------------------------------------------


def _hash_uniform(*keys: np.ndarray | int) -> np.ndarray:
    """Counter-based uniform(0, 1) numbers from integer keys (splitmix64; deterministic)."""
    with np.errstate(over="ignore"):
        z = np.zeros(np.broadcast(*[np.asarray(k) for k in keys]).shape, dtype=np.uint64)
        for k in keys:
            z = z * np.uint64(0x100000001B3) + np.asarray(k).astype(np.uint64)
            z = z + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class DataShards:
    """Splits a dataset over ``n`` learners and draws each learner's minibatches.

    The minibatch of learner ``r`` at its local step ``s`` is a deterministic function of
    ``(seed, r, s)`` (sampling with replacement from the learner's shard), so synchronous and
    asynchronous runs see the same data per learner and step.

    Args:
        inputs, targets: the whole dataset (first dimension = samples).
        world_size: number of learners.
        batch_size: samples per learner per step.
        partition: ``"iid"`` (shuffled, then split) or ``"sorted"`` (split after sorting by
            target: every learner sees few classes, which makes disagreement costly).
        seed: seeds the split and the sampling.

    Example::

        >>> import torch
        >>> shards = DataShards(torch.randn(100, 3), torch.arange(100) % 5, 10, batch_size=4)
        >>> x, y = shards.batch(np.arange(10), np.zeros(10, dtype=int))
        >>> x.shape, y.shape
        (torch.Size([10, 4, 3]), torch.Size([10, 4]))
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        world_size: int,
        batch_size: int,
        partition: str = "iid",
        seed: int = 0,
    ) -> None:
        n_samples = len(inputs)
        if partition not in ("iid", "sorted"):
            raise ValueError(f"partition must be 'iid' or 'sorted', got {partition!r}")
        if world_size < 1 or world_size > n_samples:
            raise ValueError(
                f"cannot split {n_samples} samples over {world_size} learners "
                "(need 1 <= learners <= samples)"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rng = np.random.default_rng(seed)
        order = rng.permutation(n_samples)
        if partition == "sorted":
            order = order[np.argsort(np.asarray(targets)[order], kind="stable")]
        bounds = np.linspace(0, n_samples, world_size + 1).astype(np.int64)
        self.inputs, self.targets = inputs, targets
        self.order = order
        self.starts = bounds[:-1]
        self.lengths = np.diff(bounds)
        self.batch_size = batch_size
        self.seed = seed
        self.world_size = world_size

    def batch(self, ranks: np.ndarray, steps: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Minibatches for learners ``ranks`` at their local ``steps``: ``(k, B, ...)``, ``(k, B)``."""
        ranks = np.asarray(ranks, dtype=np.int64)
        steps = np.asarray(steps, dtype=np.int64)
        k = np.arange(self.batch_size)
        u = _hash_uniform(self.seed, ranks[:, None], steps[:, None], k[None, :])
        pos = self.starts[ranks][:, None] + (u * self.lengths[ranks][:, None]).astype(np.int64)
        idx = torch.as_tensor(self.order[pos])
        return self.inputs[idx], self.targets[idx]


class ComputeModel:
    """How long each learner's step takes, in virtual time units.

    ``duration(r, s) = compute_times[r] * exp(jitter * z - jitter^2 / 2)`` with ``z`` a standard
    normal drawn from ``(seed, r, s)`` (``jitter=0``: exactly ``compute_times[r]``).

    Example::

        >>> cm = ComputeModel.with_slow(8, slow=1, slow_factor=4.0)
        >>> cm.duration(np.arange(8), np.zeros(8, dtype=int)).tolist()
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0]
    """

    def __init__(self, compute_times: Sequence[float], jitter: float = 0.0, seed: int = 0) -> None:
        times = np.asarray(compute_times, dtype=np.float64)
        if times.ndim != 1 or len(times) == 0 or np.any(~np.isfinite(times)) or np.any(times <= 0):
            raise ValueError("compute_times must be a non-empty list of positive numbers")
        if jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {jitter}")
        self.compute_times = times
        self.jitter = float(jitter)
        self.seed = seed

    @classmethod
    def with_slow(
        cls, world_size: int, slow: int = 0, slow_factor: float = 1.0, jitter: float = 0.0,
        seed: int = 0,
    ) -> ComputeModel:
        """``slow`` learners (the last ranks) take ``slow_factor`` time units, the rest 1."""
        if not 0 <= slow <= world_size:
            raise ValueError(f"slow must be between 0 and the number of learners, got {slow}")
        if slow_factor <= 0:
            raise ValueError(f"slow_factor must be > 0, got {slow_factor}")
        times = np.ones(world_size)
        if slow:
            times[world_size - slow:] = slow_factor
        return cls(times, jitter=jitter, seed=seed)

    def duration(self, ranks: np.ndarray, steps: np.ndarray) -> np.ndarray:
        ranks = np.asarray(ranks, dtype=np.int64)
        base = self.compute_times[ranks]
        if self.jitter == 0.0:
            return base.copy()
        u1 = _hash_uniform(self.seed, 1, ranks, steps)
        u2 = _hash_uniform(self.seed, 2, ranks, steps)
        z = np.sqrt(-2.0 * np.log(np.maximum(u1, 1e-300))) * np.cos(2.0 * np.pi * u2)
        return base * np.exp(self.jitter * z - 0.5 * self.jitter**2)


# ---------------------------------------------------------------------------------------------
# Simulators
# ---------------------------------------------------------------------------------------------


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
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("lr, momentum and weight_decay must be >= 0")
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
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

    def consensus_distance(self) -> torch.Tensor:
        """``(1/n) sum_i ||x_i - mean(x)||^2`` over the parameters."""
        return ((self.replicas - self.mean_params()) ** 2).sum(dim=1).mean()

    def state_dict(self, rank: int) -> dict[str, torch.Tensor]:
        """Learner ``rank``'s parameters and buffers, named as in the model's ``state_dict``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for {self.world_size} learners")
        out = {k: v[0].clone() for k, v in self._p_layout.views(self.replicas[rank:rank + 1]).items()}
        out.update(
            {k: v[0].clone() for k, v in self._b_layout.views(self.buffers[rank:rank + 1]).items()}
        )
        return out

    def set_replicas(self, params: torch.Tensor, buffers: torch.Tensor | None = None) -> None:
        """Replace the stacked replicas (shape ``(n, d)``), e.g. to start from offsets."""
        params = torch.as_tensor(params, dtype=torch.float32)
        if params.shape != self.replicas.shape:
            raise ValueError(f"expected shape {tuple(self.replicas.shape)}, got {tuple(params.shape)}")
        self.replicas = params.clone().contiguous()
        if buffers is not None:
            buffers = torch.as_tensor(buffers, dtype=torch.float32)
            if buffers.shape != self.buffers.shape:
                raise ValueError(
                    f"expected buffers of shape {tuple(self.buffers.shape)}, got {tuple(buffers.shape)}"
                )
            self.buffers = buffers.clone().contiguous()

    def flat_state(self, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten one model ``state_dict`` into ``(params (d,), float buffers (db,))``."""
        return self._p_layout.flatten(state), self._b_layout.flatten(state)

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


class DPSGDSimulator(Simulator):
    """Synchronous D-PSGD over ``world_size`` virtual learners (see the module docstring).

    Args:
        topology: a name from :data:`lightning_gossip.topology.TOPOLOGIES`, a
            :class:`~lightning_gossip.topology.Topology` or a mixing matrix.
        seed: seeds time-varying topologies, as the strategy's ``seed``.
        overlap: ``True`` mixes the pre-step replicas (the strategy's default), ``False``
            mixes after the local step.
        delay_by_one: apply at step ``t`` the mixing change computed at step ``t - 1``:
            ``x_{t+1} = x'_t + (W_{t-1} x_{t-1} - x_{t-1})`` (implies ``overlap``); see
            :meth:`quiesce`.
        Other arguments: see :class:`Simulator`.

    Example::

        >>> import torch
        >>> sim = DPSGDSimulator(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, "ring",
        ...                      8, lr=0.0)
        >>> sim.set_replicas(torch.arange(8.0)[:, None].repeat(1, 3))
        >>> sim.step(torch.zeros(8, 1, 2), torch.zeros(8, 1, 1))
        >>> sim.replicas[:, 0].tolist()[:3]  # ring neighbours (7, 0, 1), (0, 1, 2), (1, 2, 3)
        [2.6666667461395264, 1.0, 2.0]
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        topology: str | _topology.Topology | np.ndarray,
        world_size: int,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        overlap: bool = True,
        delay_by_one: bool = False,
    ) -> None:
        super().__init__(model, loss_fn, world_size, lr, momentum, weight_decay)
        self.topology = _topology.resolve(topology, self.world_size, seed)
        self.mixer = Mixer(self.topology)
        self.overlap = bool(overlap) or bool(delay_by_one)
        self.delay_by_one = bool(delay_by_one)
        self.step_count = 0
        self._pending: torch.Tensor | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One synchronous step; ``x``, ``y`` hold one minibatch per learner: ``(n, B, ...)``."""
        n = self.world_size
        if len(x) != n or len(y) != n:
            raise ValueError(f"expected one minibatch per learner (first dimension {n}), "
                             f"got {len(x)} and {len(y)}")
        g = self.gradients(self.replicas, self.buffers, x, y)
        local = self._sgd(slice(None), self.replicas, g)
        t = self.step_count
        d = self.replicas.shape[1]
        has_buffers = self.buffers.numel() > 0
        before = torch.cat([self.replicas, self.buffers], 1) if has_buffers else self.replicas
        after = torch.cat([local, self.buffers], 1) if has_buffers else local
        if not self.overlap:
            new = self.mixer.mix(after, t)
        elif self.delay_by_one:
            new = after if self._pending is None else after + self._pending
            self._pending = self.mixer.mix(before, t) - before
        else:
            new = after + (self.mixer.mix(before, t) - before)
        self.replicas = new[:, :d].contiguous()
        if has_buffers:
            self.buffers = new[:, d:].contiguous()
        self.step_count += 1

    def quiesce(self) -> None:
        """Apply a delay-by-one exchange still in flight (the strategy does so at sync points)."""
        if self._pending is not None:
            d = self.replicas.shape[1]
            self.replicas = self.replicas + self._pending[:, :d]
            if self.buffers.numel():
                self.buffers = self.buffers + self._pending[:, d:]
            self._pending = None


class ADPSGDSimulator(Simulator):
    """Asynchronous AD-PSGD in virtual time (see the module docstring).

    Args:
        pairing: ``"ring"`` or ``"random"`` (see :class:`~lightning_gossip.pairing.Pairing`).
        compute: per-learner step times; default: every learner takes 1 time unit.
        delay: steps an exchange stays in flight (0: atomic average right after the step;
            1: overlapped with the active's next step, as in the real strategy).
        seed: seeds the random pairing.
        Other arguments: see :class:`Simulator`.

    Example::

        >>> import torch
        >>> sim = ADPSGDSimulator(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, 8, lr=0.0,
        ...                       compute=ComputeModel.with_slow(8, slow=1, slow_factor=3.0))
        >>> sim.set_replicas(torch.randn(8, 3))
        >>> total = sim.replicas.sum(0)
        >>> batches = lambda ranks, steps: (torch.zeros(len(ranks), 1, 2), torch.zeros(len(ranks), 1, 1))
        >>> sim.run_until(10.0, batches)
        >>> torch.allclose(sim.replicas.sum(0), total, atol=1e-5), sim.local_steps.tolist()
        (True, [10, 10, 10, 10, 10, 10, 10, 3])
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        world_size: int,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        pairing: str = "random",
        compute: ComputeModel | None = None,
        delay: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(model, loss_fn, world_size, lr, momentum, weight_decay)
        self.pairing = Pairing(pairing, self.world_size, seed)
        self.compute = compute or ComputeModel(np.ones(self.world_size))
        if len(self.compute.compute_times) != self.world_size:
            raise ValueError(
                f"compute model has {len(self.compute.compute_times)} learners, "
                f"expected {self.world_size}"
            )
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ValueError(f"delay must be an integer >= 0, got {delay!r}")
        self.delay = delay
        n = self.world_size
        self.time = 0.0
        self.local_steps = np.zeros(n, dtype=np.int64)
        self.exchanges = np.zeros(n, dtype=np.int64)
        self._snapshot: torch.Tensor | None = None
        self._finish = self.compute.duration(np.arange(n), self.local_steps)
        self._active = np.array([self.pairing.is_active(r) for r in range(n)])
        # per active: list of (due local step, partner, delta for me)
        self._inflight: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        #: pairwise averages that landed on a replica while its gradient was being computed
        self.staleness_sum = 0
        self._hits = np.zeros(n, dtype=np.int64)

    @property
    def total_steps(self) -> int:
        return int(self.local_steps.sum())

    @property
    def mean_staleness(self) -> float:
        """Pairwise averages that landed on a replica between the snapshot a gradient was
        computed on and the moment it was applied, per local step."""
        return self.staleness_sum / max(self.total_steps, 1)

    def set_replicas(self, params: torch.Tensor, buffers: torch.Tensor | None = None) -> None:
        super().set_replicas(params, buffers)
        self._snapshot = None

    def run_until(self, until: float, batches: BatchFn) -> None:
        """Advance virtual time to ``until``, processing every step that ends by then.

        Args:
            until: virtual time to stop at (steps ending exactly then are processed).
            batches: ``batches(ranks, local_steps) -> (x, y)`` with one minibatch per rank.
        """
        if self._snapshot is None:
            self._snapshot = self.replicas.clone()
            self._snap_buffers = self.buffers.clone()
        while True:
            t_next = float(self._finish.min())
            if t_next > until + 1e-9:
                break
            done = np.flatnonzero(self._finish <= t_next + 1e-9)
            idx = torch.as_tensor(done)
            x, y = batches(done, self.local_steps[done])
            g = self.gradients(self._snapshot[idx], self._snap_buffers[idx], x, y)
            # the stale gradient (from the snapshot) is applied to the current replica
            self.replicas[idx] = self._sgd(idx, self.replicas[idx], g)
            self.staleness_sum += int(self._hits[done].sum())
            self.local_steps[done] += 1
            for i in done[self._active[done]]:
                self._gossip(int(i))
            self._hits[done] = 0  # what landed so far precedes their next snapshot
            self._snapshot[idx] = self.replicas[idx]
            self._snap_buffers[idx] = self.buffers[idx]
            self._finish[done] = t_next + self.compute.duration(done, self.local_steps[done])
            self.time = t_next
        self.time = max(self.time, until)

    def _gossip(self, i: int) -> None:
        step = int(self.local_steps[i])
        queue = self._inflight.setdefault(i, [])
        while queue and queue[0][0] <= step:
            _, j, delta = queue.pop(0)
            self._apply_pair(i, j, delta)
        j = self.pairing.partner(i, int(self.exchanges[i]))
        self.exchanges[i] += 1
        if self.delay == 0:
            avg = (self.replicas[i] + self.replicas[j]) / 2
            self.replicas[i] = avg
            self.replicas[j] = avg
            if self.buffers.numel():
                bavg = (self.buffers[i] + self.buffers[j]) / 2
                self.buffers[i] = bavg
                self.buffers[j] = bavg
            self._hits[j] += 1
        else:
            delta = torch.cat([(self.replicas[j] - self.replicas[i]) / 2,
                               (self.buffers[j] - self.buffers[i]) / 2])
            queue.append((step + self.delay, j, delta))

    def _apply_pair(self, i: int, j: int, delta: torch.Tensor) -> None:
        d = self.replicas.shape[1]
        self.replicas[i] += delta[:d]
        self.replicas[j] -= delta[:d]
        if self.buffers.numel():
            self.buffers[i] += delta[d:]
            self.buffers[j] -= delta[d:]
        self._hits[j] += 1  # lands at i's step boundary, but in the middle of j's step


# ---------------------------------------------------------------------------------------------
# Experiments
# ---------------------------------------------------------------------------------------------


@dataclass
class SimResult:
    """Curves of one simulated run; ``time`` is virtual time, ``steps`` total local steps / n."""

    algorithm: str
    topology: str
    world_size: int
    time: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    consensus: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def record(self, time: float, steps: float, loss: float, acc: float, cons: float) -> None:
        self.time.append(float(time))
        self.steps.append(float(steps))
        self.loss.append(float(loss))
        self.accuracy.append(float(acc))
        self.consensus.append(float(cons))

    def first_below(self, target: float, axis: str = "steps") -> float | None:
        """The first recorded ``steps`` (or ``time``) at which the loss is ``<= target``."""
        xs = self.steps if axis == "steps" else self.time
        for x, loss in zip(xs, self.loss):
            if loss <= target:
                return x
        return None

    def as_dict(self) -> dict:
        return {
            "algorithm": self.algorithm, "topology": self.topology, "world_size": self.world_size,
            "time": self.time, "steps": self.steps, "loss": self.loss, "accuracy": self.accuracy,
            "consensus": self.consensus, **self.extra,
        }


def digits_problem(hidden: int = 32, seed: int = 0) -> tuple[nn.Module, LossFn, torch.Tensor, torch.Tensor]:
    """A small real task: scikit-learn's bundled 8x8 digits (1,797 images) and an MLP.

    Returns ``(model, loss_fn, inputs (1797, 64), targets (1797,))``; inputs are scaled to
    [0, 1]. Needs scikit-learn (``pip install scikit-learn``); no download.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the digits problem needs scikit-learn: pip install scikit-learn "
            "(or lightning-gossip[vision])"
        ) from e
    data = load_digits()
    x = torch.as_tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(data.target, dtype=torch.long)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    return model, nn.functional.cross_entropy, x, y


def _progress(total: float, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def run_dpsgd(
    model: nn.Module,
    loss_fn: LossFn,
    shards: DataShards,
    eval_data: tuple[torch.Tensor, torch.Tensor],
    topology: str,
    duration: float,
    lr: float,
    momentum: float = 0.0,
    seed: int = 0,
    overlap: bool = True,
    compute: ComputeModel | None = None,
    eval_every: float = 10.0,
    progress: bool = False,
) -> SimResult:
    """Run synchronous D-PSGD for ``duration`` virtual time units; record every ``eval_every``.

    A synchronous step lasts as long as its slowest learner (``compute``; default 1 unit each).

    Example::

        >>> model, loss_fn, x, y = digits_problem(hidden=8)
        >>> shards = DataShards(x, y, 16, batch_size=8)
        >>> r = run_dpsgd(model, loss_fn, shards, (x, y), "random_ring", duration=5, lr=0.1)
        >>> r.steps
        [0.0, 5.0]
    """
    n = shards.world_size
    sim = DPSGDSimulator(model, loss_fn, topology, n, lr=lr, momentum=momentum, seed=seed,
                         overlap=overlap)
    compute = compute or ComputeModel(np.ones(n))
    res = SimResult("dpsgd", sim.topology.name, n)
    ranks = np.arange(n)
    t, next_eval = 0.0, 0.0
    with _progress(duration, f"dpsgd {sim.topology.name} n={n}", progress) as bar:
        while True:
            if t >= next_eval - 1e-9:
                res.record(t, sim.step_count, *sim.evaluate(*eval_data),
                           float(sim.consensus_distance()))
                next_eval += eval_every
            steps = np.full(n, sim.step_count)
            dt = float(compute.duration(ranks, steps).max())
            if t + dt > duration + 1e-9:
                break
            sim.step(*shards.batch(ranks, steps))
            t += dt
            bar.update(dt)
    if res.time[-1] < t - 1e-9:
        res.record(t, sim.step_count, *sim.evaluate(*eval_data), float(sim.consensus_distance()))
    return res


def run_adpsgd(
    model: nn.Module,
    loss_fn: LossFn,
    shards: DataShards,
    eval_data: tuple[torch.Tensor, torch.Tensor],
    pairing: str,
    duration: float,
    lr: float,
    momentum: float = 0.0,
    seed: int = 0,
    delay: int = 1,
    compute: ComputeModel | None = None,
    eval_every: float = 10.0,
    progress: bool = False,
) -> SimResult:
    """Run AD-PSGD for ``duration`` virtual time units; record every ``eval_every``.

    ``steps`` in the result is the total number of local steps divided by the number of
    learners (comparable with synchronous steps).
    """
    n = shards.world_size
    sim = ADPSGDSimulator(model, loss_fn, n, lr=lr, momentum=momentum, pairing=pairing,
                          compute=compute, delay=delay, seed=seed)
    res = SimResult("adpsgd", pairing, n)
    t = 0.0
    with _progress(duration, f"adpsgd {pairing} n={n}", progress) as bar:
        while True:
            res.record(t, sim.total_steps / n, *sim.evaluate(*eval_data),
                       float(sim.consensus_distance()))
            if t >= duration - 1e-9:
                break
            nxt = min(t + eval_every, duration)
            sim.run_until(nxt, shards.batch)
            bar.update(nxt - t)
            t = nxt
    res.extra = {"local_steps": sim.local_steps.tolist(), "mean_staleness": sim.mean_staleness}
    return res
