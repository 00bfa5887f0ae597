"""Every private Lightning and torch name lightning-gossip relies on, in one place (with
:mod:`lightning_gossip._compat_loops`, re-exported here: the training loop's and logged values').

Private names change without notice between releases. Each accessor below names the versions it
was checked against; ``tests/test_compat.py`` calls every one of them, so an upgrade that
removes or renames one fails loudly there instead of deep inside a training run.

Torch names are imported eagerly; Lightning names inside the accessor, so that modules without
Lightning glue (the gossip engines, the topology tools, the CLI) need not import Lightning. The
strategies also override one protected hook, ``_configure_launcher`` (checked there too).

Checked against: lightning 2.6.6; torch 2.9.1 (the pinned set, ``make test``) and torch 2.15.0
(``make test-latest``). Every name below exists and behaves alike on both torch versions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip._compat_loops import (  # noqa: F401 - re-exported (loops, logged values)
    end_epoch_without_batches,
    epoch_end_restored,
    logged_epoch_values,
    register_epoch_values,
    reload_train_dataloader,
    validate_now,
    validation_due,
)

#: Every version the whole test suite passed on (``make test``, ``make test-latest``).
LIGHTNING_CHECKED: tuple[str, ...] = ("2.6.6",)
TORCH_CHECKED: tuple[str, ...] = ("2.9.1", "2.15.0")


def version_mismatches(installed: Mapping[str, str] | None = None) -> list[str]:
    """One line per installed Lightning/torch version outside the checked ones.

    ``installed`` maps ``"lightning"`` and ``"torch"`` to a version (default: the installed
    ones). Compares ``major.minor.patch`` only (a local build tag such as ``+cu128`` is ignored).

    >>> version_mismatches({"lightning": "2.6.6", "torch": "2.15.0+cu132"})
    []
    >>> version_mismatches({"lightning": "2.6.6", "torch": "2.12.0"})[0][:76]
    'lightning_gossip._compat was checked against torch 2.9.1 and 2.15.0, but tor'
    """
    if installed is None:
        import lightning

        installed = {"lightning": lightning.__version__, "torch": torch.__version__}
    out = []
    for name, checked in (("lightning", LIGHTNING_CHECKED), ("torch", TORCH_CHECKED)):
        version = str(installed[name])
        if version.split("+")[0] not in checked:
            out.append(
                f"lightning_gossip._compat was checked against {name} {' and '.join(checked)}, "
                f"but {name} {version} is installed: re-run tests/test_compat.py and add the "
                "version to the checked ones in lightning_gossip/_compat.py"
            )
    return out


# -- torch ----------------------------------------------------------------------------------------
def work_source_rank(work: dist.Work) -> int:
    """The group rank a finished ``irecv`` without ``src`` received from. torch 2.9.1, 2.15.0:
    ``Work._source_rank()`` (gloo only; the public ``recv`` returns it too, but only for a
    blocking receive, which cannot be given a timeout)."""
    return int(work._source_rank())


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group torch knows in this process (the default one included); empty before
    the default group exists. torch 2.9.1 and 2.15.0:
    ``torch.distributed.distributed_c10d._world.pg_map``."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map.keys())


def backend_name(group: dist.ProcessGroup) -> str:
    """The backend of ``group`` (``"gloo"``, ``"nccl"``, ...). torch 2.9.1 and 2.15.0:
    ``ProcessGroup._get_backend_name()``; ``dist.get_backend(group)`` where it is missing."""
    try:
        return str(group._get_backend_name())
    except AttributeError:
        return str(dist.get_backend(group))


_JOINED_STORE: list[dist.Store] = []  # a newcomer's view of the members' default store


def default_store() -> dist.Store:
    """The c10d key-value store of the default process group (in a process that joined a
    running fit: the members' one, :func:`use_default_store`). torch 2.9.1 and 2.15.0:
    ``torch.distributed.distributed_c10d._get_default_store()``."""
    if _JOINED_STORE:
        return _JOINED_STORE[0]
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def use_default_store(store: dist.Store) -> None:
    """From now on :func:`default_store` is ``store`` in this process: a process that joined a
    running fit has a default group of its own, but shares the members' keys (the shared
    cursor, the claims, the membership) through ``store`` (:func:`default_store_view`)."""
    _JOINED_STORE[:] = [store]


def named_group(ranks: list[int], rank: int, backend: str, store: dist.Store, name: str,
                timeout: Any) -> dist.ProcessGroup:
    """A process group over the global ``ranks`` (``rank``, this one, among them) whose keys
    live under ``name`` in ``store``: every member builds the same group from the same name,
    also a process that joined the fit later (``new_group`` names a group by a count of the
    calling process's groups, which differs between a survivor and a newcomer). The members
    meet in the group's construction (gloo connects them all); non-members do not call it.

    ``rank`` and ``ranks`` are rank *slots* (the fit's global ranks). A process that joined a
    running fit numbers its default group's members from 0 (:func:`join_as_default_group`), so
    its default-group rank can differ from its slot when slots are free; the group's rank map
    is the slots' all the same.

    torch 2.9.1: ``distributed_c10d._new_process_group_helper(size, group_rank, ranks,
    backend, store, name, timeout=...)``, which returns a non-member unless the caller's
    default-group rank is in ``ranks`` (so it is given that rank in this process's place),
    then ``_world.pg_group_ranks`` (``new_group`` fills it after the helper, the helper does
    not).
    """
    from torch.distributed import distributed_c10d as c10d

    me = c10d._get_default_group().rank()
    listed = [me if r == rank else r for r in ranks]
    pg, _ = c10d._new_process_group_helper(len(ranks), ranks.index(rank), listed, backend,
                                          store, name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def join_as_default_group(store: dist.Store, name: str, slots: list[int], slot: int,
                          backend: str, timeout: Any) -> None:
    """Initialise this process's default group as the group the other members build with
    :func:`named_group` (``store``, ``name``) over the rank slots ``slots`` (``slot``, this
    process's, among them): a process that joins a running fit. Its members are numbered from
    0 in the default group (``dist.get_rank()`` is ``slots.index(slot)``), and
    ``dist.get_process_group_ranks(dist.group.WORLD)`` gives their slots, as for every other
    group of the fit.

    ``name`` must end in ``"default_pg/0"``: torch 2.9.1 names a new process's default group
    ``"0"`` and, given a store, prefixes nothing of its own, so its keys are
    ``<name>/`` of ``store`` when its store is ``PrefixStore(<name without "/0">, store)``;
    its rank map is ``_world.pg_group_ranks[WORLD]`` (the identity, unless set).
    """
    from torch.distributed import distributed_c10d as c10d

    head = name.removesuffix("/0")
    if head == name or not head.endswith("default_pg"):
        raise ValueError(f"a joiner's default group needs a name ending in 'default_pg/0', "
                         f"got {name!r}")
    dist.init_process_group(backend, store=dist.PrefixStore(head, store),
                            rank=slots.index(slot), world_size=len(slots), timeout=timeout)
    c10d._world.pg_group_ranks[dist.group.WORLD] = {g: i for i, g in enumerate(slots)}


def default_store_view(client: dist.Store) -> dist.Store:
    """What :func:`default_store` returns in the processes whose default group
    ``init_process_group`` made from the rendezvous store (``MASTER_ADDR``/``MASTER_PORT``),
    seen through ``client``, a new process's own client of that store (a newcomer has none yet).
    torch 2.9.1: ``init_process_group`` wraps the rendezvous store in ``PrefixStore(
    "default_pg")`` and the default group's helper in ``PrefixStore("0/")`` (its name).
    """
    return dist.PrefixStore("0/", dist.PrefixStore("default_pg", client))


def foreach_add_(tensors: list[Tensor], others: list[Tensor]) -> None:
    """``tensors[i] += others[i]`` in one fused call (torch 2.9.1 and 2.15.0:
    ``torch._foreach_add_``)."""
    torch._foreach_add_(tensors, others)


def batch_norm_base() -> type:
    """The common base class of every BatchNorm layer (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``
    and the lazy ones), for ``isinstance`` checks.

    torch 2.9.1 and 2.15.0: ``torch.nn.modules.batchnorm._BatchNorm``.

    >>> isinstance(torch.nn.BatchNorm2d(3), batch_norm_base())
    True
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


# -- Lightning ------------------------------------------------------------------------------------
def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Initialise the default process group from a cluster environment (lightning 2.6.6:
    ``lightning.fabric.utilities.distributed._init_dist_connection``)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def default_backend_for_device(device: torch.device) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise.

    lightning 2.6.6: ``lightning.fabric.utilities.distributed
    ._get_default_process_group_backend_for_device``.
    """
    from lightning.fabric.utilities.distributed import (
        _get_default_process_group_backend_for_device,
    )

    return _get_default_process_group_backend_for_device(device)


def distributed_is_initialized() -> bool:
    """Whether a default process group exists and is usable (lightning 2.6.6:
    ``lightning.fabric.utilities.distributed._distributed_is_initialized``)."""
    from lightning.fabric.utilities.distributed import _distributed_is_initialized

    return _distributed_is_initialized()


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move optimizer state to ``device`` (lightning 2.6.6:
    ``lightning.fabric.utilities.optimizer._optimizers_to_device``)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def backward_sync_control_base() -> type:
    """The base class of a Fabric strategy's ``no_backward_sync`` control (lightning 2.6.6:
    ``lightning.fabric.strategies.strategy._BackwardSyncControl``)."""
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    return _BackwardSyncControl


def subprocess_script_launcher() -> type:
    """Lightning's default launcher class (re-runs ``sys.argv`` once per local rank).

    lightning 2.6.6: ``lightning.pytorch.strategies.launchers.subprocess_script
    ._SubprocessScriptLauncher``.
    """
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    return _SubprocessScriptLauncher


def layer_sync(strategy: Any) -> Any | None:
    """The strategy's ``LayerSync`` plugin (``SyncBatchNorm``), or ``None`` (lightning 2.6.6:
    ``Strategy._layer_sync``, set by the Trainer from ``sync_batchnorm=True``)."""
    return strategy._layer_sync


def set_launcher(strategy: Any, launcher: Any) -> None:
    """Install ``launcher`` as the strategy's launcher, ``strategy.launcher`` (lightning 2.6.6:
    ``Strategy._launcher``, set from the ``_configure_launcher()`` hook)."""
    strategy._launcher = launcher


def update_dataloader(dataloader: Any, sampler: Any, mode: Any) -> Any:
    """Rebuild ``dataloader`` with another sampler, keeping every other argument.

    lightning 2.6.6: ``lightning.pytorch.utilities.data._update_dataloader``.
    """
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=mode)


def checkpoints_within_epoch(callback: Any) -> bool:
    """Whether a ``ModelCheckpoint`` saves by train steps or by wall-clock time (lightning
    2.6.6: ``ModelCheckpoint._every_n_train_steps`` and ``._train_time_interval``)."""
    return bool(callback._every_n_train_steps) or callback._train_time_interval is not None


def replace_sigterm_broadcast(trainer: Any, check: Any) -> bool:
    """Replace the per-batch SIGTERM broadcast of the training loop by ``check()``.

    lightning 2.6.6: ``_TrainingEpochLoop._broadcast_sigterm_tensor`` runs before every batch
    and broadcasts ``trainer.received_sigterm`` on the world group. Returns ``False`` when the
    loop has no such method (nothing to replace).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    epoch_loop._broadcast_sigterm_tensor = check
    return True


def slurm_requeue_signal(trainer: Any) -> int | None:
    """The signal of Lightning's SLURM auto-requeue handler, when the trainer installed it.

    lightning 2.6.6: ``_SignalConnector.register_signal_handlers`` installs, for a
    ``SLURMEnvironment(auto_requeue=True)``, a ``_HandlersCompose`` holding the connector's
    ``_slurm_sigusr_handler_fn`` for ``environment.requeue_signal`` (unless a handler was set
    already). ``None`` when that handler is not the current one.
    """
    import signal

    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(env, SLURMEnvironment) or not env.auto_requeue:
        return None
    sig = env.requeue_signal
    connector = getattr(trainer, "_signal_connector", None)
    fn = getattr(type(connector), "_slurm_sigusr_handler_fn", None)
    if sig is None or fn is None:
        return None
    handlers = getattr(signal.getsignal(sig), "signal_handlers", ())
    if any(getattr(h, "__func__", None) is fn for h in handlers):
        return int(sig)
    return None


def hpc_save_path(trainer: Any) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in ``trainer.default_root_dir`` (lightning 2.6.6:
    ``_CheckpointConnector.hpc_save_path``, what the auto-requeue handler writes)."""
    return str(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def preload_checkpoint(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Make Lightning restore ``checkpoint`` in the fit it is setting up, as if it had loaded
    it from a file (model, then optimizers, schedulers, loops, callbacks): set before the
    restore, with no ``ckpt_path``.

    lightning 2.6.6: ``trainer._checkpoint_connector._loaded_checkpoint`` (``resume_start``
    without a path leaves it, ``restore_model`` and ``restore_training_state`` read it,
    ``resume_end`` clears it).
    """
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The full Lightning checkpoint of ``trainer`` now (weights, optimizer, loops), without
    writing it.

    lightning 2.6.6: ``trainer._checkpoint_connector.dump_checkpoint(weights_only=False)``.
    """
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
