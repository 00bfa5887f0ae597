"""What the simulated learners train on and how long their steps take.

* :class:`DataShards`: a dataset split over the learners, minibatches drawn per learner and step;
* :class:`ComputeModel`: each learner's time per step (slow learners, random jitter);
* :func:`digits_problem`: a small real task (scikit-learn's bundled digits and an MLP).

Everything is a deterministic function of a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["ComputeModel", "DataShards", "LossFn", "digits_problem"]

#: ``loss_fn(model_output, targets) -> scalar``
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(outputs, targets) -> scalar``: the loss the simulated learners minimise."""


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
        """Minibatches of learners ``ranks`` at their local ``steps``.

        Returns ``(inputs (k, B, ...), targets (k, B, ...))`` for ``k = len(ranks)``.
        """
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

    def medians(self) -> np.ndarray:
        """Every learner's median step time: ``compute_times * exp(-jitter^2 / 2)`` (the median
        of the log-normal factor; ``compute_times`` without jitter).

        >>> ComputeModel([1.0, 2.0], jitter=0.0).medians().tolist()
        [1.0, 2.0]
        """
        return self.compute_times * np.exp(-0.5 * self.jitter**2)

    def duration(self, ranks: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Time units of learners ``ranks`` at their local ``steps`` (arrays of equal length)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        base = self.compute_times[ranks]
        if self.jitter == 0.0:
            return base.copy()
        u1 = _hash_uniform(self.seed, 1, ranks, steps)
        u2 = _hash_uniform(self.seed, 2, ranks, steps)
        z = np.sqrt(-2.0 * np.log(np.maximum(u1, 1e-300))) * np.cos(2.0 * np.pi * u2)
        return base * np.exp(self.jitter * z - 0.5 * self.jitter**2)


def digits_problem(
    hidden: int = 32, seed: int = 0
) -> tuple[nn.Module, LossFn, torch.Tensor, torch.Tensor]:
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
