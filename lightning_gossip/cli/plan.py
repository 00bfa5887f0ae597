"""``lightning-gossip plan``: predicted time per step of every strategy on a cluster, from the
cost model of :mod:`lightning_gossip.plan` (imports neither torch nor Lightning)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from lightning_gossip import plan as _plan
from lightning_gossip import topology as _topology
from lightning_gossip.cli import plan_period
from lightning_gossip.cli.common import (
    CLIError,
    check_writable,
    count,
    fmt_bytes,
    jsonable,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    table,
)

__all__ = ["DEFAULTS", "add_parser", "run"]

#: values of the flags not given on the command line nor in ``--config``
DEFAULTS: dict[str, Any] = {
    "nodes": 16, "gpus_per_node": 8, "params": 43_000_000, "compute_ms": 200.0,
    "wire_dtype": "fp32", "inter_gbit": 25.0, "inter_latency_us": 10.0,
    "intra_gbyte": 150.0, "intra_latency_us": 5.0, "topology": "random_ring",
    "mode": "overlap", "pairing": "ring", "max_staleness": 4, "stragglers": "0:1",
    "seed": 0, "tolerance": 1e-3, "overlap": 1.0, "host_gbyte": None,
    "ddp_host_gbyte": None, "exchange_efficiency": 1.0, "gossip_every_n_steps": "auto",
}
_WIRE = {"fp32": 4, "bf16": 2, "fp16": 2}


def _unit_interval(text: str) -> float:
    """An ``argparse`` type: a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return v


def _efficiency(text: str) -> float:
    """An ``argparse`` type: a number in (0, 1]."""
    v = _unit_interval(text)
    if v == 0.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return v
_PLOT_NODES = [8, 16, 32, 64, 128, 256, 512, 1024]
_FLAT_PLOT_LIMIT = 2048  # flat dpsgd points above this many ranks are not computed


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to ``sub``."""
    p = sub.add_parser(
        "plan", help="predicted step time of every strategy on a cluster (cost model)",
        description="Predict the time per optimizer step of ddp, dpsgd and adpsgd (flat and "
                    "hierarchical) from an alpha-beta model of the intra- and inter-node links "
                    "(docs/plan.md). Values come from the flags, else from --config, else the "
                    "defaults shown.",
    )
    d = DEFAULTS
    p.add_argument("--config", metavar="FILE.yaml",
                   help="YAML (or JSON) mapping of option names (e.g. nodes: 16, inter_gbit: "
                        "25) used where a flag is not given")
    p.add_argument("--nodes", type=positive_int, help=f"nodes (default {d['nodes']})")
    p.add_argument("--gpus-per-node", type=positive_int,
                   help=f"GPUs (ranks) per node (default {d['gpus_per_node']})")
    p.add_argument("--params", type=count, metavar="COUNT",
                   help="model parameters, e.g. 43M (default 43M, the SWB-2000 BLSTM)")
    p.add_argument("--compute-ms", type=non_negative_float,
                   help=f"forward+backward+step per rank, ms (default {d['compute_ms']:g})")
    p.add_argument("--wire-dtype", choices=list(_WIRE), help="gossip wire dtype (default fp32)")
    p.add_argument("--inter-gbit", type=positive_float,
                   help=f"inter-node bandwidth per node, Gbit/s (default {d['inter_gbit']:g})")
    p.add_argument("--inter-latency-us", type=non_negative_float,
                   help=f"inter-node latency, us (default {d['inter_latency_us']:g})")
    p.add_argument("--intra-gbyte", type=positive_float,
                   help=f"intra-node bandwidth per GPU, GB/s (default {d['intra_gbyte']:g})")
    p.add_argument("--intra-latency-us", type=non_negative_float,
                   help=f"intra-node latency, us (default {d['intra_latency_us']:g})")
    p.add_argument("--overlap", type=_unit_interval,
                   help="fraction of the communication scheduled against compute that is "
                        "really hidden (default 1: GPUs; CPU ranks sharing cores: lower, "
                        "docs/plan.md)")
    p.add_argument("--host-gbyte", type=positive_float,
                   help="GB/s one rank's CPU moves through the communication stack (gloo on "
                        "CPUs); every byte sent or received costs compute time (default: "
                        "free, NCCL on GPUs)")
    p.add_argument("--ddp-host-gbyte", type=positive_float,
                   help="the same for ddp's gradient all-reduce (default: --host-gbyte)")
    p.add_argument("--exchange-efficiency", type=_efficiency,
                   help="fraction of the inter-node rate one process's gossip exchanges get, "
                        "both directions at once (default 1: full duplex; 0.45 calibrated on "
                        "the emulated cluster, docs/plan.md)")
    p.add_argument("--topology", choices=list(_topology.TOPOLOGIES),
                   help=f"dpsgd topology (default {d['topology']})")
    p.add_argument("--mode", choices=list(_plan.MODES),
                   help="dpsgd gossip scheduling (default overlap, the strategy's default)")
    p.add_argument("--pairing", choices=["ring", "random"], help="adpsgd pairing (default ring)")
    p.add_argument("--max-staleness", type=non_negative_int,
                   help=f"adpsgd max_staleness (default {d['max_staleness']})")
    p.add_argument("--stragglers", metavar="FRACTION:SLOWDOWN",
                   help="a fraction of the ranks this many times slower, e.g. 0.05:2 "
                        "(default none)")
    p.add_argument("--gossip-every-n-steps", type=plan_period.period_arg, metavar="N|auto",
                   help="local steps between gossip exchanges in the period table (default "
                        "auto: the period the strategies' auto mode picks for each)")
    p.add_argument("--seed", type=int, help="seed of random topologies (default 0)")
    p.add_argument("--tolerance", type=float,
                   help="consensus error reduction for the steps column (default 1e-3)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw predicted step time vs nodes (8 to 1024)")
    p.add_argument("--json", metavar="FILE.json", help="also write the rows as JSON")
    p.set_defaults(func=run)
    return p


def _load_config(path: str) -> dict[str, Any]:
    """The mapping in ``path`` (YAML if PyYAML is installed, else JSON), keys checked."""
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--config {path}: no such file")
    text = p.read_text()
    try:
        import yaml

        data = yaml.safe_load(text)
    except ImportError:  # pragma: no cover - PyYAML is a dependency of Lightning
        data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml's errors have no common public base here
        raise CLIError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise CLIError(f"--config {path}: expected a mapping of option names to values")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise CLIError(f"--config {path}: unknown option(s) {', '.join(unknown)}; "
                       f"known: {', '.join(DEFAULTS)}")
    return data


def _stragglers(text: str, cluster: _plan.Cluster) -> Any:
    """Per-rank compute factors from ``FRACTION:SLOWDOWN``."""
    try:
        fraction, slowdown = (float(x) for x in str(text).split(":"))
    except ValueError:
        raise CLIError(
            f"--stragglers: expected FRACTION:SLOWDOWN such as 0.05:2, got {text!r}"
        ) from None
    try:
        return _plan.straggler_factors(cluster.world_size, cluster.gpus_per_node, fraction,
                                       slowdown)
    except ValueError as e:
        raise CLIError(f"--stragglers: {e}") from None


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Flags over ``--config`` over :data:`DEFAULTS`."""
    values = dict(DEFAULTS)
    if args.config:
        values.update(_load_config(args.config))
    values.update({k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None})
    return values


