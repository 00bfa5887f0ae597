"""The cost model of ``lightning-gossip plan`` against the emulated cluster's measurements:
calibrate its host and link constants on some runs, validate them on the others.

Reads ``benchmarks/results/cluster*.json`` (written by ``benchmarks/perf/cluster.py``; by default
all but :data:`SUPERSEDED`), runs :mod:`lightning_gossip.plan` with each run's model size,
processes per node, nodes and link rate, and prints predicted vs measured time per step and
inter-node bytes per rank per step, with the relative error, for every case that ran. With
``--write-docs`` the comparison replaces the part of ``docs/plan.md`` between its
``plan_vs_cluster`` markers; ``--json`` writes it as JSON.

Calibration, in two parts:

* **per run, one number: the compute time per step** = the measured ``ddp`` step minus the
  model's ring all-reduce (link and host time). ``ddp`` then matches by construction unless
  that difference is negative (compute clamped at 0), so it is no test of the model; on a real
  cluster, time a step on one GPU instead.
* **for all runs, four constants** (:class:`lightning_gossip.plan.Cluster`): ``overlap`` (the
  fraction of the communication scheduled against compute that really runs hidden),
  ``host_bandwidth`` (bytes/s of gossip one rank's CPU handles), ``ddp_host_bandwidth`` (the
  same for ddp's all-reduce) and ``exchange_efficiency`` (the fraction of the link rate one
  process's exchanges get, both directions at once). They are fitted on the ``--calibrate``
  runs only (the 2 x 2 runs by default: least squares of the log ratio predicted/measured over
  all their cases, on a grid) and then used unchanged on the other runs (the 4 x 1 runs): those
  are the validation, never used in the fit. ``--without`` leaves terms out of the fit, to
  measure what each brings; ``--efficiency-per-node`` fits the efficiency as one fraction of
  every node's rate (the form first tried).

Assumed, not measured: the intra-node "links" (loopback TCP on the same cores) at
``--intra-gbyte`` GB/s with no latency (their CPU cost is the host term), and 3% of the link
rate lost to Ethernet/IP/TCP headers. The "GPU model" column is the model with its GPU defaults
(``overlap=1``, free hosts, exchange efficiency 1), as before calibration.

    .venv/bin/python -m benchmarks.perf.plan_vs_cluster               # print
    .venv/bin/python -m benchmarks.perf.plan_vs_cluster --write-docs \
        --json benchmarks/results/plan_vs_cluster.json            # update docs/plan.md, JSON
    .venv/bin/python -m benchmarks.perf.plan_vs_cluster --without ddp_host efficiency  # ablation
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lightning_gossip import plan

ROOT = Path(__file__).resolve().parents[2]

START, END = "<!-- plan_vs_cluster:start -->", "<!-- plan_vs_cluster:end -->"
HEADERS = 1.03  # Ethernet/IP/TCP bytes per payload byte (docs/cluster.md)
# the 2 x 2 runs at 200 and 1000 Mbit/s (validation: the 4 x 1 runs, never used in the fit)
DEFAULT_CALIBRATE = ["cluster_2x2_200", "cluster_2x2_1000", "cluster_2x2_200_remedies"]
# not compared by default: the first 2 x 2 run at 200 Mbit/s (code of a38a26d: adpsgd before the
# communication thread, no hierarchical adpsgd), superseded by cluster_2x2_200
SUPERSEDED = ["cluster"]
#: the grids of the four constants (a free host, ``inf``, is added to both host grids)
OVERLAPS = np.round(np.linspace(0.0, 1.0, 21), 3)
HOST_GBYTE = np.round(np.geomspace(0.02, 20.0, 31), 4)
EFFICIENCIES = np.round(np.linspace(0.1, 1.0, 19), 3)


@dataclass(frozen=True)
class Constants:
    """The host and link constants fitted on the calibration runs (:class:`plan.Cluster`):
    ``overlap``, ``host_gbyte`` (gossip exchanges) and ``ddp_gbyte`` (all-reduce and
    all-gather) per rank in GB/s (``inf``: free), ``exchange_efficiency``."""

    overlap: float
    host_gbyte: float
    ddp_gbyte: float | None  # None: host_gbyte
    exchange_efficiency: float
    #: the efficiency as a constant fraction of each node's rate (the form first tried, for
    #: comparison) instead of per process (``1 - (1 - d) ** processes`` per node)
    per_node: bool = False

    def describe(self) -> str:
        """One line for the docs."""
        def gb(x: float) -> str:
            return "free" if math.isinf(x) else f"{x:g} GB/s per rank"
        ddp = "the same" if self.ddp_gbyte is None else gb(self.ddp_gbyte)
        return (f"overlap = {self.overlap:g}, host bandwidth = {gb(self.host_gbyte)} (gossip), "
                f"{ddp} (ddp), exchange efficiency = {self.exchange_efficiency:g}"
                + (" per node" if self.per_node else " per process"))


#: the model with its GPU defaults (as before any calibration)
GPU = Constants(1.0, math.inf, math.inf, 1.0)


@dataclass
class Run:
    """One results file of benchmarks/perf/cluster.py."""

    name: str
    path: Path
    nodes: int
    procs: int
    rate: float
    params: int
    load: float
    cases: dict[str, dict] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``NxP@rate``, plus what follows the rate in the file name (``run1``, ...)."""
        base = f"{self.nodes}x{self.procs}@{self.rate:g}"
        parts = self.name.split("_")
        return f"{base} {'_'.join(parts[3:])}" if len(parts) > 3 else base


