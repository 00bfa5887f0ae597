"""The survivors' emergency checkpoint, written before they exit on a lost rank.

A rank whose wait failed on a lost peer (:class:`~lightning_gossip.errors.PeerSilent`, or a
:class:`~lightning_gossip.errors.GossipTimeout` naming it) calls
:func:`write_emergency_checkpoint` from the strategy's ``on_exception``:

1. :func:`meet_survivors`: it announces itself in the rendezvous store
   (``lightning-gossip/emergency/<run>/<rank>``) and waits until every other rank has announced
   itself or is silent or gone (the lost ones), at most ``heartbeat_timeout + 10`` seconds. It
   keeps beating meanwhile: a survivor still waiting on it fails when its own liveness monitor
   finds the lost rank (within ``heartbeat_timeout``; every wait consults the monitor), naming
   that rank, and comes here too. Only then does it leave (marked as failed).
2. With two or more survivors, they build a gloo group of their own
   (``new_group(..., use_local_synchronization=True)``: only they take part) and average
   their replicas (bounded by :data:`MEET_TIMEOUT_S`); the lowest survivor writes the average.
   Where they cannot meet (the store's host is the lost rank, or the group fails), the lowest
   rank not known to be lost writes its own replica.
3. The file, ``emergency-step=<global_step>-rank=<writer>.ckpt``, goes next to the run's other
   checkpoints (:func:`~lightning_gossip.checkpoints.checkpoint_dir`; none with
   ``enable_checkpointing=False``: no ``ModelCheckpoint``, no file), written whole (a
   temporary file, then renamed): a full Lightning checkpoint (the writer's optimizer and loop
   state) that ``trainer.fit(ckpt_path=...)`` resumes from;
   :func:`~lightning_gossip.checkpoints.newest_checkpoint` picks it when it is the newest.
   Where the survivors met through the store, it also holds the restart position
   (:meth:`~lightning_gossip.strategies.GossipStrategy.with_restart_position`; ``adpsgd``: the
   shared cursor's position, so the restart goes on with the epoch's unclaimed batches).

The functions take values (the fit's :class:`~lightning_gossip.strategies.fit.Fit`, the step)
and small callables, never the strategy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_gossip._compat import dump_checkpoint
from lightning_gossip.checkpoints import checkpoint_dir
from lightning_gossip.errors import GossipTimeout

if TYPE_CHECKING:
    from lightning_gossip.flat import FlatState
    from lightning_gossip.liveness import Heartbeat
    from lightning_gossip.strategies.fit import Fit

#: ``restart_position(checkpoint)``: ``checkpoint`` plus the data position a restart needs
RestartPosition = Callable[[dict[str, Any]], dict[str, Any]]

log = logging.getLogger(__name__)

#: seconds the survivors give the creation of their group and its all-reduce
MEET_TIMEOUT_S = 20.0
#: seconds a survivor waits for the others beyond ``heartbeat_timeout``
EXTRA_WAIT_S = 10.0


def run_key(fit_index: int) -> str:
    """The store prefix of one fit's meeting (a torchrun restart round has its own)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"lightning-gossip/emergency/{restart}.{fit_index}"


def meet_survivors(beat: Heartbeat, rank: int, world_size: int, step: int, lost: set[int],
                   key: str) -> list[int] | None:
    """The survivors (``rank`` included), agreed through the store (``beat``'s) as the module
    docstring says; ``None`` when the store cannot be reached (also at once when ``beat``
    already found its host unreachable: the meeting goes through that store). ``step``: what
    ``rank`` announces."""
    if beat.store_unreachable:
        return None
    try:
        beat.store_call(lambda: beat.store.set(f"{key}/{rank}", str(step)),
                        "announcing a survivor")
    except GossipTimeout:
        return None
    posted: set[int] = set()
    dead = set(lost) - {rank}  # not waited for, but a survivor if it announced itself
    deadline = time.monotonic() + beat.timeout + EXTRA_WAIT_S
    try:
        while True:
            unknown = [r for r in range(world_size) if r != rank and r not in posted]
            if unknown:
                silent = set(beat.silent(unknown))
                found = beat.store_call(
                    lambda u=unknown: [bool(beat.store.check([f"{key}/{r}"])) for r in u],
                    "reading the survivors")
                posted |= {r for r, f in zip(unknown, found) if f}
                dead |= silent - posted
            pending = [r for r in unknown if r not in posted and r not in dead]
            if not pending:
                break
            if time.monotonic() > deadline:
                log.warning("rank %d: ranks %s neither announced themselves nor went silent "
                            "in time: not waiting for them", rank, pending)
                break
            time.sleep(0.2)
    except GossipTimeout:
        return None
    return sorted(posted | {rank})


