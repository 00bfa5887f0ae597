"""Apply a topology's mixing matrices to stacked replicas, fast for sparse graphs.

Pure torch/NumPy (no simulator, no Lightning), shared by :mod:`lightning_gossip.analysis` (to
measure consensus speed) and :mod:`lightning_gossip.sim` (to mix the simulated learners).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from lightning_gossip import topology as _topology

__all__ = ["Mixer"]


class Mixer:
    """Applies ``X <- W_t X`` for a :class:`Topology` to stacked replicas ``X`` of shape ``(n, d)``.

    Sparse matrices (rings, tori, exponential graphs) go through a CSR matmul in
    ``O(nnz * d)``, the uniform matrix of ``complete`` through a mean, anything else through a
    dense matmul. A static topology's matrix is converted once.

    Args:
        topo: the topology whose ``mixing_matrix(step)`` is applied.
        dtype: the dtype of the replicas to mix (fp32 in the simulator, fp64 in the analysis).

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
