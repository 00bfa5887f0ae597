"""Collectives that watch the heartbeats (:func:`watched_collective`), and groups kept alive after
an abandoned collective (:func:`keep_alive_at_exit`; a thread still waiting in one at exit is
dealt with by :mod:`lightning_gossip.liveness.at_exit`)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_gossip.liveness import at_exit
from lightning_gossip.liveness.heartbeat import Heartbeat, current
from lightning_gossip.liveness.waits import wait_for_peers

__all__ = ["keep_alive_at_exit", "watched_collective"]


def watched_collective(collective: Callable[..., Any], *args: Any, what: str,
                       timeout: timedelta, group: dist.ProcessGroup | None = None,
                       heartbeat: Heartbeat | None = None, **kwargs: Any) -> None:
    """Run a collective in which every rank of ``group`` meets (``all_reduce``, ``broadcast``,
    ``barrier``, ...) and wait for it like a gossip wait: a rank of the group that stops
    beating makes every other one fail with :class:`PeerSilent` naming it (and ``what``)
    within about ``heartbeat.timeout``, instead of waiting for ``timeout``.

    ``collective(*args, group=group, async_op=True, **kwargs)`` must return a ``dist.Work``.
    A ``src`` or ``dst`` is a rank slot (the fit's global rank), given to torch as its rank in
    ``group``: a process that joined a running fit with slots free numbers its default group
    from 0, which torch's own translation of a global rank does not know. Without a heartbeat
    (``heartbeat`` and :func:`current` both ``None``) it is a plain wait with ``timeout``.
    Example, the exact average of the replicas at a checkpoint::

        out = flat.clone()
        watched_collective(dist.all_reduce, out, op=dist.ReduceOp.SUM, timeout=self.timeout,
                           what=f"rank {rank} averaging the replicas for a checkpoint")
        out.div_(world_size)
    """
    beat = heartbeat if heartbeat is not None else current()
    members = dist.get_process_group_ranks(group or dist.group.WORLD)  # rank slots
    for key in ("src", "dst"):
        if key in kwargs:
            kwargs[f"group_{key}"] = members.index(kwargs.pop(key))
    work = collective(*args, group=group, async_op=True, **kwargs)
    me = members[dist.get_rank(group)]
    try:
        wait_for_peers([work], [r for r in members if r != me], beat, timeout, what)
    except BaseException:
        keep_alive_at_exit(group)
        raise



def keep_alive_at_exit(group: Any) -> None:
    """Never destroy ``group`` (``None``: the default group): a collective on it was abandoned
    (also any object that holds such work, e.g. an abandoned gossip engine).

    Gloo runs a collective on the process group's worker threads, and the group's destructor
    joins them: with a peer frozen, the abandoned collective keeps its thread until the group's
    ``timeout``, so the interpreter's exit would hang that long after the error was raised
    (measured: a rank that named a frozen peer then hung at exit until its test killed it, 7
    minutes later). One extra reference, never released, lets the process exit at once; the
    operating system reclaims the group. ``ProcessGroupGloo.abort()`` does not release the
    thread (measured, torch 2.9).
    """
    import ctypes

    pg = group if group is not None else dist.group.WORLD
    if pg is None or not at_exit.keep(pg):  # (released at exit when a thread still waits)
        return
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
