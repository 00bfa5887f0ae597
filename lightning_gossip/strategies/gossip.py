"""Lightning glue shared by the gossip strategies.

:class:`GossipStrategy` does what every decentralized strategy needs and nothing
algorithm-specific: process-group set-up, one replica per rank without a DDP wrapper, the
initial broadcast and the replica-shape check, consensus weights for evaluation and
checkpoints, the final average, and consensus-distance logging. Subclasses implement
:meth:`GossipStrategy.optimizer_step` (how replicas are mixed around a local step) and may
override :meth:`GossipStrategy.quiesce` (how to quiet the network before a sync point).
"""

from __future__ import annotations

import logging
from abc import ABC
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from typing_extensions import override

import lightning_gossip.strategies.collectives as collectives
from lightning_gossip import _compat
from lightning_gossip.agreement import check_agreement, plain_repr
from lightning_gossip.flat import FlatState, flatten_module_
from lightning_gossip.liveness import Heartbeat, watched_collective
from lightning_gossip.strategies.node_averaging import NodeAverager, check_node_layout
from lightning_gossip.strategies.options import EVALUATE_CHOICES as EVALUATE_CHOICES
from lightning_gossip.strategies.options import check_options
from lightning_gossip.strategies.replicas import CONSENSUS_METRIC as CONSENSUS_METRIC
from lightning_gossip.strategies.replicas import _ReplicasMixin
from lightning_gossip.strategies.resilience import _ResilienceMixin

log = logging.getLogger(__name__)

