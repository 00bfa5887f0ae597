"""Membership joins with real processes and gloo groups (``tests/test_membership_join.py``).

Started as ``srun`` starts tasks (one process each, ``RANK``/``WORLD_SIZE``/``MASTER_*``),
4 ranks: ranks 2 and 3 leave after the first all-reduce (``os._exit``; rank 2 says goodbye
in the store, as a heartbeat would find it gone); the survivors learn of rank 3's loss, find
rank 2 gone while they gather (``decide(also_lost=...)``), agree on (0, 1) and build their
groups by name; a newcomer started with ``RANK=3`` and ``JOINER=1`` asks for its slot, the
survivors admit it at their next poll with slot 2 still free, and all three build the next
generation's groups: the newcomer's default group is the first, numbering (0, 1, 3) from 0.
Every process prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_gossip import _compat
from lightning_gossip.elastic.membership import Membership
from lightning_gossip.liveness.collectives import watched_collective

TIMEOUT = timedelta(seconds=60)
RUN = "join-test"


def store_of(default: dist.Store) -> dist.Store:
    return dist.PrefixStore(f"{RUN}/", default)


def total(group: dist.ProcessGroup | None, value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, group=group)
    return t.item()


def member(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    first = total(None, rank)
    store = store_of(_compat.default_store())
    if rank == 2:
        store.set("bye/2", "1")
    if rank in (2, 3):
        os._exit(0)  # lost: no goodbye
    m = Membership(store, rank, 4, TIMEOUT, name=RUN)
    after_loss = m.decide(lost=(3,), deadline_s=60,  # rank 2's loss is found while gathering
                          also_lost=lambda missing: [r for r in missing
                                                     if store.check([f"bye/{r}"])])
    group, data = m.lightning_group("gloo"), m.named_group(1, "gloo")
    survivors_sum = total(group, rank)
    deadline = time.monotonic() + 90
    while (asked := m.poll()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no join request")
        time.sleep(0.05)
    after_join = m.decide(lost=(), joined=asked, deadline_s=60)
    group, data = m.lightning_group("gloo"), m.named_group(1, "gloo")
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=3, group=data)
    return {"rank": rank, "first": first, "after_loss": after_loss, "survivors_sum": survivors_sum,
            "asked": asked, "after_join": after_join, "joined_sum": total(group, rank + 10),
            "data_sum": total(data, rank), "generation": m.generation,
            "from_3": from_slot(group, 3, 0.0)}


def from_slot(group: dist.ProcessGroup, slot: int, value: float) -> float:
    """A broadcast over ``group`` from the process in rank slot ``slot`` (a watched
    collective, which addresses ranks by slot)."""
    t = torch.tensor([value])
    watched_collective(dist.broadcast, t, src=slot, group=group, timeout=TIMEOUT,
                       what=f"a broadcast from slot {slot}")
    return t.item()


def joiner(rank: int) -> dict:
    time.sleep(3)  # relaunched after the loss, as a scheduler would
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=TIMEOUT)
    store = store_of(_compat.default_store_view(client))
    Membership.ask_to_join(store, rank)
    m = Membership.await_admission(store, rank, 4, TIMEOUT, RUN, deadline_s=90)
    group, data = m.lightning_group("gloo", newcomer=True), m.named_group(1, "gloo")
    got = torch.zeros(1)
    dist.recv(got, src=0, group=data)
    return {"rank": rank, "after_join": m.live, "joined_sum": total(group, rank + 10),
            "default_is_group": group is dist.group.WORLD, "world": dist.get_world_size(),
            "default_rank": dist.get_rank(),
            "default_slots": dist.get_process_group_ranks(dist.group.WORLD),
            "received": got.item(), "data_sum": total(data, rank), "generation": m.generation,
            "from_3": from_slot(group, 3, 33.0)}


if __name__ == "__main__":
    r = int(os.environ["RANK"])
    out = joiner(r) if os.environ.get("JOINER") == "1" else member(r)
    print("RESULT " + json.dumps(out), flush=True)
    time.sleep(1)  # the others finish their last collective before this process goes
    os._exit(0)
