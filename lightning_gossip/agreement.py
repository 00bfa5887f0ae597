"""Configuration agreement: every rank must run the same gossip configuration.

Two ranks given a different ``topology``, ``seed`` or ``pairing`` would mix with different
matrices (or wait for partners that never call) and train wrong or hang, silently. At set-up
every rank contributes its configuration (a flat dict of plain values, see
:meth:`~lightning_gossip.strategies.gossip.GossipStrategy.gossip_config`) to one
``all_gather_object``, and every rank fails with the same message listing each difference.

Example::

    >>> configs = [{"seed": 0, "topology": "ring"}, {"seed": 0, "topology": "ring"},
    ...            {"seed": 5, "topology": "ring"}]
    >>> config_differences(configs)
    ['seed: 0 on rank(s) 0, 1; 5 on rank(s) 2']
    >>> config_differences(configs[:2])
    []
    >>> config_outliers(configs)
    [2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lightning_gossip.errors import ConfigMismatch

__all__ = ["ConfigMismatch", "check_agreement", "config_differences", "config_outliers",
           "plain_repr"]


def config_differences(configs: Sequence[dict[str, Any]]) -> list[str]:
    """One line per key whose value is not the same on every rank (``configs[r]`` is rank r's).

    A key missing on a rank counts as the value ``<missing>``. Values are compared by ``repr``.
    """
    keys = sorted({k for c in configs for k in c})
    out = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, config in enumerate(configs):
            value = repr(config[key]) if key in config else "<missing>"
            by_value.setdefault(value, []).append(rank)
        if len(by_value) > 1:
            parts = [f"{v} on rank(s) {', '.join(map(str, ranks))}"
                     for v, ranks in by_value.items()]
            out.append(f"{key}: {'; '.join(parts)}")
    return out


def config_outliers(configs: Sequence[dict[str, Any]]) -> list[int]:
    """The ranks whose configuration differs from the most common one (``configs[r]`` is rank
    r's; on a tie, the one of the lowest rank counts as the most common): the ranks a
    :class:`ConfigMismatch` blames. Configurations are compared by ``repr`` of their items.
    """
    keys = [repr(sorted(c.items())) for c in configs]
    counts = {k: keys.count(k) for k in keys}
    common = max(keys, key=lambda k: counts[k])  # the first of the most common: lowest rank
    return [r for r, k in enumerate(keys) if k != common]


def check_agreement(config: dict[str, Any], rank: int, world_size: int,
                    group: dist.ProcessGroup | None = None) -> None:
    """Gather every rank's ``config`` (a collective) and raise :class:`ConfigMismatch` on every
    rank when they differ, with one line per differing key."""
    if world_size <= 1:
        return
    # (``group``'s members: fewer than ``world_size`` where a fit started with the ranks that
    # came, lightning_gossip.elastic.founders)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, config, group=group)
    diffs = config_differences(gathered)
    if diffs:
        lines = "\n  ".join(diffs)
        raise ConfigMismatch(
            f"rank {rank}: the gossip configuration differs between ranks (every rank must "
            f"be given the same strategy arguments, world and node sizes):\n  {lines}", diffs,
            config_outliers(gathered))


def plain_repr(value: Any) -> str:
    """``repr`` of a configuration value; arrays (explicit mixing matrices) by their contents,
    objects without a meaningful ``repr`` by their type's name."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text