def survivors_average(flat_state: FlatState, members: list[int]) -> torch.Tensor:
    """The average of the members' replicas, ``flat_state`` here (a gloo group of their own,
    bounded)."""
    timeout = timedelta(seconds=MEET_TIMEOUT_S)
    group = dist.new_group(members, backend="gloo", timeout=timeout,
                           use_local_synchronization=True)
    flat = flat_state.pack().to("cpu", torch.float32).clone()
    work = dist.all_reduce(flat, group=group, async_op=True)
    if work.wait(timeout) is False:
        raise GossipTimeout(f"the survivors {members} did not average within {timeout}",
                            members)
    return flat.div_(len(members))


def write_emergency_checkpoint(error: GossipTimeout, fit: Fit, step: int, fit_index: int, *,
                               stop_gossip: Callable[[], None],
                               restart_position: RestartPosition) -> Path | None:
    """Meet the other survivors and write the emergency checkpoint (see the module); the path
    on the rank that wrote it, else ``None``.

    Args:
        error: the failed wait, naming the lost ranks.
        fit: the fit's values (trainer, rank, replicas, heartbeat, checkpoint writer).
        step: the strategy's optimizer step (announced, and stored in the checkpoint).
        fit_index: which fit of the strategy this is (each has its own meeting).
        stop_gossip: stops the engine's communication threads (nothing more is mixed in).
        restart_position: adds the data position a restart needs.
    """
    trainer, beat, rank = fit.trainer, fit.heartbeat, fit.rank
    if (beat is None or trainer.state.fn != "fit"
            or trainer.checkpoint_callback is None):  # no checkpoints asked for
        return None
    started = time.monotonic()
    lost = set(error.ranks)
    stop_gossip()
    members = meet_survivors(beat, rank, fit.world_size, step, lost, run_key(fit_index))
    average = None
    if members is not None and len(members) >= 2:
        try:
            average = survivors_average(fit.replicas.flat, members)
        except Exception as e:  # noqa: BLE001 - fall back to this rank's replica
            log.warning("rank %d: the survivors %s could not average (%s): writing a replica",
                        rank, members, e)
    if average is not None:
        assert members is not None
        writer = members[0]
    else:
        known = set(members or ())
        writer = min(set(range(fit.world_size)) - (lost - known - {rank}))
    if rank != writer:
        return None
    path = checkpoint_dir(trainer) / (f"emergency-step={trainer.global_step}-rank={rank}.ckpt")
    _save(fit, path, average, members, step, restart_position)
    log.warning("rank %d: wrote the emergency checkpoint %s (%s) %.1f s after the error", rank,
                path, "the average of survivors " + str(members) if average is not None
                else "this rank's replica", time.monotonic() - started)
    return path


def _save(fit: Fit, path: Path, average: torch.Tensor | None, members: list[int] | None,
          step: int, restart_position: RestartPosition) -> None:
    """A full Lightning checkpoint of the current state with ``average`` as the weights (or
    the local replica), without any collective; written whole."""
    tmp = path.with_name(path.name + ".part")
    with fit.replicas.weights_as_is(average):  # no collective: not every rank is there
        ckpt = fit.part_states(dump_checkpoint(fit.trainer))  # e.g. the outer optimizer
        if members is not None:  # the store answers, and every survivor stopped claiming
            try:
                ckpt = restart_position(ckpt)
            except Exception as e:  # noqa: BLE001 - the weights matter more than the position
                log.warning("rank %d: the emergency checkpoint has no cursor position: %s",
                            fit.rank, e)
        ckpt["lightning_gossip_emergency"] = {
            "survivors": members, "averaged": average is not None, "strategy_step": step}
        path.parent.mkdir(parents=True, exist_ok=True)
        fit.checkpoint_io.save_checkpoint(ckpt, tmp)  # the state dict views the weights
    os.replace(tmp, path)