def _model(v: dict[str, Any], nodes: int | None = None) -> tuple[_plan.Cluster, _plan.Workload]:
    """The cluster and workload of the resolved values (``ValueError`` -> :class:`CLIError`)."""
    if v["wire_dtype"] not in _WIRE:
        raise CLIError(f"wire_dtype must be one of {', '.join(_WIRE)}, got {v['wire_dtype']!r}")
    host = v["host_gbyte"]
    if host is not None and not (isinstance(host, (int, float)) and 0 < host < math.inf):
        raise CLIError(f"host_gbyte must be a positive number (or omitted: free), got {host!r}")
    ddp_host = v["ddp_host_gbyte"]
    if ddp_host is not None and not (isinstance(ddp_host, (int, float)) and 0 < ddp_host):
        raise CLIError("ddp_host_gbyte must be a positive number (or omitted: host_gbyte), "
                       f"got {ddp_host!r}")
    try:
        cluster = _plan.Cluster(
            nodes=v["nodes"] if nodes is None else nodes, gpus_per_node=v["gpus_per_node"],
            inter_bandwidth=float(v["inter_gbit"]) * 1e9 / 8,
            inter_latency=float(v["inter_latency_us"]) * 1e-6,
            intra_bandwidth=float(v["intra_gbyte"]) * 1e9,
            intra_latency=float(v["intra_latency_us"]) * 1e-6,
            overlap=float(v["overlap"]),
            host_bandwidth=math.inf if host is None else float(host) * 1e9,
            ddp_host_bandwidth=None if ddp_host is None else float(ddp_host) * 1e9,
            exchange_efficiency=float(v["exchange_efficiency"]),
        )
        work = _plan.Workload(params=int(v["params"]), compute_s=float(v["compute_ms"]) / 1e3,
                              wire_bytes=_WIRE[v["wire_dtype"]])
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None
    return cluster, work


