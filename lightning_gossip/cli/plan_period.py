"""The gossip period section of ``lightning-gossip plan``: R of the cluster, the period that
``gossip_every_n_steps="auto"`` picks for it, and the gossip strategies at their periods
(:mod:`lightning_gossip.plan.period`; the policy is the strategies' own,
:mod:`lightning_gossip.gossip_period`). Imports neither torch nor Lightning."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from lightning_gossip import gossip_period as _policy
from lightning_gossip import plan as _plan
from lightning_gossip.cli.common import CLIError, fmt_bytes, table

__all__ = ["period_arg", "period_value", "report"]


def period_arg(text: str) -> int | str:
    """An ``argparse`` type: ``auto`` or an integer >= 1 (local steps between exchanges).

    >>> period_arg("auto"), period_arg("4")
    ('auto', 4)
    """
    try:
        return period_value(text)
    except CLIError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def period_value(value: Any) -> int | str:
    """``"auto"`` or an integer >= 1 from a flag or a ``--config`` value; :class:`CLIError`
    otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        n = None
    if n is None or n < 1:
        raise CLIError(f"gossip_every_n_steps: expected auto or an integer >= 1, got {value!r}")
    return n


def _ms(seconds: float) -> str:
    """Milliseconds with one decimal."""
    return f"{seconds * 1e3:.1f}"


def _ratio(row: _plan.Prediction) -> str:
    """R of a row: its exchange over the compute it hides behind."""
    if row.exchange_s <= 0:
        return "-"
    return "inf" if row.compute_s <= 0 else f"{row.exchange_s / row.compute_s:.2f}"


def report(v: dict[str, Any], cluster: _plan.Cluster, work: _plan.Workload, ref_step_s: float,
           stragglers: Sequence[float]) -> dict[str, Any]:
    """Print the section for the resolved values ``v`` (``ref_step_s``: ddp's ring step, the
    ``x ddp`` reference); returns it as a JSON-ready dict."""
    period = period_value(v["gossip_every_n_steps"])
    margin, longest = _policy.DEFAULT_MARGIN, _policy.DEFAULT_MAX_PERIOD
    replica_s = _plan.replica_seconds(cluster, work)
    ratio = _plan.cluster_ratio(cluster, work)
    pick = _plan.cluster_period(cluster, work, margin, longest)
    try:
        rows = _plan.predict_periods(
            cluster, work, period, topology=v["topology"], mode=v["mode"], pairing=v["pairing"],
            max_staleness=v["max_staleness"], stragglers=stragglers, seed=int(v["seed"]),
            tolerance=float(v["tolerance"]), margin=margin, max_period=longest)
    except ValueError as e:
        raise CLIError(str(e)) from None
    shown = "inf" if math.isinf(ratio) else f"{ratio:.2f}"
    print(f"\nR = {shown}: one bf16 replica ({fmt_bytes(int(work.params * 2))}) takes "
          f"{_ms(replica_s)} ms over a node's {v['inter_gbit']:g} Gbit/s link; a step computes "
          f"{v['compute_ms']:g} ms.")
    print(f'gossip_every_n_steps="auto" picks {pick} for this R: the smallest period (1 to '
          f"{longest}) whose exchange hides behind its steps' compute with margin {margin:g}.")
    label = '"auto"' if period == "auto" else str(period)
    print(f"\nThe gossip strategies at gossip_every_n_steps={label}"
          + (", each from its own exchange:" if period == "auto" else ":"))
    headers = ["strategy, period", "exchange ms", "R", "step ms", "exposed ms", "x ddp",
               "inter/node/step", "consensus steps"]
    cells = [[
        f"{r.strategy} every {r.period}", _ms(r.exchange_s), _ratio(r), _ms(r.step_s),
        _ms(r.exposed_s),
        f"{r.step_s / ref_step_s:.2f}", fmt_bytes(int(r.inter_bytes_per_node)),
        "-" if r.consensus_steps is None else (
            "inf" if math.isinf(r.consensus_steps) else str(math.ceil(r.consensus_steps - 1e-9))),
    ] for r in rows]
    print(table(headers, cells))
    print("\nexchange: one exchange as the strategy sends it (its wire dtype, peers and shards, "
          "its host work); R: exchange / the compute\nper step it hides behind; consensus "
          "steps: the mixing steps times the period. docs/plan.md, \"The gossip period\".")
    return {"ratio": ratio, "replica_s": replica_s, "replica_bytes": work.params * 2,
            "compute_s": work.compute_s, "auto_period": pick, "margin": margin,
            "max_period": longest, "gossip_every_n_steps": period,
            "rows": [r.as_dict() for r in rows]}
