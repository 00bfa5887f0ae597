"""Lightning's private loop and logged-value names, for a rank whose training epoch had no batch.

An elastic fit's shared cursor can leave a rank without a batch in an epoch (a newcomer admitted
as the cursor ran out, fewer batches left than ranks). Lightning does its epoch-end work after an
epoch's last batch, and reduces at the epoch's end the values each rank logged in it; the
accessors below let such a rank do what the others do, so that it meets them in the same
collectives. Part of :mod:`lightning_gossip._compat` (which re-exports every name here; split
off by the 350-line rule) under the same terms: checked against lightning 2.6.6, each called for
real by ``tests/test_compat.py``, Lightning imported inside the accessors.
"""

from __future__ import annotations

from typing import Any


def validate_now(trainer: Any) -> None:
    """Run the fit's validation now, as the training epoch loop does after an epoch's last
    batch (lightning 2.6.6: ``_TrainingEpochLoop.on_advance_end``, keeping the logger
    connector's ``_first_loop_iter``; ``val_loop`` stops restarting once training goes on)."""
    loop, connector = trainer.fit_loop.epoch_loop, trainer._logger_connector
    first, trainer.validating = connector._first_loop_iter, True
    loop.val_loop.restarting = False
    loop.val_loop.run()
    trainer.training, connector._first_loop_iter = True, first


def reload_train_dataloader(trainer: Any) -> None:
    """Make the fit build its training loader again (an elastic fit's, once its shared cursor is
    set up: ``estimated_stepping_batches`` in ``configure_optimizers`` builds it during the
    strategy's set-up). lightning 2.6.6: ``setup_data`` builds it once, when this is None."""
    trainer.fit_loop._combined_loader = None


def epoch_end_restored(trainer: Any) -> bool:
    """Whether the fit's restored training epoch had trained its last batch (a checkpoint of
    an epoch's end; lightning 2.6.6: the epoch loop's ``batch_progress`` before its reset)."""
    p = trainer.fit_loop.epoch_loop.batch_progress
    return bool(p.is_last_batch and 0 < p.current.ready == p.current.completed)


def end_epoch_without_batches(trainer: Any) -> None:
    """What the training epoch loop does after an epoch's last batch, for a rank whose epoch had
    none (an elastic fit's shared cursor left it none; lightning 2.6.6): step the epoch-interval
    schedulers but ``ReduceLROnPlateau`` (``update_lr_schedulers``), and let every
    ``ModelCheckpoint`` save at this epoch's end though the global step did not move (it skips
    the step it last saved at, ``_last_global_step_saved``; the others save: a collective)."""
    trainer.fit_loop.epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)
    for callback in trainer.checkpoint_callbacks:
        callback._last_global_step_saved = -1


def validation_due(trainer: Any) -> bool:
    """Whether the fit validates after this epoch's last batch (lightning 2.6.6: the training
    epoch loop's ``_should_check_val_epoch``; with ``val_check_interval=1.0``)."""
    return bool(trainer.fit_loop.epoch_loop._should_check_val_epoch())


def logged_epoch_values(trainer: Any) -> dict[str, Any]:
    """What this rank logged in the current training epoch that Lightning reduces across the
    ranks at the epoch's end, as picklable values (for :func:`register_epoch_values` on a rank
    that logged none of it): ``{"order": every key of the epoch's results, in their order,
    "reduced": [one dict per value: its key and ``self.log``'s arguments]}``.

    Reduced at the epoch's end: a value logged with ``on_epoch=True, sync_dist=True`` (the
    strategy's ``reduce``) and a torchmetrics ``Metric`` logged with ``on_epoch=True`` (its own
    gather). Left out: a value given its own ``sync_dist_group`` (a process group does not
    travel). lightning 2.6.6: the training epoch loop's ``_results``, a ``_ResultCollection``
    of ``_ResultMetric`` keyed ``"{fx}.{name}"``; ``has_reset``: not logged since the epoch
    began.
    """
    results = trainer.fit_loop.epoch_loop._results
    reduced = []
    for key, entry in results.items():
        meta = entry.meta
        if (entry.has_reset or not meta.on_epoch or meta.sync.group is not None
                or (entry.is_tensor and not meta.sync.should)):
            continue
        reduced.append({
            "key": key, "tensor": entry.is_tensor, "sync_dist": meta.sync.should,
            "rank_zero_only": meta.sync.rank_zero_only, "reduce_fx": meta.reduce_fx.__name__,
            **{name: getattr(meta, name) for name in (
                "fx", "name", "prog_bar", "logger", "on_step", "on_epoch", "enable_graph",
                "add_dataloader_idx", "dataloader_idx", "metric_attribute")}})
    return {"order": list(results), "reduced": reduced}


def register_epoch_values(trainer: Any, logged: dict[str, Any]) -> list[str]:
    """Take part in the epoch-end reductions of the values another rank ``logged``
    (:func:`logged_epoch_values`) though this rank logged none of them in the epoch: each is
    registered in its reset state (or, logged in an earlier epoch, made current again), which
    adds nothing to a reduction (a sum and a batch count of 0, a maximum of -inf, a metric's
    reset states); the epoch's results are put in the other rank's order, in which Lightning
    reduces them. A metric is the module's attribute ``metric_attribute``; one the module does
    not have is left out. Returns the keys registered.

    lightning 2.6.6: ``_ResultMetric(_Metadata, is_tensor)`` with a ``_Sync`` through the
    strategy's ``reduce``, as ``LightningModule.log`` builds them; a metric's update count set
    to 1 so that computing it does not warn that it was never updated.
    """
    from lightning.pytorch.trainer.connectors.logger_connector.result import (
        _Metadata,
        _ResultMetric,
        _Sync,
    )

    results = trainer.fit_loop.epoch_loop._results
    modules = dict(trainer.lightning_module.named_modules())
    registered = []
    for value in logged["reduced"]:
        key, entry = value["key"], results.get(value["key"])
        if entry is not None and not entry.has_reset:
            continue  # logged in this epoch after all: it takes part already
        if entry is None:
            meta = _Metadata(**{name: value[name] for name in (
                "fx", "name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx",
                "enable_graph", "add_dataloader_idx", "dataloader_idx", "metric_attribute")})
            meta.sync = _Sync(fn=trainer.strategy.reduce, _should=value["sync_dist"],
                              rank_zero_only=value["rank_zero_only"])
            entry = _ResultMetric(meta, value["tensor"])
            if not value["tensor"]:
                metric = modules.get(value["metric_attribute"] or "")
                if metric is None:
                    continue
                entry.value = metric
            results[key] = entry.to(trainer.strategy.root_device)
        entry.has_reset, entry._computed = False, None
        for part in [entry] if value["tensor"] else [entry, entry.value]:
            part._update_count = max(part._update_count, 1)
        registered.append(key)
    order = {key: i for i, key in enumerate(logged["order"])}
    entries = sorted(results.items(), key=lambda item: order.get(item[0], len(order)))
    results.clear()
    results.update(entries)
    return registered
