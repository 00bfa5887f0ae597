"""A process that joins a running elastic fit (``ADPSGDStrategy`` or ``DPSGDStrategy`` with
``elastic=True``):
:func:`join_running_fit` and the state it is handed (:func:`hand_over`).

A scheduler restarts a lost task with the lost rank's environment (``RANK`` or
``SLURM_PROCID``, the world size, the master's address and port). Before Lightning would start
a new fit, the strategy of such a process looks in the rendezvous store (a client of its own)
for a running elastic fit of the same name whose members do not include this rank. If there is
one, the process

1. starts its heartbeat (so that the members, who stopped watching this rank when it was lost,
   find it beating when they watch it again);
2. asks for its rank slot and waits until the members admit it: they find the request at a
   step boundary (at most a second late) and decide the next generation with it
   (:class:`~lightning_gossip.elastic.membership.Membership`);
3. builds the generation's groups with them, its default group being the first (Lightning's
   collectives then run over it, and Lightning starts no group of its own);
4. receives from the lowest member the state it resumes from: a full Lightning checkpoint whose
   weights are the members' exact average (optimizer, schedulers, loops and callbacks are that
   member's), and that member's optimizer step. Lightning restores it as it restores a
   checkpoint file; gossip starts at that step with a pairing over every live rank.

Other slots may still be free after the join (two ranks lost, one replaced so far): the
newcomer's default group numbers the live ranks from 0 (``dist.get_rank()`` is its position
among them), while every group's rank map, the library's and torch's for its named groups,
stays in rank slots (:func:`~lightning_gossip._compat.join_as_default_group`; the watched
collectives address ranks by slot). A process whose slot is taken, or that finds no
running fit, starts as usual.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_gossip import _compat
from lightning_gossip.consensus import all_average
from lightning_gossip.elastic.membership import Membership
from lightning_gossip.elastic.nodes import ElasticGroups, generation_groups
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.liveness import Heartbeat

__all__ = ["MembersSide", "Newcomer", "hand_over", "join_running_fit", "membership_store"]

HANDOVER_TAG = "lightning_gossip.handover"
"""What the lowest member sends a newcomer: ``{"checkpoint": ..., "step": ...}``."""


def membership_store(default_store: dist.Store, run: str) -> dist.Store:
    """The store of the fit ``run``'s :class:`Membership`, under the library's default store
    (``cursor.store.default_store()``'s, seen from a member or a newcomer alike)."""
    return dist.PrefixStore(f"elastic/{run}/", dist.PrefixStore("lightning_gossip/",
                                                                 default_store))


@dataclass
class Newcomer:
    """A process admitted to a running fit (:func:`join_running_fit`).

    Attributes:
        membership: its view of the fit (live ranks, generation, the groups' names).
        groups: the generation's groups, by name: Lightning's (this process's default group),
            gossip control (gloo), gossip data (hierarchical: and its node's,
            :func:`~.nodes.generation_groups`).
        heartbeat: its heartbeat, already beating.
        checkpoint: the checkpoint it resumes from (weights: the members' exact average).
        step: the lowest member's optimizer step at the handover.
    """

    membership: Membership
    groups: ElasticGroups
    heartbeat: Heartbeat
    checkpoint: dict[str, Any]
    step: int


def join_running_fit(run: str, rank: int, world_size: int, address: str, port: int,
                     timeout: timedelta, heartbeat_timeout: float,
                     backend: str, layout: NodeLayout | None = None,
                     synchronous: bool = False) -> Newcomer | None:
    """Join the running elastic fit ``run`` in rank slot ``rank`` (see the module docstring);
    ``None`` when no such fit runs, or it already counts this rank (a normal start). Rank 0
    hosts the store under Lightning's launcher and ``srun``: it never joins. ``layout``: the
    fit's nodes (hierarchical: the node's group too; the members admit a node once all of its
    processes asked; ``None``: each rank alone); ``synchronous``: hierarchical ``dpsgd``'s
    groups too (:func:`~.nodes.generation_groups`)."""
    if rank == 0 or world_size < 2:
        return None
    client = dist.TCPStore(address, port, is_master=False, timeout=timeout,
                           wait_for_workers=False)
    store = membership_store(_compat.default_store_view(client), run)
    live = Membership.running(store)
    if live is None or rank in live:
        return None
    os.environ.setdefault("MASTER_ADDR", address)
    os.environ.setdefault("MASTER_PORT", str(port))
    heartbeat = Heartbeat.connect(rank, world_size, heartbeat_timeout, fallback=client)
    heartbeat.start()
    Membership.ask_to_join(store, rank)
    membership = Membership.await_admission(store, rank, world_size, timeout, run,
                                            deadline_s=timeout.total_seconds())
    heartbeat.forget(membership.lost, mark=False)  # free slots: nobody to watch there
    groups = generation_groups(layout or NodeLayout.flat(world_size, rank), membership, backend,
                               synchronous=synchronous, newcomer=True)
    _compat.use_default_store(_compat.default_store_view(client))  # the members' keys
    payload: list[Any] = [None]
    lowest = min(r for r in membership.live if r != rank)
    dist.recv_object_list(payload, group_src=membership.live.index(lowest),
                          group=groups.lightning)
    handed = payload[0]
    if not isinstance(handed, dict) or handed.get("tag") != HANDOVER_TAG:
        raise RuntimeError(f"rank {rank}: the handover from the running fit is malformed")
    return Newcomer(membership, groups, heartbeat, handed["checkpoint"], int(handed["step"]))


def hand_over(flat: Tensor, old_group: Any, new_group: Any, newcomers: list[int], lowest: bool,
              checkpoint: Any, step: int, timeout: timedelta) -> None:
    """The members' side of a join: the exact average of the members' replicas ``flat`` over
    ``old_group`` (a collective of the members), then the lowest member sends each newcomer
    ``checkpoint(average)`` (a full Lightning checkpoint whose weights are the average) and
    ``step`` over ``new_group``."""
    average = all_average(flat, old_group, timeout=timeout, what="averaging for a newcomer")
    if not lowest:
        return
    payload = {"tag": HANDOVER_TAG, "checkpoint": checkpoint(average), "step": step}
    for rank in newcomers:
        dist.send_object_list([payload], dst=rank, group=new_group)


class MembersSide:
    """The members' side of a join (the survivors' ``hand_over``): the exact average of
    ``pack()`` over the members, and the lowest member's ``checkpoint(average)`` with it, at
    the session's step (:func:`hand_over`).

    Args:
        session: the fit's session (the step handed over).
        pack: this member's replica, flat (:meth:`~lightning_gossip.flat.FlatState.pack`).
        checkpoint: ``(average)``: a full checkpoint whose weights are ``average`` (the
            adapter's: Lightning's, with the replica swapped for the average).
        timeout: the average's timeout.
    """

    def __init__(self, session: ElasticSession, pack: Callable[[], Tensor],
                 checkpoint: Callable[[Tensor], Any], timeout: timedelta) -> None:
        self.session, self.pack, self.checkpoint, self.timeout = (session, pack, checkpoint,
                                                                  timeout)

    def __call__(self, old: Any, new: Any, newcomers: list[int], lowest: bool) -> None:
        hand_over(self.pack(), old, new, newcomers, lowest, self.checkpoint, self.session.step,
                  self.timeout)
