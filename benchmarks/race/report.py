"""The race's figure and markdown table (``benchmarks/race/driver.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

METRIC_LABEL = {"digits": "validation accuracy of the replica average, %",
                "asr": "dev WER of the replica average, %"}


def plot(payload: dict[str, Any], path: Path) -> None:
    """Validation metric against training wall time, one line per case, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in payload["cases"]:
        if r.get("curve"):
            xs, ys = zip(*r["curve"])
            style = "-" if r["kind"] == "gossip" else "--"
            ax.plot(xs, ys, style, marker=".", label=r["name"])
    if payload["target"] is not None:
        ax.axhline(payload["target"], color="k", linestyle=":",
                   label=f"target {payload['target']:.1f}%")
    ax.set_xlabel("training wall time, s (validation excluded)")
    ax.set_ylabel(METRIC_LABEL.get(payload["workload"], "metric, %"))
    load = payload["machine_before"]["loadavg_1_5_15"][0]
    slow = payload.get("slow_node")
    ax.set_title(f"race: {payload['workload']}, {payload['nodes']}x{payload['procs']} at "
                 f"{payload['rate_mbit']:g} Mbit/s"
                 + ("" if slow is None else
                    f", node {slow} +{payload.get('slow_extra_s') or 0:.2f} s/step")
                 + (f", {payload['latency_ms']:g} ms" if payload.get("latency_ms") else "")
                 + f" (load {load:.0f} on {payload['machine_before']['cpus']} cores)",
                 fontsize=10)
    points = [m for r in payload["cases"] for _, m in r.get("curve", [])[1:]]
    if payload["workload"] == "asr":
        ax.set_ylim(max(0.0, min(points, default=0) - 5), 101)
    else:
        ax.set_ylim(max(0.0, min(points, default=0) - 5), 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _steps(r: dict[str, Any]) -> str:
    """Rank 0's steps, or every rank's (``a/b/c/d``) where they differ (adpsgd's cursor)."""
    per_rank = r.get("steps_per_rank")
    if per_rank and len(set(per_rank)) > 1:
        return "/".join(str(s) for s in per_rank)
    return str(r["steps"])


def markdown_table(payload: dict[str, Any]) -> str:
    """One row per case: time to target and its ratios, metric at ddp's time, bytes, hook."""
    name = "WER" if payload["workload"] == "asr" else "acc."
    lines = [f"| case | to target, s | / ddp | / best peer | {name} at ddp's time, % | "
             f"final {name}, % | steps | MB/step/node | hook: bytes vs ddp | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in payload["cases"]:
        check = r.get("hook_check")
        hook = "-" if check is None else (f"{check['measured_ratio']} (expected "
                                          f"{check['expected_ratio']:g}): "
                                          f"{'ok' if check['ok'] else 'FAILED'}")
        mb = r["bytes_per_step_inter_node"]
        load = r.get("load_during")
        loads = "-" if not load else f"{load[0][0]:.1f}-{load[1][0]:.1f}"
        lines.append(f"| {r['name']} | {_fmt(r['time_to_target_s'])} | "
                     f"{_fmt(r.get('time_ratio_vs_ddp'), '.2f')} | "
                     f"{_fmt(r.get('time_ratio_vs_best_peer'), '.2f')} | "
                     f"{_fmt(r['metric_at_ddp_time'])} | {_fmt(r['final_metric'])} | "
                     f"{_steps(r)} | {_fmt(None if mb is None else mb / 1e6, '.3f')} | "
                     f"{hook} | {loads} |")
    return "\n".join(lines)


def per_sample_table(payload: dict[str, Any]) -> str:
    """Why a case is faster or slower: time per sample against metric per sample.

    Time to target = samples needed x seconds per sample: for every case the training seconds
    per 1000 samples (all ranks together, over its whole curve) and its metric at each sample
    count that every case reached (the curves' ``curve_samples``).
    """
    cases = [r for r in payload["cases"] if len(r.get("curve", [])) > 1]
    if not cases:
        return ""
    common = sorted(set.intersection(*(set(r["curve_samples"][1:]) for r in cases)))
    common = common[-4:]
    name = "WER" if payload["workload"] == "asr" else "acc."
    head = "".join(f" {name} at {n} samples, % |" for n in common)
    lines = [f"| case | s per 1000 samples | MB/step/node |{head}",
             "|---|---:|---:|" + "---:|" * len(common)]
    for r in cases:
        secs, samples = r["curve"][-1][0], r["curve_samples"][-1]
        at = dict(zip(r["curve_samples"], (m for _, m in r["curve"])))
        mb = r["bytes_per_step_inter_node"]
        cells = "".join(f" {_fmt(at.get(n))} |" for n in common)
        lines.append(f"| {r['name']} | {_fmt(1000 * secs / samples if samples else None)} | "
                     f"{_fmt(None if mb is None else mb / 1e6, '.3f')} |{cells}")
    return "\n".join(lines)
