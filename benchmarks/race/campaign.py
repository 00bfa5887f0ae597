"""A race under the race rules: tuning, repeated runs in rotated order, one record per driver.

Needs root, as ``benchmarks/driver.py`` (whose arguments it takes, plus its own). One campaign
record (``--out``) holds one race setting (workload, layout, link, slow node):

1. **Tuning** (once per workload; ``--tuning-from`` reuses another record's): every case runs
   once at each peak rate of ``--peaks`` (``rules.PEAK_LRS``), with the per-learner rule
   applied to every method alike (``rules.case_lr``); each case keeps the peak that reached
   the target with the fewest samples (``rules.pick_peak``; none reached: the best final
   metric); a case whose best trial lies at an edge of its grid is tried once more a factor 2
   beyond it (``rules.edge_peak``). The procedure, every trial and the picks are in ``tuning``.
2. **Runs** (``--runs``, at least ``rules.MIN_RUNS`` for a claim): the cases at their
   picked peaks race to the fixed ``--target``, in an order rotated by one place per run
   (``rules.rotated``). With ``--slow-node`` the handicap is one number, ``--slow-extra-s``
   or (absent) calibrated once by the first launch, idle, and passed to every later one.
   After a run its cases' achieved slowdowns are checked (``rules.handicap_check``) and
   the CPU time other processes took (``rules.MAX_FOREIGN_CPU``); a run that fails either
   is marked rejected and, up to ``--retries`` times, another run is made.

Before every launch the machine must be idle (1-minute load at most ``--max-load``; the
campaign waits up to ``--settle-s`` for the load of the previous launch to decay). The record
is written after every case (atomically), so a stopped campaign loses at most the case in
progress, and started again with the same ``--out`` it goes on where it stopped.

Schema 3 (issue 47) adds: a seed per run (run ``k``: ``rules.run_seed(k)`` in every case; the
tuning ``rules.TUNING_SEED``), R at the top (``comm_compute_ratio`` and its terms,
``benchmarks/race/comm_compute.py``), the link's measured round trip and delay method
(``link``), ``pin_nodes``, the tuning's launches with their commit, load and CPU share; variants
(``driver.CASES``' ``tune_as``) take their base's peak; ``--narrow-after`` keeps each family's
fastest variant after the first runs; ``--ddp-reference`` for races without fp32 ddp.

Usage (the campaign of ``benchmarks/race/CAMPAIGN.md``; ``run_campaign.sh`` runs it)::

    sudo python -m benchmarks.race.campaign --workload asr --nodes 2 --procs 2 --rate 30 \\
        --latency-ms 0.5 --target 12 --eval-every 160 --max-samples 9600 --runs 3 \\
        --narrow-after 1 --cases ddp_bf16 ddp_powersgd4 postlocal16 postlocal64 \\
        torchft_localsgd adpsgd_hier_bf16 --tuning-from TUNING.json --ddp-reference TUNING.json \\
        --out benchmarks/results/race/regimes/asr_2x2_30mbit_0.5ms.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.race import comm_compute, driver, rules

SCHEMA = rules.SCHEMA
"""Version of the campaign record's layout (``rules.validate_record``)."""

SAME_SETTING = ("workload", "nodes", "procs", "rate_mbit", "latency_ms", "slow_node", "target",
                "eval_every", "max_samples", "batch_size", "pin_nodes")
