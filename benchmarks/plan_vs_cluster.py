"""The cost model of ``lightning-gossip plan`` against the emulated cluster's measurements.

Reads every ``benchmarks/results/cluster*.json`` (written by ``benchmarks/cluster.py``), runs
:mod:`lightning_gossip.plan` with the same parameters (model size, processes per node, nodes,
link rate) and prints predicted vs measured time per step and inter-node bytes per rank per step,
with the relative error, for every case that ran. With ``--write-docs`` the comparison replaces
the part of ``docs/plan.md`` between its ``plan_vs_cluster`` markers.

Calibration (one number per JSON file): the compute time per step is the measured ``ddp`` step
minus the model's ring all-reduce time, so ``ddp`` matches by construction and is not a test of
the model. Assumed, not measured: the intra-node "links" (loopback TCP on the same cores) at
``--intra-gbyte`` GB/s, no latency (the emulation has none), and the link rate reduced by 3% for
Ethernet/IP/TCP headers. Each case is predicted in two modes: the strategy's own (``overlap``
for dpsgd) and ``blocking`` (communication not hidden at all: what 2 shared CPU cores allow).

    .venv/bin/python benchmarks/plan_vs_cluster.py               # print
    .venv/bin/python benchmarks/plan_vs_cluster.py --write-docs  # also update docs/plan.md
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_gossip import plan  # noqa: E402

START, END = "<!-- plan_vs_cluster:start -->", "<!-- plan_vs_cluster:end -->"
HEADERS = 1.03  # Ethernet/IP/TCP bytes per payload byte (docs/cluster.md)


def step_s(case: dict) -> float:
    """Measured seconds per optimizer step: time per epoch / steps per epoch (mean rank)."""
    steps = sum(case["steps_per_rank"]) / len(case["steps_per_rank"])
    return case["epoch_s"] / (steps / case["epochs"])


def predict(name: str, case: dict, cluster: plan.Cluster, params: int, compute: float,
            mode: str) -> plan.Prediction | None:
    """The model's prediction for one case of benchmarks/cluster.py (``None``: unknown case)."""
    kw = case.get("kwargs", {})
    wire = 2 if kw.get("wire_dtype") in ("bf16", "fp16") else 4
    work = plan.Workload(params=params, compute_s=compute, wire_bytes=wire)
    hier = bool(kw.get("hierarchical", False))
    if case["strategy"] == "ddp":
        return plan.predict_ddp(cluster, work, "ring")
    if case["strategy"] == "dpsgd":
        m = "delay_by_one" if kw.get("delay_by_one") else (
            "overlap" if kw.get("overlap", True) else "blocking")
        return plan.predict_dpsgd(cluster, work, kw.get("topology", "random_ring"), hier,
                                  m if mode == "strategy" else "blocking",
                                  seed=kw.get("seed", 0))
    if case["strategy"] == "adpsgd":
        stale = kw.get("max_staleness", 4) if mode == "strategy" else 0
        return plan.predict_adpsgd(cluster, work, kw.get("pairing", "ring"), hier, stale)
    return None


def compare(path: Path, intra_gbyte: float) -> tuple[list[list[str]], list[str]]:
    """Table rows and reading notes for one results file."""
    d = json.loads(path.read_text())
    cfg, params = d["config"], int(d["params"])
    cases = {c["case"]: c for c in d["cases"] if c.get("status") == "ok"}
    cluster = plan.Cluster(nodes=cfg["nodes"], gpus_per_node=cfg["procs"],
                           inter_bandwidth=cfg["rate"] * 1e6 / 8 / HEADERS,
                           intra_bandwidth=intra_gbyte * 1e9)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    notes = [f"`{shown}`: {cfg['nodes']} nodes x {cfg['procs']} processes, "
             f"{cfg['rate']:g} Mbit/s, {params:,} parameters, load average "
             f"{d['machine_before']['loadavg_1_5_15'][0]:.1f} before the run"]
    if "ddp" not in cases:
        notes.append("no ddp case: cannot calibrate the compute time, skipped")
        return [], notes
    work = plan.Workload(params=params, compute_s=0.0)
    comm = plan.predict_ddp(cluster, work, "ring").step_s
    compute = max(step_s(cases["ddp"]) - comm, 0.0)
    notes.append(f"compute per step calibrated on ddp: {step_s(cases['ddp']) * 1e3:.0f} ms "
                 f"measured - {comm * 1e3:.0f} ms predicted all-reduce = {compute * 1e3:.0f} ms")
    rows, measured, pred = [], {}, {}
    for name, case in cases.items():
        p_mode = predict(name, case, cluster, params, compute, "strategy")
        p_block = predict(name, case, cluster, params, compute, "blocking")
        if p_mode is None or p_block is None:
            continue
        m = step_s(case)
        mb = sum(case["tx_bytes_per_step_per_rank"]) / len(case["tx_bytes_per_step_per_rank"])
        measured[name], pred[name] = m, p_mode.step_s
        best = min((p_mode, p_block), key=lambda p: abs(p.step_s - m))
        pred[name + " best"] = best.step_s
        rows.append([
            f"{cfg['nodes']}x{cfg['procs']}@{cfg['rate']:g}", name, f"{m * 1e3:.0f}",
            f"{p_mode.step_s * 1e3:.0f}", f"{(p_mode.step_s / m - 1) * 100:+.0f}%",
            f"{p_block.step_s * 1e3:.0f}", f"{(p_block.step_s / m - 1) * 100:+.0f}%",
            f"{mb / 1e6:.2f}", f"{p_mode.inter_bytes_per_rank * HEADERS / 1e6:.2f}",
        ])
    order_m = sorted(measured, key=measured.get)
    order_p = sorted(measured, key=pred.get)
    order_b = sorted(measured, key=lambda k: pred[k + " best"])
    notes.append(f"ranking, measured (fastest first): {', '.join(order_m)}; predicted "
                 f"(strategy's mode): {', '.join(order_p)} "
                 f"({'same' if order_m == order_p else 'different'}); best mode per case: "
                 f"{'same' if order_m == order_b else 'different'}")
    return rows, notes


def render(rows: list[list[str]], notes: list[str]) -> str:
    """The comparison as Markdown."""
    head = ["run", "case", "ms/step", "model", "error", "blocking", "error",
            "MB/rank", "model"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    legend = ("ms/step: measured; model: predicted in the strategy's mode; blocking: "
              "predicted with\nno overlap; MB/rank: measured inter-node MB per rank per step "
              "(headers included).")
    bullets = [textwrap.fill(n, 100, initial_indent="* ", subsequent_indent="  ")
               for n in notes]
    return "\n".join(lines + ["", legend, ""] + bullets)


def main(argv: list[str] | None = None) -> int:
    """Compare every cluster results file with the model; optionally write docs/plan.md."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="*", type=Path,
                    default=sorted((ROOT / "benchmarks" / "results").glob("cluster*.json")))
    ap.add_argument("--intra-gbyte", type=float, default=1.0,
                    help="assumed loopback bandwidth per rank, GB/s (default 1)")
    ap.add_argument("--write-docs", action="store_true", help="update docs/plan.md")
    args = ap.parse_args(argv)
    rows, notes = [], []
    for path in args.results:
        r, n = compare(path.resolve(), args.intra_gbyte)
        rows += r
        notes += n
    text = render(rows, notes)
    print(text)
    if args.write_docs:
        doc = ROOT / "docs" / "plan.md"
        s = doc.read_text()
        i, j = s.index(START) + len(START), s.index(END)
        doc.write_text(s[:i] + "\n" + text + "\n" + s[j:])
        print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
