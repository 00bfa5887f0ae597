"""The replica-wide side of :class:`~lightning_gossip.strategies.GossipStrategy`, as a mixin:
the set-up checks (same shapes on every rank, rank 0's initial weights) and the sync points that
quiet the network and use the exact average of the replicas (evaluation, checkpoints, the final
average, the consensus distance)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_gossip.consensus import all_average, consensus_distance

CONSENSUS_METRIC = "gossip/consensus_distance"


class _ReplicasMixin:
    """Replica set-up and sync points of :class:`GossipStrategy` (listed first in its bases, so
    the method resolution order of Lightning's hooks is unchanged)."""

    # ------------------------------------------------------------------------------------------
    # Replica set-up
    # ------------------------------------------------------------------------------------------
    def _check_replicas_match(self) -> None:
        """Fail on every rank, naming the first mismatch, if replicas differ in shape/dtype."""
        assert self._flat is not None
        signatures: list[Any] = [None] * self.world_size
        dist.all_gather_object(signatures, self._flat.signature())
        reference = signatures[0]
        for rank, sig in enumerate(signatures[1:], start=1):
            if sig == reference:
                continue
            for a, b in itertools.zip_longest(reference, sig):
                if a != b:
                    name = (a or b)[0]
                    raise ValueError(
                        f"model replicas differ between ranks: parameter/buffer {name!r} is "
                        f"{_describe(a)} on rank 0 but {_describe(b)} on rank {rank}. Every "
                        "rank must build the same model."
                    )

    def _broadcast_initial_weights(self) -> None:
        assert self._flat is not None
        flat = self._flat.pack()
        self.watched(dist.broadcast, flat, src=0, what="the broadcast of rank 0's initial weights")
        self._flat.copy_(flat)

    # ------------------------------------------------------------------------------------------
    # Sync points: quiet the network, then evaluate / checkpoint / average consensus weights
    # ------------------------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Finish all in-flight gossip so the replicas are stable (subclasses override)."""

    def average_replicas(self, why: str = "") -> Tensor:
        """The exact average of all replicas as a flat fp32 vector (a collective, watched like
        every sync point: a silent rank is named). ``why`` completes error messages."""
        assert self._flat is not None
        local = self._flat.pack()
        if not self.gossip_enabled:
            return local
        return self._all_average(local, why)

    def _all_average(self, local: Tensor, why: str) -> Tensor:
        return all_average(local, timeout=self.timeout,
                           what=f"rank {self.global_rank}: averaging the replicas {why}".rstrip())

    @override
    def on_train_start(self) -> None:
        """Resume the step counter ``t`` from the trainer's global step."""
        self.step = self.lightning_module.trainer.global_step

    @override
    def on_train_end(self) -> None:
        """Quiet the network, replace every replica by the exact average (``final_average``)
        and stop gossip."""
        if self.gossip_enabled and self._flat is not None:
            self.quiesce()
            if self.final_average:
                self._flat.copy_(self.average_replicas("at the end of training"))
        self.teardown_gossip()

    def teardown_gossip(self) -> None:
        """Stop the subclass's background work (idempotent)."""

    @override
    def on_validation_start(self) -> None:
        """Quiet the network; with ``evaluate="consensus"`` evaluate the average replica."""
        self._swap_in_consensus()

    @override
    def on_validation_end(self) -> None:
        """Put the local replica back."""
        self._restore_local()

    @override
    def on_test_start(self) -> None:
        """Quiet the network; with ``evaluate="consensus"`` test the average replica."""
        self._swap_in_consensus()

    @override
    def on_test_end(self) -> None:
        """Put the local replica back."""
        self._restore_local()

    def _swap_in_consensus(self) -> None:
        if not self.gossip_enabled or self._flat is None:
            return
        self.quiesce()
        if self.evaluate != "consensus":
            return
        self._local_backup = self._flat.pack()
        self._flat.copy_(self._all_average(self._local_backup, "for evaluation"))

    @contextlib.contextmanager
    def weights_as_is(self, weights: Tensor | None = None) -> Iterator[None]:
        """Within the block the replica holds ``weights`` (the local replica when ``None``) and
        :meth:`lightning_module_state_dict` returns them as they are, without averaging (no
        collective: the emergency checkpoint's survivors cannot meet every rank); the local
        replica is back afterwards."""
        assert self._flat is not None
        local, backup = self._flat.pack(), self._local_backup
        if weights is not None:
            self._flat.copy_(weights.to(local.device))
        self._local_backup = local  # with a backup set, the state dict is the module's as is
        try:
            yield
        finally:
            self._flat.copy_(local)
            self._local_backup = backup

    def _restore_local(self) -> None:
        if self._local_backup is not None and self._flat is not None:
            self._flat.copy_(self._local_backup)
            self._local_backup = None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The consensus (rank-averaged) weights; live replicas are untouched.

        Lightning calls this on every rank before rank 0 writes a checkpoint, so the average
        is a collective here and every rank resumes from the same weights.
        """
        module = self.lightning_module
        assert module is not None
        state = module.state_dict()
        if not self.gossip_enabled or self._flat is None:
            return state
        if self._local_backup is not None:  # evaluation already holds the consensus weights
            return state
        self.quiesce()
        views = self._flat.views(self.average_replicas("for a checkpoint"))
        averaged = {id(t): v for t, v in zip(self._flat.tensors, views)}
        for name, t in itertools.chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        ):
            if name in state and id(t) in averaged:
                state[name] = averaged[id(t)].to(t.dtype).clone()
        return state

    # ------------------------------------------------------------------------------------------
    # Consensus distance
    # ------------------------------------------------------------------------------------------
    def maybe_log_consensus(self) -> None:
        """Measure and log the consensus distance when this step is due (a collective)."""
        n = self.consensus_every_n_steps
        if n is None or not self.gossip_enabled or self.step % n != 0:
            return
        self.log_consensus_distance()

    def log_consensus_distance(self) -> float:
        """Measure the consensus distance now (a collective); rank 0 logs it at step = optimizer
        steps done. Also stored in :attr:`last_consensus_distance`."""
        assert self._flat is not None
        value = consensus_distance(
            self._flat.pack(), timeout=self.timeout,
            what=f"rank {self.global_rank}: measuring the consensus distance at step {self.step}")
        self.last_consensus_distance = value
        if self.is_global_zero and np.isfinite(value):
            for logger in self.lightning_module.trainer.loggers:
                logger.log_metrics({CONSENSUS_METRIC: value}, step=self.step)
        return value


def _describe(sig: tuple[str, tuple[int, ...], str] | None) -> str:
    if sig is None:
        return "missing"
    _, shape, dtype = sig
    return f"shape {tuple(shape)} dtype {dtype}"
