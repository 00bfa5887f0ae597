"""The library's keys in the c10d store of the default process group (:func:`default_store`):
the shared cursor's counters and claims, and an elastic fit's membership, ledger and meetings.

Every rank reaches the same store through its default group (``init_process_group`` made it; a
process that joined a running fit, or a founder, reaches the members' through
:func:`~lightning_gossip._compat.use_default_store`), so no extra rendezvous is needed.
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_gossip import _compat

__all__ = ["default_store"]


def default_store() -> dist.Store:
    """The key-value store of the default process group (created by ``init_process_group``).

    Keys are prefixed with ``lightning_gossip/`` so that they cannot collide with torch's own.
    """
    return dist.PrefixStore("lightning_gossip/", _compat.default_store())
