"""The Lightning parallel-strategy API of the gossip strategies, over one default process group.

:class:`ProcessGroupStrategy` is what Lightning needs from any parallel strategy (devices,
ranks, the launcher, the process group) plus what every wait of the gossip strategies shares:
this rank's :class:`~lightning_gossip.liveness.Heartbeat` and :meth:`ProcessGroupStrategy.watched`,
through which Lightning's ``reduce``, ``barrier`` and ``broadcast`` run
(:mod:`~lightning_gossip.strategies.collectives`). Nothing here knows about replicas or gossip:
that is :class:`~lightning_gossip.strategies.gossip.GossipStrategy`, its subclass.
"""

from __future__ import annotations

from abc import ABC
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

import lightning_gossip.strategies.collectives as collectives
from lightning_gossip import _compat
from lightning_gossip.elastic.parts import ElasticParts
from lightning_gossip.elastic.survivors import Survivors
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.liveness import Heartbeat, watched_collective
from lightning_gossip.node_averaging import check_node_layout
from lightning_gossip.strategies.options import Backend

__all__ = ["SETUP_BARRIERS", "ProcessGroupStrategy"]

SETUP_BARRIERS = frozenset({"pre_setup", "post_setup", "run-stage", "train_dataloader()",
                            "val_dataloader()", "_CheckpointConnector.resume_end"})
"""Lightning's named barriers of a fit's set-up (lightning 2.6.6): a newcomer skips them, the
members passed theirs at their start (``ProcessGroupStrategy.joining``)."""