"""Keys a resumed record must share with the command line."""


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(the campaign's own arguments, the race's arguments)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--out", type=Path, required=True, help="the campaign record (JSON)")
    p.add_argument("--runs", type=int, default=rules.MIN_RUNS, help="runs per case")
    p.add_argument("--retries", type=int, default=1, help="extra runs for rejected ones")
    p.add_argument("--peaks", type=float, nargs="+", default=None,
                   help="peak rates tried per case (default rules.PEAK_LRS)")
    p.add_argument("--tuning-from", type=Path, nargs="+", default=None,
                   help="take the tuning (trials and picks) of these campaign records for the "
                        "cases they tuned (the first that tuned a case); the others are tuned "
                        "here")
    p.add_argument("--settle-s", type=float, default=300.0,
                   help="wait at most this for the load to fall below --max-load")
    p.add_argument("--narrow-after", type=int, default=None, metavar="N",
                   help="after N runs, keep only the fastest variant of each family (cases of "
                        "one tune_as base: periods, outer optimizers, bucket sizes, gossip "
                        "periods; the gossip_every_n_steps='auto' cases form families of their "
                        "own) for the remaining runs; the others are kept with their runs and "
                        "make no claim")
    p.add_argument("--tuning-max-samples", type=int, default=None, metavar="N",
                   help="a tuning trial stops after N samples (default --max-samples), and a "
                        "case's later trials after the samples its best trial so far needed "
                        "(they can at most tie it)")
    p.add_argument("--ddp-reference", type=Path, default=None, metavar="RECORD",
                   help="a race without the ddp case (fp32 ddp left out where its step is "
                        "several times every other case's): ddp's samples to the target, for "
                        "the validation-interval rule, from this campaign record (the same "
                        "seeds and data order: the link does not change them)")
    own, rest = p.parse_known_args(argv)
    if "--json" in rest or "--png" in rest or "--seed" in rest:
        p.error("the campaign writes --out and sets the seeds; --json/--png/--seed are not "
                "taken")
    args = driver.parse_args(rest)
    if args.target is None or not (args.max_samples or args.budget):
        p.error("a campaign races to a fixed --target with --max-samples (or --budget)")
    if args.workload == "asr" and args.target > rules.MAX_TARGET_WER:
        p.error(f"--target {args.target:g} is above the rules' {rules.MAX_TARGET_WER:g} % dev "
                f"WER (not converged)")
    if "ddp" not in args.cases and own.ddp_reference is None:
        p.error("without the ddp case, --ddp-reference names the record of its samples")
    own.peaks = tuple(own.peaks or rules.PEAK_LRS[args.workload])
    return own, args


def case_peaks(own: argparse.Namespace, workload: str, case: str) -> tuple[float, ...]:
    """The peaks ``case`` is tuned at: its own (``driver.CASES[case]['peaks']``) or the
    campaign's.

    >>> ns = argparse.Namespace(peaks=(3e-3, 6e-3, 1.2e-2))
    >>> case_peaks(ns, "asr", "ddp"), case_peaks(ns, "asr", "torchft_diloco16_o10m0")
    ((0.003, 0.006, 0.012), (0.0015, 0.003, 0.006))
    """
    own_peaks = (driver.CASES[case].get("peaks") or {}).get(workload)
    return tuple(own_peaks) if own_peaks else tuple(own.peaks)