def load(path: Path) -> Run:
    """The cases of one results file that ran."""
    d = json.loads(path.read_text())
    cfg = d["config"]
    return Run(path.stem, path, int(cfg["nodes"]), int(cfg["procs"]), float(cfg["rate"]),
               int(d["params"]), float(d["machine_before"]["loadavg_1_5_15"][0]),
               {c["case"]: c for c in d["cases"] if c.get("status") == "ok"})


def step_s(case: dict) -> float:
    """Measured seconds per optimizer step: the median time of the epochs after the first
    (``epoch_s_steady_median``: the model has no start-up or warm-up; the mean epoch where
    absent) / steps per epoch (mean rank)."""
    steps = sum(case["steps_per_rank"]) / len(case["steps_per_rank"])
    return case.get("epoch_s_steady_median", case["epoch_s"]) / (steps / case["epochs"])


def cluster_of(run: Run, k: Constants, intra_gbyte: float) -> plan.Cluster:
    """The model's cluster for ``run`` with the constants ``k``."""
    eff = float(k.exchange_efficiency)
    if k.per_node:  # the per-process d that gives the node this efficiency
        eff = 1.0 - (1.0 - eff) ** (1.0 / run.procs)
    return plan.Cluster(nodes=run.nodes, gpus_per_node=run.procs,
                        inter_bandwidth=run.rate * 1e6 / 8 / HEADERS,
                        intra_bandwidth=intra_gbyte * 1e9, overlap=float(k.overlap),
                        host_bandwidth=float(k.host_gbyte) * 1e9,
                        ddp_host_bandwidth=(None if k.ddp_gbyte is None
                                            else float(k.ddp_gbyte) * 1e9),
                        exchange_efficiency=eff)


def compute_of(run: Run, cluster: plan.Cluster) -> float | None:
    """Compute per step calibrated on the run's ddp case (``None``: no ddp case)."""
    if "ddp" not in run.cases:
        return None
    comm = plan.predict_ddp(cluster, plan.Workload(params=run.params, compute_s=0.0)).step_s
    return max(step_s(run.cases["ddp"]) - comm, 0.0)


def predict(case: dict, cluster: plan.Cluster, params: int,
            compute: float) -> plan.Prediction | None:
    """The model's prediction for one case, in the strategy's own mode (``None``: unknown)."""
    kw = case.get("kwargs", {})
    wire = 2 if kw.get("wire_dtype") in ("bf16", "fp16") else 4
    work = plan.Workload(params=params, compute_s=compute, wire_bytes=wire)
    hier = bool(kw.get("hierarchical", False))
    if case["strategy"] == "ddp":
        return plan.predict_ddp(cluster, work, "ring")
    if case["strategy"] == "dpsgd":
        mode = "delay_by_one" if kw.get("delay_by_one") else (
            "overlap" if kw.get("overlap", True) else "blocking")
        return plan.predict_dpsgd(cluster, work, kw.get("topology", "random_ring"), hier, mode,
                                  seed=kw.get("seed", 0), tolerance=None)
    if case["strategy"] == "adpsgd":
        return plan.predict_adpsgd(cluster, work, kw.get("pairing", "ring"), hier,
                                   kw.get("max_staleness", 4))
    return None