class ProcessGroupStrategy(ParallelStrategy, ABC):
    """Devices, ranks, the launcher and the default process group, the heartbeat, and
    Lightning's collectives as watched waits (the base of
    :class:`~lightning_gossip.strategies.gossip.GossipStrategy`).

    Args:
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: limit for every blocking wait, a checked ``timedelta``
            (:func:`~lightning_gossip.strategies.options.check_options`).
        heartbeat_timeout: seconds without a heartbeat after which a peer counts as lost;
            ``None`` disables the heartbeat.
    """

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None,
        parallel_devices: list[torch.device] | None,
        cluster_environment: ClusterEnvironment | None,
        checkpoint_io: CheckpointIO | None,
        precision_plugin: Precision | None,
        *,
        process_group_backend: Backend | None,
        timeout: timedelta,
        heartbeat_timeout: float | None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.heartbeat_timeout = None if heartbeat_timeout is None else float(heartbeat_timeout)
        #: this rank's :class:`~lightning_gossip.liveness.Heartbeat` (after set-up, if enabled)
        self.heartbeat: Heartbeat | None = None
        #: an elastic fit's recovery from lost ranks
        #: (:class:`~lightning_gossip.elastic.survivors.Survivors`; ``None`` otherwise); after the
        #: fit it still holds the survivors' group
        self.survivors: Survivors | None = None
        #: a process that joined a running fit: the names of Lightning's set-up barriers it
        #: skips, once each (the others passed theirs at their start); while ``"run-stage"``
        #: is among them (set-up), broadcasts stay local too. Empty otherwise.
        self.joining: set[str] = set()
        #: this process joined a running fit (elastic; its default group is the fit's newest)
        self.joined = False
        self._num_nodes = 1

    # ------------------------------------------------------------------------------------------
    # What Lightning needs from a parallel strategy
    # ------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device (``parallel_devices[local_rank]``)."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Number of nodes (set by the Trainer from ``num_nodes``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning's accelerator connector reads it (duck-typed, no base
        method) to inject a ``DistributedSampler`` and honour ``sync_dist=True``."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``num_replicas`` (the world size) and ``rank`` for Lightning's ``DistributedSampler``."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        """``"gloo"`` or ``"nccl"`` (``None`` until set-up when not given)."""
        return self._process_group_backend

    @property
    def timeout(self) -> timedelta:
        """The limit for every blocking wait."""
        return self._timeout

    @property
    def gossip_enabled(self) -> bool:
        """Whether there is anyone to gossip with (world size > 1)."""
        return self.world_size > 1

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        launcher = _compat.subprocess_script_launcher()(
            self.cluster_environment, self.num_processes, self.num_nodes
        )
        _compat.set_launcher(self, launcher)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        """Seed, set the ranks and initialise the default process group."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _compat.default_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        self.before_init()  # (a newcomer leaves Lightning's init nothing to do)
        _compat.init_dist_connection(
            self.cluster_environment, self._process_group_backend, **kwargs
        )
        self.start_heartbeat()

    def before_init(self) -> None:
        """Called before the default group is made (an elastic fit: a process in a free rank
        slot of a running fit joins it there, and makes its default group itself,
        :meth:`join_running_fit`); nothing here."""

    def collectives_local(self) -> bool:
        """Whether :meth:`reduce` and :meth:`broadcast` stay local now (an elastic ``dpsgd`` fit
        mid-epoch, where its ranks may train different numbers of batches); never here."""
        return False

    def join_running_fit(self, parts: ElasticParts, run: str, layout: NodeLayout) -> None:
        """``before_init`` of an elastic fit: in a free rank slot of the running fit ``run``,
        join it; with a start timeout, start it with the ranks that came (``parts``: the
        strategy's :class:`~lightning_gossip.elastic.parts.ElasticParts`; ``layout``: the fit's
        nodes, :meth:`rank_layout`). A newcomer's checkpoint is handed to Lightning to
        restore."""
        env = self.cluster_environment
        assert env is not None
        beat = parts.join(run, env.global_rank(), env.world_size(), env.main_address,
                          env.main_port, self.process_group_backend, layout)
        if beat is not None:
            self.heartbeat = beat
        if parts.newcomer is not None:
            _compat.preload_checkpoint(self.lightning_module.trainer, parts.newcomer.checkpoint)
            self.joining, self.joined = set(SETUP_BARRIERS), True

    def rebuild_train_loader(self, trainer: pl.Trainer) -> None:
        """Make Lightning build the fit's training loader again (an elastic fit's, once its
        shared cursor is set up); a newcomer skips that build's barrier too (the members'
        builds happened at their start)."""
        _compat.reload_train_dataloader(trainer)
        if self.joined:
            self.joining.add("train_dataloader()")

    def start_heartbeat(self) -> None:
        """Start this rank's :class:`~lightning_gossip.liveness.Heartbeat` (once per process
        group; nothing with ``heartbeat_timeout=None`` or a single process)."""
        if self.heartbeat_timeout is None or self.world_size <= 1:
            return
        if self.heartbeat is None:
            self.heartbeat = Heartbeat.connect(self.global_rank, self.world_size,
                                               self.heartbeat_timeout,
                                               fallback=_compat.default_store())
        self.heartbeat.start()

    def check_liveness(self, step: int) -> None:
        """Raise the liveness monitor's finding (``PeerSilent``, docs/faults.md), if any; called
        at every step boundary, so only an attribute read when nothing was found. An elastic
        fit's survivors go on without the lost ranks instead
        (:meth:`~lightning_gossip.elastic.survivors.Survivors.poll`; it also admits newcomers)."""
        if self.survivors is not None:
            self.survivors.poll()
            return
        heartbeat = self.heartbeat
        if heartbeat is not None and heartbeat.has_finding:
            heartbeat.check(f"rank {self.global_rank} at step {step}")

    def stop_heartbeat(self, failed: bool = False) -> None:
        """Stop beating; ``failed`` also tells the peers at once that this rank is gone."""
        if self.heartbeat is not None:
            self.heartbeat.leave(failed)

    def rank_layout(self, by_node: bool) -> NodeLayout:
        """Where this rank sits: ``num_nodes`` nodes of ``num_processes`` ranks (``by_node``:
        hierarchical), else each rank alone (:meth:`NodeLayout.flat
        <lightning_gossip.hierarchy.NodeLayout.flat>`). Known from the cluster environment's
        ranks, before the default group exists."""
        if by_node:
            return NodeLayout(self.num_nodes, self.num_processes, self.node_rank, self.local_rank)
        return NodeLayout.flat(self.world_size, self.global_rank)

    def _check_node_layout(self) -> None:
        """The same ``ValueError`` on every rank when the ranks do not form ``num_nodes`` nodes
        of ``num_processes`` (a collective: ``hierarchical`` set-up)."""
        check_node_layout(self.world_size, self.global_rank, self.node_rank, self.local_rank,
                          self.num_nodes, self.num_processes)

    @override
    def model_to_device(self) -> None:
        """Move the replica to this rank's device (no DDP wrapper)."""
        assert self.model is not None
        self.model.to(self.root_device)

    @property
    def live_group(self) -> Any:
        """The group of Lightning's collectives and the sync points: ``None`` (the default
        group) unless an elastic fit lost ranks (then the survivors', :attr:`survivors`)."""
        return self.survivors.group if self.survivors is not None else None

    def watched(self, collective: Any, *args: Any, what: str, group: Any | None = None,
                **kwargs: Any) -> None:
        """Run ``collective(*args, group=group, async_op=True, **kwargs)`` (every rank of
        ``group`` meets) and wait for it like a gossip wait: within :attr:`timeout`, and failing
        fast, naming the rank and ``what``, when a rank of the group stops beating
        (:func:`~lightning_gossip.liveness.watched_collective`). Every sync point of the
        strategies waits this way, so no collective can hang a rank for the whole ``timeout``.

        Example: ``self.watched(dist.barrier, what="the barrier before a checkpoint")``.
        """
        beat = self.heartbeat if self.heartbeat is not None and self.heartbeat.running else None
        watched_collective(collective, *args, what=f"rank {self.global_rank}: {what}",
                           timeout=self._timeout, group=group or self.live_group,
                           heartbeat=beat, **kwargs)

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor:
        """All-reduce ``tensor`` in place (mean by default; ``"sum"``, ``"max"``, ... or a
        ``ReduceOp``); anything else is returned as is. A watched wait (:meth:`watched`):
        ``self.log(..., sync_dist=True)`` and early stopping's decision meet here."""
        if self.collectives_local():
            return tensor
        return collectives.reduce(tensor, group or self.live_group, reduce_op, self.watched)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Wait for every rank (no-op without a process group, and for the set-up barriers of a
        process that joined a running fit: :attr:`joining`); a watched wait."""
        if name in self.joining:
            self.joining.discard(name)
            return
        collectives.barrier(name, self.root_device, self.watched)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (a picklable object): its pickled bytes
        are broadcast as a length and a byte tensor, each a watched wait."""
        if (not _compat.distributed_is_initialized() or "run-stage" in self.joining
                or self.collectives_local()):
            return obj
        return self.broadcast_object(obj, src)

    def broadcast_object(self, obj: Any, src: int, group: Any | None = None) -> Any:
        """:meth:`broadcast` within ``group`` (``src`` is a global rank of it)."""
        return collectives.broadcast_object(obj, src, group, self.global_rank,
                                            self.root_device, self.watched)

    # ------------------------------------------------------------------------------------------
    # Parts whose state travels in checkpoints
    # ------------------------------------------------------------------------------------------
    def checkpoint_parts(self) -> dict[str, Any]:
        """The parts whose state a checkpoint carries, by their key in the checkpoint; each has
        ``state_dict()`` and ``load_state_dict(state)``. None here."""
        return {}

    def with_part_states(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with every :meth:`checkpoint_parts` state under its key."""
        for key, part in self.checkpoint_parts().items():
            checkpoint[key] = part.state_dict()
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Lightning's checkpoint plus the :meth:`checkpoint_parts` states (rank 0 writes)."""
        super().save_checkpoint(self.with_part_states(checkpoint), filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Loads the checkpoint and restores the :meth:`checkpoint_parts` states it holds."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        for key, part in self.checkpoint_parts().items():
            if key in checkpoint:
                part.load_state_dict(checkpoint[key])
        return checkpoint