def ddp_reference(path: Path) -> dict[str, Any]:
    """ddp's samples to the target in another campaign record (the median of its accepted
    runs), for a race without the ddp case."""
    other = json.loads(path.read_text())
    ddp = (other.get("cases") or {}).get("ddp")
    samples = [r.get("samples_to_target") for r in rules.accepted_runs(other, "ddp")] if ddp \
        else []
    samples = sorted(s for s in samples if s is not None)
    how = "the median of ddp's accepted runs"
    if not samples:  # a tuning-only record: ddp's picked trial
        tuning = other.get("tuning") or {}
        chosen = (tuning.get("chosen") or {}).get("ddp")
        trial = (tuning.get("trials") or {}).get("ddp", {}).get(f"{float(chosen):g}", {}) \
            if chosen is not None else {}
        samples = [trial["samples_to_target"]] if trial.get("samples_to_target") else []
        how = "ddp's picked tuning trial"
    return {"from": str(path), "target": other.get("target"), "how": how,
            "samples_to_target": samples[len(samples) // 2] if samples else None,
            "runs": samples}


def new_record(own: argparse.Namespace, args: argparse.Namespace) -> dict[str, Any]:
    """The record's top before any case ran."""
    return {
        "benchmark": "race-campaign", "schema": SCHEMA, "workload": args.workload,
        "metric": ("dev WER, % (lower is better)" if args.workload == "asr"
                   else "validation accuracy, % (higher is better)"),
        "target": args.target, "latency_ms": args.latency_ms, "rate_mbit": args.rate,
        "slow_node": args.slow_node, "nodes": args.nodes, "procs": args.procs,
        "eval_every": args.eval_every, "max_samples": args.max_samples,
        "budget_s": args.budget, "batch_size": args.batch_size,
        "model": driver.model_description(args), "max_load": args.max_load,
        "allow_load": args.allow_load,
        "pin_nodes": bool(args.pin_nodes),
        "comm_compute_ratio": None, "comm_compute": None, "link": None,
        "seeds": {"tuning": rules.TUNING_SEED,
                  "runs": f"run k: seed {rules.RUN_SEED_BASE} + k (rules.run_seed)"},
        "ddp_reference": (ddp_reference(own.ddp_reference) if own.ddp_reference is not None
                          else None),
        "tuning": {"procedure": rules.TUNING_WORDS.format(
            seed=rules.TUNING_SEED, peaks=", ".join(f"{x:g}" for x in own.peaks)),
            "peaks": list(own.peaks),
            "case_peaks": {c: list(case_peaks(own, args.workload, c)) for c in args.cases
                           if case_peaks(own, args.workload, c) != tuple(own.peaks)},
            "trials": {}, "chosen": {}, "from": None, "launches": [],
            "rejected_trials": []},
        "handicap": None if args.slow_node is None else {
            "extra_s_per_step": args.slow_extra_s,
            "how": "given (--slow-extra-s)" if args.slow_extra_s is not None else None},
        "command": sys.argv, "commit": driver.commit(), "machine": driver.machine(),
        "cases": {c: {"kind": driver.CASES[c]["kind"], "peak": None, "lr": None, "runs": []}
                  for c in args.cases},
        "runs": [],
    }


def launches(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every launch of the record: the tuning's, then the runs'."""
    return list(rec.get("tuning", {}).get("launches", [])) + [
        launch for r in rec.get("runs", []) for launch in r.get("launches", [])]


def top_measurements(rec: dict[str, Any]) -> None:
    """R (the median of its terms over every launch) and the link (the first launch's
    measured round trip and delay method, every launch's round trip) at the record's top."""
    every = launches(rec)
    combined = comm_compute.combine([launch.get("comm_compute") for launch in every])
    if combined is not None:
        rec["comm_compute_ratio"] = combined["comm_compute_ratio"]
        rec["comm_compute"] = combined
    links = [launch["link"] for launch in every if launch.get("link")]
    if links:
        rec["link"] = dict(links[0], rtt_ms_per_launch=[link.get("rtt_ms") for link in links])


def save(rec: dict[str, Any], path: Path) -> None:
    """Write the record atomically, with R and the link at its top and its current score
    (``rules.score``)."""
    top_measurements(rec)
    rec["score"] = rules.score(rec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(path)


def load_or_new(own: argparse.Namespace, args: argparse.Namespace) -> dict[str, Any]:
    """The record at ``--out`` (resumed: its setting must be the command line's), or a new one."""
    fresh = new_record(own, args)
    if not own.out.exists():
        return fresh
    rec = json.loads(own.out.read_text())
    differ = [k for k in SAME_SETTING if rec.get(k) != fresh.get(k)]
    if differ:
        raise SystemExit(f"race campaign: {own.out} is a different race ({differ}); "
                         f"give another --out")
    for c in args.cases:
        rec["cases"].setdefault(c, fresh["cases"][c])
    return rec


def wait_idle(args: argparse.Namespace, settle_s: float) -> str | None:
    """Wait (up to ``settle_s``) for the 1-minute load to fall to ``--max-load``; the problem
    left (None: idle)."""
    deadline = time.monotonic() + settle_s
    while True:
        problem = rules.load_problem(os.getloadavg()[0], args.max_load)
        if problem is None or time.monotonic() > deadline:
            return problem
        time.sleep(10)


def run_entry(res: dict[str, Any], higher_is_better: bool, run: int | None,
              position: int) -> dict[str, Any]:
    """One run of one case, as the record keeps it (from the worker's raw result)."""
    target = res["target"]
    keep = ("lr", "seed", "options", "curve", "curve_samples", "final_metric", "steps",
            "steps_per_rank",
            "bytes_per_step_inter_node", "bytes_per_step_after_warmup", "expected_hook_ratio",
            "load_during", "init_params_sha256", "slowdown", "slow_local_step_s",
            "slow_extra_s", "calibration_steps_s", "slow_slept_per_step_s", "slow_alone_step_s",
            "torchft_commits", "auto_period")
    entry = {k: res.get(k) for k in keep}
    entry.update(run=run, position=position,
                 time_to_target_s=driver.time_to(res["curve"], target, higher_is_better),
                 samples_to_target=driver.samples_to(res, higher_is_better),
                 finished_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    return entry


def launch(own: argparse.Namespace, args: argparse.Namespace, rec: dict[str, Any],
           cases: list[str], peaks: dict[str, float], on_entry: Any,
           seed: int, caps: dict[str, int | None] | None = None) -> dict[str, Any]:
    """One race launch of ``cases`` (in this order) at ``peaks``, from ``seed``, on an idle
    machine (it waits up to ``--settle-s`` for the load to fall); what the launch recorded:
    status, load, other processes' CPU share, commit, the link measured and R."""
    problem = wait_idle(args, 0.0 if args.allow_load else own.settle_s)
    if problem and not args.allow_load:
        raise SystemExit(f"race campaign: stopped before a launch: {problem}")
    sub = argparse.Namespace(**vars(args))
    sub.cases = list(cases)
    sub.case_peaks = dict(peaks)
    sub.seed = int(seed)
    sub.case_max_samples = {c: n for c, n in (caps or {}).items() if n}
    handicap = rec.get("handicap") or {}
    sub.slow_extra_s = handicap.get("extra_s_per_step")
    sub.slow_calibration = handicap.get("calibration")
    load_before = os.getloadavg()[0]
    higher = args.workload != "asr"
    position = iter(range(len(cases)))

    def on_case(res: dict[str, Any]) -> None:
        if rec.get("handicap") is not None and rec["handicap"].get("extra_s_per_step") is None:
            rec["handicap"] = {"extra_s_per_step": res["slow_extra_s"],
                               "calibration": res["slow_calibration"],
                               "how": "calibrated once, by the first launch (idle): the slow "
                                      "node's median local step with every rank computing "
                                      "(contended_s), and alone (alone_s)",
                               "calibrated_utc": time.strftime("%Y-%m-%d %H:%M:%S",
                                                               time.gmtime()),
                               "load_1min": load_before}
        on_entry(res, run_entry(res, higher, None, next(position)))
        save(rec, own.out)

    payload, detail = driver.run_race(sub, on_case)
    return {"status": detail, "load_before": load_before, "cases": list(cases),
            "seed": int(seed), "foreign_cpu_fraction": payload["foreign_cpu_fraction"],
            "commit": payload["commit"], "wall_s": round(payload["wall_s"], 1),
            "load_after": payload["machine_after"]["loadavg_1_5_15"],
            "pin_nodes": payload["pin_nodes"], "node_cpus": payload["node_cpus"],
            "link": payload["link"], "comm_compute": payload["comm_compute"],
            "latency_check": payload["cluster"].get("latency_check")}


def trial_cap(own: argparse.Namespace, args: argparse.Namespace,
              trials: dict[str, dict[str, Any]]) -> int | None:
    """Samples after which a case's next tuning trial stops: ``--tuning-max-samples``, or the
    samples its best trial so far needed, if fewer (a later trial can at most tie it; a tie
    at the cap still reaches the target there). None: ``--max-samples``.

    >>> ns = argparse.Namespace(tuning_max_samples=7200)
    >>> trial_cap(ns, argparse.Namespace(max_samples=9600), {"0.003": {
    ...     "samples_to_target": 4800}, "0.006": {"samples_to_target": None}})
    4800
    >>> trial_cap(argparse.Namespace(tuning_max_samples=None),
    ...           argparse.Namespace(max_samples=9600), {}) is None
    True
    """
    reached = [t["samples_to_target"] for t in trials.values()
               if t.get("samples_to_target") is not None]
    caps = [n for n in (own.tuning_max_samples, min(reached) if reached else None) if n]
    cap = min(caps) if caps else None
    return cap if cap is not None and cap < (args.max_samples or cap + 1) else None


def tune(own: argparse.Namespace, args: argparse.Namespace, rec: dict[str, Any]) -> None:
    """Fill ``rec['tuning']``: every case at each of its peaks once, from the tuning seed,
    then a case whose best trial lies at an edge of its grid at one peak beyond it
    (``rules.edge_peak``); with ``--tuning-from``, the cases those records tuned at the same
    peaks take their trials and picks, the others are tuned here. Every tuning launch waits
    for an idle machine and is kept in ``tuning['launches']`` (commit, load, other
    processes' CPU share); the trials of a launch whose share was over
    ``rules.MAX_FOREIGN_CPU`` are moved to ``tuning['rejected_trials']`` and tried again (up
    to ``--retries`` times)."""
    tuning = rec["tuning"]
    tuning.setdefault("launches", [])
    tuning.setdefault("rejected_trials", [])
    # a variant takes its base's peak: the bases are tuned, here or in --tuning-from
    tuned = list(dict.fromkeys(driver.family(c) for c in args.cases))
    peaks_of = {c: case_peaks(own, args.workload, c) for c in tuned}
    if own.tuning_from and tuning.get("from") is None:
        for path in own.tuning_from:
            other = json.loads(path.read_text())["tuning"]
            for c in tuned:
                tried = {float(p) for p in other.get("trials", {}).get(c, {})}
                if (c in other.get("chosen", {}) and c not in tuning["chosen"]
                        and {float(p) for p in peaks_of[c]} <= tried):
                    tuning["trials"][c] = other["trials"][c]
                    tuning["chosen"][c] = other["chosen"][c]
        tuning["from"] = " ".join(str(p) for p in own.tuning_from)
    lower_is_better = args.workload == "asr"

    def extension(c: str) -> list[float]:
        """The case's grid edge peak (``rules.edge_peak``), once its grid is tried in full."""
        trials = {float(p): t for p, t in tuning["trials"].get(c, {}).items()}
        edge = rules.edge_peak(trials, peaks_of[c], lower_is_better)
        return [edge] if edge is not None else []

    # the grid's peaks in turn (k), then (k = len(grid)) each case whose best trial lies at an
    # edge of its grid at the peak a factor 2 beyond it
    grid_len = max(len(v) for v in peaks_of.values())
    retries = {k: 0 for k in range(grid_len + 1)}
    k = 0
    while k < len(retries):
        peaks_k = {c: (peaks_of[c] if k < grid_len else extension(c)) for c in tuned}
        index_k = k if k < grid_len else 0
        todo = [c for c in rules.rotated(tuned, k) if index_k < len(peaks_k[c])
                and c not in tuning["chosen"]
                and f"{peaks_k[c][index_k]:g}" not in tuning["trials"].get(c, {})]
        if not todo:
            k += 1
            continue
        peaks = {c: peaks_k[c][index_k] for c in todo}
        driver._progress(f"tuning, peak {k + 1} of each case: {peaks}" if k < grid_len
                         else f"tuning, the grids' edges extended: {peaks}")
        caps = {c: trial_cap(own, args, tuning["trials"].get(c, {})) for c in todo}

        def on_entry(res: dict[str, Any], entry: dict[str, Any],
                     peaks: dict[str, float] = peaks) -> None:
            entry["launch"] = len(tuning["launches"])
            tuning["trials"].setdefault(res["name"], {})[f"{peaks[res['name']]:g}"] = entry

        index = len(tuning["launches"])
        launched = launch(own, args, rec, todo, peaks, on_entry, rules.TUNING_SEED, caps)
        tuning["launches"].append(launched)
        for c in todo:  # every trial names its launch's commit and load
            entry = tuning["trials"].get(c, {}).get(f"{peaks[c]:g}")
            if entry is not None and entry.get("launch") == index:
                entry.update(commit=(launched.get("commit") or {}).get("sha"),
                             load_before=launched["load_before"],
                             foreign_cpu_fraction=launched["foreign_cpu_fraction"])
        foreign = launched.get("foreign_cpu_fraction") or 0.0
        if foreign > rules.MAX_FOREIGN_CPU and retries[k] < own.retries:
            retries[k] += 1
            launched["rejected"] = f"other processes took {foreign:.0%} of the CPU"
            for c in todo:  # tried again, at the same peak
                entry = tuning["trials"].get(c, {}).pop(f"{peaks[c]:g}", None)
                if entry is not None and entry.get("launch") == index:
                    tuning["rejected_trials"].append(dict(entry, case=c))
        save(rec, own.out)
        if launched["status"] != "ok":
            raise SystemExit(f"race campaign: a tuning launch failed ({launched['status']}); "
                             f"start again to go on")
    ddp_trials = {float(p): t for p, t in tuning["trials"].get("ddp", {}).items()}
    if ddp_trials and rules.pick_peak(ddp_trials) is None:
        save(rec, own.out)
        raise SystemExit(f"race campaign: ddp reached the target {args.target:g} at none of the "
                         f"peaks within --max-samples: size the workload (more samples, an "
                         f"--anneal-after schedule) before racing to it")
    for c in tuned:
        if c in tuning["chosen"]:
            continue
        trials = {float(p): t for p, t in tuning["trials"][c].items()}
        # the fewest samples to the target; nobody reached it: the best final metric
        tuning["chosen"][c] = rules.best_trial(trials, lower_is_better)
    for c in args.cases:
        if driver.family(c) != c:
            tuning["chosen"][c] = tuning["chosen"][driver.family(c)]
            tuning.setdefault("as", {})[c] = driver.family(c)
        peak = float(tuning["chosen"][c])
        rec["cases"][c]["peak"] = peak
        rec["cases"][c]["lr"] = rules.case_lr(
            driver.CASES[c], peak, args.nodes, args.procs, rules.OPTIMIZER[args.workload])
    save(rec, own.out)


def check_run(rec: dict[str, Any], run: int, warmup: int) -> dict[str, Any]:
    """Score one run's cases: handicap, other processes' CPU, the DDP hooks' bytes."""
    info = rec["runs"][run]
    entries = {c: next((e for e in case["runs"] if e["run"] == run), None)
               for c, case in rec["cases"].items()}
    entries = {c: e for c, e in entries.items() if e is not None}
    reasons = []
    if rec["slow_node"] is not None:
        info["handicap"] = rules.handicap_check({c: e.get("slowdown")
                                                      for c, e in entries.items()})
        if not info["handicap"]["ok"]:
            reasons.append(f"achieved slowdowns {info['handicap']['min']}-"
                           f"{info['handicap']['max']} differ by more than "
                           f"{rules.HANDICAP_TOLERANCE:.0%}")
    foreign = max(info.get("foreign_cpu_fraction") or [0.0])
    if foreign > rules.MAX_FOREIGN_CPU:
        reasons.append(f"other processes took {foreign:.0%} of the CPU")
    if any(s != "ok" for s in info.get("status", [])):
        reasons.append(f"launch status {info['status']}")
    ddp = entries.get("ddp")
    for c, e in entries.items():
        res = dict(e, name=c, kind=rec["cases"][c]["kind"], period=driver.CASES[c].get("period"))
        check = driver.hook_check(res, ddp and dict(ddp, name="ddp"), warmup)
        if check is not None:
            e["hook_check"] = check
            if not check["ok"]:
                reasons.append(f"{c}: its hook's bytes were not as expected")
    info["rejected"] = "; ".join(reasons) or None
    return info


def narrowed(rec: dict[str, Any], cases: list[str], runs: int) -> dict[str, Any]:
    """After ``runs`` runs: each family's fastest variant (the lowest median time to the target
    over those runs, ties: fewer samples, then the order given), and the variants dropped.
    The families are ``driver.narrowing_family``'s: the ``"auto"`` cases are kept beside
    their base's fastest fixed period.

    >>> rec = {"runs": [], "cases": {
    ...     "postlocal16": {"runs": [{"run": 0, "time_to_target_s": 200.0}]},
    ...     "postlocal64": {"runs": [{"run": 0, "time_to_target_s": 180.0}]},
    ...     "ddp_bf16": {"runs": [{"run": 0, "time_to_target_s": 260.0}]}}}
    >>> narrowed(rec, ["ddp_bf16", "postlocal16", "postlocal64"], 1)["kept"]
    ['ddp_bf16', 'postlocal64']
    """
    def key(c: str) -> tuple[float, float, int]:
        first = [r for r in rules.accepted_runs(rec, c) if r.get("run", 0) < runs]
        times = rules.spread([r.get("time_to_target_s") for r in first])["median"]
        samples = [r.get("samples_to_target") for r in first if r.get("samples_to_target")]
        return (math.inf if times is None else times,
                min(samples) if samples else math.inf, cases.index(c))

    best: dict[str, str] = {}
    for c in cases:
        f = driver.narrowing_family(c)
        if f not in best or key(c) < key(best[f]):
            best[f] = c
    kept = [c for c in cases if best[driver.narrowing_family(c)] == c]
    return {"after_runs": runs, "kept": kept,
            "dropped": {c: f"slower than {best[driver.narrowing_family(c)]} over the first "
                           f"{runs} run(s)" for c in cases if c not in kept}}


def racing(own: argparse.Namespace, args: argparse.Namespace, rec: dict[str, Any],
           run: int) -> list[str]:
    """The cases of run ``run``: all, or with ``--narrow-after N`` from run N on each family's
    fastest variant over the first N runs (recorded in ``rec['narrowed']``)."""
    if own.narrow_after is None or run < own.narrow_after:
        return list(args.cases)
    if rec.get("narrowed") is None:
        rec["narrowed"] = narrowed(rec, list(args.cases), own.narrow_after)
        driver._progress(f"narrowed: {rec['narrowed']}")
    return list(rec["narrowed"]["kept"])


def campaign(own: argparse.Namespace, args: argparse.Namespace) -> dict[str, Any]:
    """Tune, then run until ``--runs`` runs are accepted (or the retries are spent)."""
    rec = load_or_new(own, args)
    save(rec, own.out)
    tune(own, args, rec)
    peaks = {c: float(rec["cases"][c]["peak"]) for c in args.cases}
    run = 0
    while True:
        accepted = sum(1 for r in rec["runs"] if not r.get("rejected") and r.get("done"))
        if accepted >= own.runs or run >= own.runs + own.retries:
            break
        if run >= len(rec["runs"]):
            rec["runs"].append({"run": run, "order": rules.rotated(racing(own, args, rec, run),
                                                                   run),
                                "status": [], "foreign_cpu_fraction": [], "launches": []})
        info = rec["runs"][run]
        if not info.get("done"):
            todo = [c for c in info["order"]
                    if not any(e["run"] == run for e in rec["cases"][c]["runs"])]
            if todo:
                driver._progress(f"run {run}: {todo}")

                def on_entry(res: dict[str, Any], entry: dict[str, Any], run: int = run,
                             offset: int = len(info["order"]) - len(todo)) -> None:
                    entry["run"], entry["position"] = run, entry["position"] + offset
                    rec["cases"][res["name"]]["runs"].append(entry)

                launched = launch(own, args, rec, todo, peaks, on_entry,
                                  rules.run_seed(run))
                info["launches"].append(launched)
                info["status"].append(launched["status"])
                info["foreign_cpu_fraction"].append(launched["foreign_cpu_fraction"])
            info["done"] = all(any(e["run"] == run for e in rec["cases"][c]["runs"])
                               for c in info["order"])
            check_run(rec, run, args.warmup)
            save(rec, own.out)
            if not info["done"]:
                raise SystemExit(f"race campaign: run {run} did not finish every case "
                                 f"({info['status']}); start again to go on")
        run += 1
    save(rec, own.out)
    return rec


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; 0 when it finished, 2 where it cannot run here."""
    own, args = parse(argv)
    skipped = driver.skip_unavailable(args)
    if skipped:
        print(f"race campaign: without these cases: {skipped}", file=sys.stderr)
    reason, warning = driver.preflight(args)
    if reason:
        print(f"race campaign: not run: {reason}", file=sys.stderr)
        return 2
    if warning:
        print(f"race campaign: WARNING: {warning}", file=sys.stderr)
    driver.prepare_corpus(args)
    rec = campaign(own, args)
    score = rec["score"]
    driver._progress(f"wrote {own.out}; claims withheld: {score['withheld'] or 'none'}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("race campaign: interrupted; the record keeps every finished case",
              file=sys.stderr)
        raise SystemExit(130) from None
