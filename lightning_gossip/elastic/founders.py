"""A fit that starts with the ranks that came (``ADPSGDStrategy`` or ``DPSGDStrategy`` with
``elastic=True, start_timeout=...``): :func:`found_fit`.

Lightning's start needs every planned rank: the default group's rendezvous waits for all of them
(for the process groups' timeout), so one task that a scheduler starts late, or not at all,
holds every other one. With ``start_timeout`` the fit's founders meet in the rendezvous store
instead, before Lightning would make its group:

1. rank 0 hosts the store itself (Lightning's launcher and ``srun`` give it the master's
   address and port; under ``torchrun`` the agent hosts it) and every process connects to it
   and says that it came;
2. rank 0 decides the fit's first generation with the rank slots that came, once every slot has,
   or once ``start_timeout`` seconds have passed and at least two came
   (:meth:`~lightning_gossip.elastic.membership.Membership.found`);
3. the founders build that generation's groups by name, the first one their default group (the
   same groups a newcomer builds: :func:`~.nodes.generation_groups`),
   and start their heartbeats, not watching the free slots.

The fit then runs as one whose free slots were lost before its first step: the shared cursor
deals out every batch among the founders, gossip pairs the founders, and a process that comes
for a free slot later (or came after the decision) joins the running fit as a replacement does
(:mod:`~.newcomer`). A process that finds a running fit of the same name is not a founder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_gossip import _compat
from lightning_gossip.elastic.membership import Membership
from lightning_gossip.elastic.newcomer import membership_store
from lightning_gossip.elastic.nodes import ElasticGroups, generation_groups
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.liveness import Heartbeat

__all__ = ["Founders", "found_fit"]


@dataclass
class Founders:
    """This process's start among the fit's founders (:func:`found_fit`).

    Attributes:
        membership: generation 0: the rank slots that came (:attr:`~.Membership.lost`: free).
        groups: its groups, by name: Lightning's (this process's default group), gossip
            control (gloo), gossip data.
        heartbeat: this process's heartbeat, beating, the free slots not watched.
        store: rank 0's: the rendezvous store it serves for the whole run (kept alive here);
            the others': their client.
        founded: the rank slots that started the fit (:attr:`membership` changes later).
    """

    membership: Membership
    groups: ElasticGroups
    heartbeat: Heartbeat
    store: dist.Store
    founded: tuple[int, ...] = ()


def found_fit(run: str, rank: int, world_size: int, address: str, port: int,
              timeout: timedelta, heartbeat_timeout: float, backend: str,
              start_timeout: float) -> Founders | None:
    """Start the fit ``run`` with the rank slots that come within ``start_timeout`` seconds (see
    the module docstring); ``None`` for a process that came after the decision (it joins the
    running fit: :func:`~.newcomer.join_running_fit`)."""
    os.environ.setdefault("MASTER_ADDR", address)  # (the heartbeat's clients connect there)
    os.environ.setdefault("MASTER_PORT", str(port))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
    store = dist.TCPStore(address, port, is_master=rank == 0 and not agent, timeout=timeout,
                          wait_for_workers=False)
    view = _compat.default_store_view(store)
    membership = Membership.found(membership_store(view, run), rank, world_size, timeout, run,
                                  start_timeout)
    if membership is None:
        return None
    _compat.use_default_store(view)  # the keys a newcomer will share (the cursor, the claims)
    groups = generation_groups(NodeLayout.flat(world_size, rank), membership, backend,
                               newcomer=True)
    heartbeat = Heartbeat.connect(rank, world_size, heartbeat_timeout, fallback=store)
    heartbeat.forget(membership.lost, mark=False)  # free slots: nobody to watch there
    heartbeat.start()
    return Founders(membership, groups, heartbeat, store, membership.live)