def predictions(run: Run, k: Constants,
                intra_gbyte: float) -> dict[str, tuple[float, plan.Prediction]]:
    """``case -> (measured step, prediction)`` for every known case of ``run``."""
    cluster = cluster_of(run, k, intra_gbyte)
    compute = compute_of(run, cluster)
    if compute is None:
        return {}
    out = {}
    for name, case in run.cases.items():
        p = predict(case, cluster, run.params, compute)
        if p is not None:
            out[name] = (step_s(case), p)
    return out


def log_errors(runs: list[Run], k: Constants, intra_gbyte: float) -> list[float]:
    """``log(predicted / measured)`` of every case of ``runs``. ddp included: it matches by
    construction unless its calibrated compute is clamped at 0 (host and link time above the
    measured step), and then its error must count."""
    return [math.log(max(p.step_s, 1e-9) / m) for run in runs
            for m, p in predictions(run, k, intra_gbyte).values()]


def rms(runs: list[Run], k: Constants, intra_gbyte: float) -> float:
    """Root mean square of :func:`log_errors`."""
    e = log_errors(runs, k, intra_gbyte)
    return math.sqrt(sum(x * x for x in e) / len(e)) if e else 0.0


def fit(runs: list[Run], intra_gbyte: float, without: tuple[str, ...] = (),
        per_node: bool = False) -> tuple[Constants, float]:
    """``(constants, rms log error)`` minimising the squared log errors of ``runs`` on the
    grids :data:`OVERLAPS`, :data:`HOST_GBYTE` (twice, plus a free host) and
    :data:`EFFICIENCIES`: every 4th point of each grid first, then coordinate descent on the
    full grids from the best of those until no single constant improves (deterministic).
    ``without``: terms left out (``ddp_host``: ddp's host constant is the gossip one;
    ``efficiency``: exchanges at the full rate), to measure what each term brings."""
    hosts = [*HOST_GBYTE.tolist(), math.inf]
    grids = [OVERLAPS.tolist(), hosts,
             [None] if "ddp_host" in without else hosts,
             [1.0] if "efficiency" in without else EFFICIENCIES.tolist()]
    coarse = [g[::4] + ([g[-1]] if (len(g) - 1) % 4 else []) for g in grids]
    best = Constants(1.0, math.inf, None if "ddp_host" in without else math.inf, 1.0,
                     per_node)
    best_e = rms(runs, best, intra_gbyte)
    for ov in coarse[0]:
        for host in coarse[1]:
            for coll in coarse[2]:
                for eff in coarse[3]:
                    k = Constants(ov, host, coll, eff, per_node)
                    e = rms(runs, k, intra_gbyte)
                    if e < best_e - 1e-12:
                        best, best_e = k, e
    improved = True
    while improved:
        improved = False
        for i, grid in enumerate(grids):
            for v in grid:
                vals = [best.overlap, best.host_gbyte, best.ddp_gbyte,
                        best.exchange_efficiency]
                vals[i] = v
                k = Constants(*vals, per_node)
                e = rms(runs, k, intra_gbyte)
                if e < best_e - 1e-12:
                    best, best_e, improved = k, e, True
    return best, best_e


def compare(runs: list[Run], calibrate: list[str], k: Constants,
            intra_gbyte: float) -> tuple[list[list[str]], list[str], list[dict]]:
    """Table rows, reading notes and JSON records for every run."""
    rows, notes, records = [], [], []
    for run in runs:
        role = "cal" if run.name in calibrate else "val"
        shown = run.path.relative_to(ROOT) if run.path.is_relative_to(ROOT) else run.path
        notes.append(f"`{shown}` ({role}): {run.nodes} nodes x {run.procs} processes, "
                     f"{run.rate:g} Mbit/s, {run.params:,} parameters, load average "
                     f"{run.load:.1f} before the run")
        fitted = predictions(run, k, intra_gbyte)
        gpu = predictions(run, GPU, intra_gbyte)
        if not fitted:
            notes.append("  no ddp case: cannot calibrate the compute time, skipped")
            continue
        cluster = cluster_of(run, k, intra_gbyte)
        notes[-1] += (f"; compute per step calibrated on ddp: "
                      f"{compute_of(run, cluster) * 1e3:.0f} ms")
        measured = {}
        for name, (m, p) in fitted.items():
            g = gpu[name][1]
            mb = (sum(run.cases[name]["tx_bytes_per_step_per_rank"])
                  / len(run.cases[name]["tx_bytes_per_step_per_rank"]))
            measured[name] = m
            err, gerr = p.step_s / m - 1, g.step_s / m - 1
            rows.append([run.label, role, name, f"{m * 1e3:.0f}", f"{p.step_s * 1e3:.0f}",
                         f"{err * 100:+.0f}%", f"{g.step_s * 1e3:.0f}", f"{gerr * 100:+.0f}%",
                         f"{mb / 1e6:.2f}", f"{p.inter_bytes_per_rank * HEADERS / 1e6:.2f}"])
            records.append({"run": run.name, "label": run.label, "role": role, "case": name,
                            "measured_s": m, "predicted_s": p.step_s, "error": err,
                            "gpu_model_s": g.step_s, "gpu_model_error": gerr,
                            "measured_bytes_per_rank": mb,
                            "predicted_bytes_per_rank": p.inter_bytes_per_rank * HEADERS})
        order_m = sorted(measured, key=measured.get)
        order_p = sorted(measured, key=lambda k: fitted[k][1].step_s)
        order_g = sorted(measured, key=lambda k: gpu[k][1].step_s)
        notes.append(f"  ranking, measured (fastest first): {', '.join(order_m)}; model: "
                     f"{'the same' if order_m == order_p else ', '.join(order_p)}; GPU model: "
                     f"{'the same' if order_m == order_g else ', '.join(order_g)}")
    return rows, notes, records