def _predict(v: dict[str, Any], cluster: _plan.Cluster, work: _plan.Workload,
             tolerance: float | None) -> list[_plan.Prediction]:
    """:func:`lightning_gossip.plan.predict_all` with the resolved values."""
    try:
        return _plan.predict_all(
            cluster, work, topology=v["topology"], mode=v["mode"], pairing=v["pairing"],
            max_staleness=v["max_staleness"], stragglers=_stragglers(v["stragglers"], cluster),
            seed=int(v["seed"]), tolerance=tolerance,
        )
    except ValueError as e:
        raise CLIError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """Run ``lightning-gossip plan``; returns the exit code."""
    plot = check_writable(args.plot, "--plot")
    out_json = check_writable(args.json, "--json")
    v = _resolve(args)
    if not 0.0 < float(v["tolerance"]) < 1.0:
        raise CLIError(f"tolerance must be in (0, 1), got {v['tolerance']}")
    cluster, work = _model(v)
    rows = _predict(v, cluster, work, float(v["tolerance"]))
    plan_period.period_value(v["gossip_every_n_steps"])  # a bad --config value fails first
    ref = rows[0].step_s
    headers = ["strategy", "step ms", "exposed ms", "x ddp", "inter/rank/step",
               "inter/node/step", "consensus steps", "note"]
    cells = [[
        r.strategy, f"{r.step_s * 1e3:.1f}", f"{r.exposed_s * 1e3:.1f}", f"{r.step_s / ref:.2f}",
        fmt_bytes(int(r.inter_bytes_per_rank)), fmt_bytes(int(r.inter_bytes_per_node)),
        "-" if r.consensus_steps is None else (
            "inf" if math.isinf(r.consensus_steps) else str(math.ceil(r.consensus_steps - 1e-9))),
        r.note,
    ] for r in rows]
    print(f"{cluster.nodes} nodes x {cluster.gpus_per_node} GPUs, {work.params:,} parameters, "
          f"{v['compute_ms']:g} ms compute, {v['wire_dtype']} wire; inter {v['inter_gbit']:g} "
          f"Gbit/s + {v['inter_latency_us']:g} us, intra {v['intra_gbyte']:g} GB/s + "
          f"{v['intra_latency_us']:g} us; overlap {float(v['overlap']):g}, host "
          f"{'free' if v['host_gbyte'] is None else str(v['host_gbyte']) + ' GB/s'}"
          + ("" if v["ddp_host_gbyte"] is None else f" (ddp {v['ddp_host_gbyte']} GB/s)")
          + f", exchange efficiency {float(v['exchange_efficiency']):g}; "
          f"stragglers {v['stragglers']}")
    print(table(headers, cells))
    print("\nstep: predicted time per optimizer step (adpsgd: world size / sum of the ranks' "
          "rates); exposed: step - compute;\ninter: bytes sent on inter-node links; consensus "
          f"steps: mixing steps to cut the consensus error by {float(v['tolerance']):g} "
          "(as `topologies`).\nModel and what it ignores: docs/plan.md.")
    period = plan_period.report(v, cluster, work, ref, _stragglers(v["stragglers"], cluster))
    if out_json is not None:
        out_json.write_text(json.dumps({"args": jsonable(vars(args)), "values": v,
                                        "rows": [r.as_dict() for r in rows],
                                        "period": period}, indent=1))
        print(f"wrote {out_json}")
    if plot is not None:
        _plot(v, plot)
        print(f"wrote {plot}")
    return 0


def _plot(v: dict[str, Any], path: Path) -> None:
    """Predicted step time of every strategy against the number of nodes (8 to 1024)."""
    from lightning_gossip.cli.plotting import pyplot

    plt = pyplot()
    series: dict[str, list[float]] = {}
    for nodes in _PLOT_NODES:
        cluster, work = _model(v, nodes)
        for r in _plot_rows(v, cluster, work):
            series.setdefault(r[0], []).append(r[1])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        ax.plot(_PLOT_NODES, [y * 1e3 for y in ys], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"nodes ({v['gpus_per_node']} GPUs each)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"{int(v['params']):,} parameters, {v['compute_ms']:g} ms compute, "
                 f"{v['inter_gbit']:g} Gbit/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_rows(v: dict[str, Any], cluster: _plan.Cluster,
               work: _plan.Workload) -> list[tuple[str, float]]:
    """``(strategy, step_s)`` for one point of the plot (flat dpsgd: NaN above
    ``_FLAT_PLOT_LIMIT`` ranks, where its ``n x n`` mixing matrices get too big)."""
    if cluster.world_size <= _FLAT_PLOT_LIMIT:
        return [(r.strategy, r.step_s) for r in _predict(v, cluster, work, None)]
    f = _stragglers(v["stragglers"], cluster)
    rows = [_plan.predict_ddp(cluster, work, a, f) for a in ("ring", "tree", "hierarchical")]
    out = [(r.strategy, r.step_s) for r in rows]
    out.append((f"dpsgd ({v['topology']}, {v['mode']})", float("nan")))
    r = _plan.predict_dpsgd(cluster, work, v["topology"], True, v["mode"], int(v["seed"]), f,
                            None)
    out.append((r.strategy, r.step_s))
    for hier in (False, True):
        r = _plan.predict_adpsgd(cluster, work, v["pairing"], hier, v["max_staleness"], f)
        out.append((r.strategy, r.step_s))
    return out
