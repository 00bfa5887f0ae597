"""The replicas of every rank as one rank sees them, owned by
:class:`~lightning_gossip.strategies.GossipStrategy` as ``strategy.replicas`` (built at set-up):
the set-up checks (same shapes on every rank, rank 0's initial weights) and what the sync points
do with the exact average of the replicas (evaluation, checkpoints, the final average, the
consensus distance). The strategy quiets the network before each sync point; :class:`Replicas`
only averages, swaps and restores, so a test can build one over a module directly. No Lightning
here: the adapter hands it its watched wait and the module's state dict."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_gossip.consensus import all_average, consensus_distance
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.flat import FlatState
from lightning_gossip.outer import OuterOptimizer

__all__ = ["CONSENSUS_METRIC", "Replicas"]

CONSENSUS_METRIC = "gossip/consensus_distance"
"""The metric the consensus distance is logged under (``consensus_every_n_steps``)."""


class Replicas:
    """This rank's replica and the collectives over all of them (the default group).

    Args:
        flat: the replica's :class:`~lightning_gossip.flat.FlatState`.
        rank: this rank (for error messages and the mismatch check).
        world_size: the number of replicas; with one, the average is the replica itself.
        timeout: limit of every average (a watched wait: a silent rank is named).
        watched: the strategy's watched wait, ``watched(collective, *args, what=..., **kwargs)``
            (:meth:`~lightning_gossip.strategies.GossipStrategy.watched`), for the broadcast.
        session: the fit's session, whose group the averages run over when they run
            (:attr:`~lightning_gossip.elastic.session.ElasticSession.group`: the default group,
            or an elastic fit's survivors' after a loss); ``None``: the default group.
    """

    def __init__(self, flat: FlatState, rank: int, world_size: int, timeout: timedelta,
                 watched: Callable[..., None], session: ElasticSession | None = None) -> None:
        self.flat = flat
        self.session = session
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.watched = watched
        #: the local replica while the consensus weights are swapped in (evaluation, or
        #: :meth:`weights_as_is`); ``None`` otherwise
        self.local_backup: Tensor | None = None

    @property
    def group(self) -> Any:
        """The group the averages run over now (``None``: the default group)."""
        return self.session.group if self.session is not None else None

    # ------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------
    def check_match(self) -> None:
        """Fail on every rank, naming the first mismatch, if replicas differ in shape/dtype
        (a collective)."""
        # (the default group's members: fewer than the world size in a fit that started with
        # the ranks that came, lightning_gossip.elastic.founders)
        signatures: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(signatures, self.flat.signature())
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

    def broadcast_initial(self) -> None:
        """Every replica becomes rank 0's (a watched broadcast)."""
        flat = self.flat.pack()
        self.watched(dist.broadcast, flat, src=0, what="the broadcast of rank 0's initial weights")
        self.flat.copy_(flat)

    # ------------------------------------------------------------------------------------------
    # The exact average
    # ------------------------------------------------------------------------------------------
    def average(self, why: str = "") -> Tensor:
        """The exact average of all replicas as a flat fp32 vector (a collective, watched);
        the local replica with a single one. ``why`` completes error messages."""
        local = self.flat.pack()
        if self.world_size <= 1:
            return local
        return self._all_average(local, why)

    def _all_average(self, local: Tensor, why: str) -> Tensor:
        return all_average(local, self.group, timeout=self.timeout,
                           what=f"rank {self.rank}: averaging the replicas {why}".rstrip())

    def become_average(self, why: str, outer: OuterOptimizer | None = None) -> None:
        """Replace this replica by the exact average of all (a collective), or with ``outer``
        by the point its step takes from that average (the same on every rank)."""
        average = self.average(why)
        self.flat.copy_(average if outer is None else outer.step(average))

    def distance(self, step: int) -> float:
        """The consensus distance now (a collective, :func:`~lightning_gossip.consensus.
        consensus_distance`); ``step`` completes error messages."""
        return consensus_distance(
            self.flat.pack(), self.group, timeout=self.timeout,
            what=f"rank {self.rank}: measuring the consensus distance at step {step}")

    # ------------------------------------------------------------------------------------------
    # Swapping the consensus weights in and out
    # ------------------------------------------------------------------------------------------
    @property
    def holds_consensus(self) -> bool:
        """Whether the module holds swapped-in weights (the local replica is backed up)."""
        return self.local_backup is not None

    def swap_in_consensus(self) -> None:
        """Back up the local replica and put the average of all in its place (a collective)."""
        self.local_backup = self.flat.pack()
        self.flat.copy_(self._all_average(self.local_backup, "for evaluation"))

    def restore_local(self) -> None:
        """Put the backed-up local replica back (nothing when none is backed up)."""
        if self.local_backup is not None:
            self.flat.copy_(self.local_backup)
            self.local_backup = None

    @contextlib.contextmanager
    def weights_as_is(self, weights: Tensor | None = None) -> Iterator[None]:
        """Within the block the replica holds ``weights`` (the local replica when ``None``) and
        counts as swapped in (:attr:`holds_consensus`: the strategy's state dict is then the
        module's as is, no collective); the local replica is back afterwards."""
        local, backup = self.flat.pack(), self.local_backup
        if weights is not None:
            self.flat.copy_(weights.to(local.device))
        self.local_backup = local
        try:
            yield
        finally:
            self.flat.copy_(local)
            self.local_backup = backup

    def consensus_state_dict(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (``module.state_dict()``) with the replica's tensors replaced by their
        average over all replicas (a collective); the live replica is untouched."""
        views = self.flat.views(self.average("for a checkpoint"))
        averaged = {id(t): v for t, v in zip(self.flat.tensors, views)}
        for name, t in itertools.chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        ):
            if name in state and id(t) in averaged:
                state[name] = averaged[id(t)].to(t.dtype).clone()
        return state


def _describe(sig: tuple[str, tuple[int, ...], str] | None) -> str:
    if sig is None:
        return "missing"
    _, shape, dtype = sig
    return f"shape {tuple(shape)} dtype {dtype}"