def render(rows: list[list[str]], notes: list[str], summary: list[str]) -> str:
    """The comparison as Markdown."""
    head = ["run", "role", "case", "ms/step", "model", "error", "GPU model", "error",
            "MB/rank", "model"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    legend = ("ms/step: measured; model: predicted with the calibrated constants, in the "
              "strategy's mode\n(overlap for dpsgd, the case's max_staleness for adpsgd); GPU "
              "model: overlap 1, free hosts,\nexchange efficiency 1 (the defaults); role: cal = "
              "used to fit the constants, val = not;\nMB/rank: measured inter-node MB per rank "
              "per step (headers included), and the model's.")
    bullets = []
    for n in summary + notes:
        indent = "    " if n.startswith("  ") else "  "
        first = "  * " if n.startswith("  ") else "* "
        bullets.append(textwrap.fill(n.strip(), 100, initial_indent=first,
                                     subsequent_indent=indent))
    return "\n".join(lines + ["", legend, ""] + bullets)


def default_results() -> list[Path]:
    """Every ``benchmarks/results/cluster*.json`` except the :data:`SUPERSEDED` ones."""
    return [p for p in sorted((ROOT / "benchmarks" / "results").glob("cluster*.json"))
            if p.stem not in SUPERSEDED]


def swaps(records: list[dict], role: str) -> tuple[int, int, int, list[str]]:
    """Pairs of cases of one run (``role``'s runs, ddp included) that the model orders against
    the measurement: ``(pairs, ties, swapped, descriptions)``. A pair the model predicts within
    1% is a tie, not a swap: on one process per node ``hierarchical=True`` is the flat strategy,
    the same configuration measured twice."""
    pairs = ties = 0
    out = []
    for run in sorted({r["run"] for r in records if r["role"] == role}):
        rs = [r for r in records if r["run"] == run]
        for a in range(len(rs)):
            for b in range(a + 1, len(rs)):
                x, y = rs[a], rs[b]
                pairs += 1
                if abs(x["predicted_s"] / y["predicted_s"] - 1) < 0.01:
                    ties += 1
                elif (x["measured_s"] < y["measured_s"]) != (x["predicted_s"] < y["predicted_s"]):
                    gap = abs(x["measured_s"] / y["measured_s"] - 1)
                    out.append(f"{x['label']} {x['case']} / {y['case']} (measured "
                               f"{100 * gap:.0f}% apart)")
    return pairs, ties, len(out), out


def ranking_summary(records: list[dict], role: str) -> str:
    """How many runs of ``role`` the model ranks as measured (all cases, ddp included; up to
    predicted ties), and which pairs of cases it swaps."""
    runs = sorted({r["run"] for r in records if r["role"] == role})
    same = sum(swaps([r for r in records if r["run"] == run], role)[2] == 0 for run in runs)
    pairs, ties, n, which = swaps(records, role)
    return (f"{same} of {len(runs)} runs ranked as measured (up to predicted ties); {pairs} "
            f"pairs of cases: {ties} predicted tied, {n} swapped"
            + (f" ({', '.join(which)})" if which else ""))


def role_summary(records: list[dict], role: str) -> str | None:
    """One line on the errors of the ``cal`` or ``val`` cases (ddp excluded), the model's and
    the GPU model's, and the ranking (``None``: no such case)."""
    errs = [abs(r["error"]) for r in records if r["role"] == role and r["case"] != "ddp"]
    gerrs = [abs(r["gpu_model_error"]) for r in records
             if r["role"] == role and r["case"] != "ddp"]
    if not errs:
        return None
    over = [f"{r['label']} {r['case']} ({100 * r['error']:+.0f}%)" for r in records
            if r["role"] == role and r["case"] != "ddp" and abs(r["error"]) > 0.25]
    return (f"{'calibration' if role == 'cal' else 'validation'} cases (ddp excluded): "
            f"{len(errs)}, |error| mean {100 * np.mean(errs):.0f}%, max "
            f"{100 * max(errs):.0f}% (GPU model: mean {100 * np.mean(gerrs):.0f}%, max "
            f"{100 * max(gerrs):.0f}%); over 25%: {', '.join(over) if over else 'none'}; "
            f"ranking: {ranking_summary(records, role)}")


def main(argv: list[str] | None = None) -> int:
    """Fit the constants on the calibration runs, compare every run, optionally write."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="*", type=Path, default=default_results(),
                    help="results files (default: benchmarks/results/cluster*.json except "
                         f"{', '.join(SUPERSEDED)})")
    ap.add_argument("--calibrate", nargs="*", metavar="NAME",
                    help="file stems of the runs that fit the constants (default: "
                         f"{' '.join(DEFAULT_CALIBRATE)} where present, else every run)")
    ap.add_argument("--overlap", type=float,
                    help="use this overlap instead of fitting the constants (with --host-gbyte)")
    ap.add_argument("--host-gbyte", type=float,
                    help="use this host GB/s instead of fitting the constants (inf: free)")
    ap.add_argument("--ddp-host-gbyte", type=float,
                    help="with --overlap and --host-gbyte: ddp's host GB/s (default: the same)")
    ap.add_argument("--exchange-efficiency", type=float, default=1.0,
                    help="with --overlap and --host-gbyte: the exchange efficiency (default 1)")
    ap.add_argument("--without", nargs="*", choices=["ddp_host", "efficiency"], default=[],
                    help="leave these terms out of the fit (to measure what each brings)")
    ap.add_argument("--efficiency-per-node", action="store_true",
                    help="the exchange efficiency as one fraction of every node's rate, "
                         "whatever its processes (the form first tried)")
    ap.add_argument("--intra-gbyte", type=float, default=1.0,
                    help="assumed loopback bandwidth per rank, GB/s (default 1)")
    ap.add_argument("--write-docs", action="store_true", help="update docs/plan.md")
    ap.add_argument("--json", type=Path, help="write the comparison as JSON")
    args = ap.parse_args(argv)
    runs = [load(p.resolve()) for p in args.results]
    names = [r.name for r in runs]
    calibrate = args.calibrate or [n for n in DEFAULT_CALIBRATE if n in names] or names
    cal_runs = [r for r in runs if r.name in calibrate]
    if args.overlap is not None and args.host_gbyte is not None:
        ddp = args.host_gbyte if args.ddp_host_gbyte is None else args.ddp_host_gbyte
        k = Constants(args.overlap, args.host_gbyte, ddp, args.exchange_efficiency,
                      args.efficiency_per_node)
        how = "given"
    else:
        k, _ = fit(cal_runs, args.intra_gbyte, tuple(args.without), args.efficiency_per_node)
        how = f"fitted on {', '.join(r.label for r in cal_runs)}"
    rows, notes, records = compare(runs, calibrate, k, args.intra_gbyte)
    summary = [f"host constants ({how}): {k.describe()}"]
    summary += [line for role in ("cal", "val") if (line := role_summary(records, role))]
    text = render(rows, notes, summary)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({
            "overlap": k.overlap,
            "host_gbyte": None if math.isinf(k.host_gbyte) else k.host_gbyte,
            "ddp_host_gbyte": (None if k.ddp_gbyte is None or math.isinf(k.ddp_gbyte)
                               else k.ddp_gbyte),
            "ddp_host_same_as_host": k.ddp_gbyte is None,
            "exchange_efficiency_per_node": k.per_node,
            "exchange_efficiency": k.exchange_efficiency, "how": how, "calibrate": calibrate,
            "intra_gbyte": args.intra_gbyte,
            "headers": HEADERS, "cases": records}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.write_docs:
        doc = ROOT / "docs" / "plan.md"
        s = doc.read_text()
        i, j = s.index(START) + len(START), s.index(END)
        doc.write_text(s[:i] + "\n" + text + "\n" + s[j:])
        print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