class GossipStrategy(_ReplicasMixin, _ResilienceMixin, ParallelStrategy, ABC):
    """Base class of the decentralized strategies: one replica per rank, mixed by gossip.

    Args:
        final_average: at the end of ``fit`` replace every replica by the exact average of all
            replicas (one all-reduce), so every rank holds the same model.
        evaluate: ``"consensus"`` (default) runs validation and test on the average of the
            replicas, restoring the local replicas afterwards; ``"local"`` evaluates each rank's
            own replica (metrics logged with ``sync_dist=True`` are then averaged over ranks).
        consensus_every_n_steps: log ``gossip/consensus_distance`` every this many optimizer
            steps (one all-reduce of the model each time); ``None`` disables it.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: limit for every blocking wait (process-group set-up and gossip).
        heartbeat_timeout: seconds without a heartbeat after which a peer that this rank waits
            for counts as frozen, killed or cut off: the wait fails naming it (see
            ``docs/faults.md``). ``None`` disables the heartbeat (waits then end only at
            ``timeout``).
    """

    #: The constructor options every rank must give alike, compared at set-up by
    #: :meth:`gossip_config` (with the strategy, the world and node sizes, the backend and the
    #: timeout). Each subclass lists its own; an attribute not listed here is never compared.
    AGREED_OPTIONS: ClassVar[tuple[str, ...]] = (
        "final_average", "evaluate", "consensus_every_n_steps", "heartbeat_timeout")

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        final_average: bool = True,
        evaluate: str = "consensus",
        consensus_every_n_steps: int | None = 100,
        process_group_backend: str | None = None,
        timeout: timedelta | float = default_pg_timeout,
        heartbeat_timeout: float | None = 60.0,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        timeout = check_options(evaluate=evaluate, consensus_every_n_steps=consensus_every_n_steps,
                                process_group_backend=process_group_backend, timeout=timeout,
                                heartbeat_timeout=heartbeat_timeout)
        self.final_average = bool(final_average)
        self.evaluate = evaluate
        self.consensus_every_n_steps = consensus_every_n_steps
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.heartbeat_timeout = None if heartbeat_timeout is None else float(heartbeat_timeout)
        #: this rank's :class:`~lightning_gossip.liveness.Heartbeat` (after set-up, if enabled)
        self.heartbeat: Heartbeat | None = None
        #: averaging inside the node (hierarchical gossip, after set-up); ``None`` when flat
        self.node: NodeAverager | None = None
        self._num_nodes = 1
        self._flat: FlatState | None = None
        #: flat storage (docs/architecture.md): at set-up, move the replica's parameters and
        #: floating buffers into one buffer per dtype (``flatten_module_``); ``False`` keeps
        #: them where they are (same results, per-tensor copies in every gossip step)
        self._flat_storage = True
        self._local_backup: Tensor | None = None
        #: optimizer steps taken so far (the ``t`` of the mixing matrix ``W_t``)
        self.step = 0
        #: the last measured consensus distance (``None`` before the first measurement)
        self.last_consensus_distance: float | None = None

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
        _compat.init_dist_connection(
            self.cluster_environment, self._process_group_backend, **kwargs
        )
        self.start_heartbeat()

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
        at every step boundary, so only an attribute read when nothing was found."""
        heartbeat = self.heartbeat
        if heartbeat is not None and heartbeat.has_finding:
            heartbeat.check(f"rank {self.global_rank} at step {step}")

    def stop_heartbeat(self, failed: bool = False) -> None:
        """Stop beating; ``failed`` also tells the peers at once that this rank is gone."""
        if self.heartbeat is not None:
            self.heartbeat.leave(failed)

    def gossip_config(self) -> dict[str, Any]:
        """This rank's gossip configuration, compared between ranks at set-up
        (:func:`~lightning_gossip.agreement.check_agreement`).

        The options named in :attr:`AGREED_OPTIONS` (plain values as they are, others by
        their ``repr``), plus the strategy, world and node sizes, the backend and the timeout.
        """
        config: dict[str, Any] = {
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "processes_per_node": self.num_processes,
            "process_group_backend": self.process_group_backend,
            "timeout_s": self.timeout.total_seconds(),
        }
        for name in self.AGREED_OPTIONS:
            value = getattr(self, name)
            plain = value is None or isinstance(value, (bool, int, float, str))
            config[name] = value if plain else plain_repr(value)
        return config

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Move the model to its device, put its parameters and floating buffers into flat
        storage (:func:`~lightning_gossip.flat.flatten_module_`, before the optimizers are
        created; with more than one process), check the replicas match, broadcast rank 0's
        initial weights and start gossip (the last two when fitting)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = _compat.layer_sync(self)
        if fitting and layer_sync:
            self.model = layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._flat_storage and self.world_size > 1:
            # before the optimizers: they see the same Parameters, now views of the buffers
            flatten_module_(self.lightning_module)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        self._flat = FlatState(self.lightning_module)
        if self.world_size == 1:
            rank_zero_warn(
                f"{type(self).__name__} is running with a single process: it trains locally "
                "without gossip."
            )
            return
        check_agreement(self.gossip_config(), self.global_rank, self.world_size)
        self._check_replicas_match()
        if fitting:
            self.install_sigterm_check(trainer)  # no per-batch collective (resilience.py)
            self._broadcast_initial_weights()
            self.setup_gossip(trainer)

    def _check_node_layout(self) -> None:
        """The same ``ValueError`` on every rank when the ranks do not form ``num_nodes`` nodes
        of ``num_processes`` (a collective: ``hierarchical`` set-up)."""
        check_node_layout(self.world_size, self.global_rank, self.node_rank, self.local_rank,
                          self.num_nodes, self.num_processes)

    def setup_gossip(self, trainer: pl.Trainer) -> None:
        """Create the subclass's process groups, buffers and threads (once per fit)."""

    @override
    def model_to_device(self) -> None:
        """Move the replica to this rank's device (no DDP wrapper)."""
        assert self.model is not None
        self.model.to(self.root_device)

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
                           timeout=self._timeout, group=group, heartbeat=beat, **kwargs)

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor:
        """All-reduce ``tensor`` in place (mean by default; ``"sum"``, ``"max"``, ... or a
        ``ReduceOp``); anything else is returned as is. A watched wait (:meth:`watched`):
        ``self.log(..., sync_dist=True)`` and early stopping's decision meet here."""
        return collectives.reduce(tensor, group, reduce_op, self.watched)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Wait for every rank (no-op without a process group); a watched wait."""
        collectives.barrier(name, self.root_device, self.watched)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (a picklable object): its pickled bytes
        are broadcast as a length and a byte tensor, each a watched wait."""
        if not _compat.distributed_is_initialized():
            return obj
        return self.broadcast_object(obj, src)

    def broadcast_object(self, obj: Any, src: int, group: Any | None = None) -> Any:
        """:meth:`broadcast` within ``group`` (``src`` is a global rank of it)."""
        return collectives.broadcast_object(obj, src, group, self.global_rank,
                                            self.root_device, self.watched)

    @override
    def teardown(self) -> None:
        """Stop gossip and the heartbeat, then Lightning's own teardown."""
        self.teardown_gossip()
        self.stop_heartbeat()
        super().teardown()

