"""A race under the race rules: tuning, repeated runs in rotated order, one record per driver.

Needs root, as ``benchmarks/driver.py`` (whose arguments it takes, plus its own). One campaign
record (``--out``) holds one race setting (workload, layout, link, slow node):

1. **Tuning** (once per workload; ``--tuning-from`` reuses another record's): every case runs
   once at each peak rate of ``--peaks`` (``rules.PEAK_LRS``), with the per-learner rule
   applied to every method alike (``rules.case_lr``); each case keeps the peak that reached
   the target with the fewest samples (``rules.pick_peak``; none reached: the best final
   metric). The procedure, every trial and the picks are in ``tuning``.
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

Usage (the campaign of docs/races.md, "Race rules")::

    sudo python -m benchmarks.race.campaign --workload asr --nodes 2 --procs 2 --rate 200 \\
        --latency-ms 0.5 --target 20 --eval-every 160 --max-samples 9600 --runs 3 \\
        --cases ddp ddp_bf16 postlocal16 torchft_localsgd torchft_diloco dpsgd_hier_bf16 \\
        adpsgd_hier_bf16 --out benchmarks/results/race/fair/asr_2x2_200mbit_0.5ms.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.race import driver, rules

SCHEMA = 2
"""Version of the campaign record's layout (``rules.validate_record``)."""

SAME_SETTING = ("workload", "nodes", "procs", "rate_mbit", "latency_ms", "slow_node", "target",
                "eval_every", "max_samples", "batch_size")
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
    own, rest = p.parse_known_args(argv)
    if "--json" in rest or "--png" in rest:
        p.error("the campaign writes --out; --json/--png are not taken")
    args = driver.parse_args(rest)
    if args.target is None or not (args.max_samples or args.budget):
        p.error("a campaign races to a fixed --target with --max-samples (or --budget)")
    own.peaks = tuple(own.peaks or rules.PEAK_LRS[args.workload])
    return own, args


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
        "tuning": {"procedure": rules.TUNING_WORDS.format(
            peaks=", ".join(f"{x:g}" for x in own.peaks)),
            "peaks": list(own.peaks), "trials": {}, "chosen": {}, "from": None},
        "handicap": None if args.slow_node is None else {
            "extra_s_per_step": args.slow_extra_s,
            "how": "given (--slow-extra-s)" if args.slow_extra_s is not None else None},
        "command": sys.argv, "commit": driver.commit(), "machine": driver.machine(),
        "cases": {c: {"kind": driver.CASES[c]["kind"], "peak": None, "lr": None, "runs": []}
                  for c in args.cases},
        "runs": [],
    }


def save(rec: dict[str, Any], path: Path) -> None:
    """Write the record atomically, with its current score (``rules.score``)."""
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
    keep = ("lr", "curve", "curve_samples", "final_metric", "steps", "steps_per_rank",
            "bytes_per_step_inter_node", "bytes_per_step_after_warmup", "expected_hook_ratio",
            "load_during", "init_params_sha256", "slowdown", "slow_local_step_s",
            "slow_extra_s", "calibration_steps_s", "slow_slept_per_step_s", "slow_alone_step_s",
            "torchft_commits")
    entry = {k: res.get(k) for k in keep}
    entry.update(run=run, position=position,
                 time_to_target_s=driver.time_to(res["curve"], target, higher_is_better),
                 samples_to_target=driver.samples_to(res, higher_is_better),
                 finished_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    return entry


def launch(own: argparse.Namespace, args: argparse.Namespace, rec: dict[str, Any],
           cases: list[str], peaks: dict[str, float], on_entry: Any) -> dict[str, Any]:
    """One race launch of ``cases`` (in this order) at ``peaks``; what the launch recorded."""
    problem = wait_idle(args, 0.0 if args.allow_load else own.settle_s)
    if problem and not args.allow_load:
        raise SystemExit(f"race campaign: stopped before a launch: {problem}")
    sub = argparse.Namespace(**vars(args))
    sub.cases = list(cases)
    sub.case_peaks = dict(peaks)
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
            "foreign_cpu_fraction": payload["foreign_cpu_fraction"],
            "commit": payload["commit"], "wall_s": round(payload["wall_s"], 1)}


def tune(own: argparse.Namespace, args: argparse.Namespace, rec: dict[str, Any]) -> None:
    """Fill ``rec['tuning']``: every case at every peak once; with ``--tuning-from``, the cases
    that record tuned take its trials and picks (the same peaks), the others are tuned here."""
    tuning = rec["tuning"]
    if own.tuning_from and tuning.get("from") is None:
        for path in own.tuning_from:
            other = json.loads(path.read_text())["tuning"]
            if [float(p) for p in other["peaks"]] != [float(p) for p in own.peaks]:
                raise SystemExit(f"race campaign: {path} tried the peaks "
                                 f"{other['peaks']}, not {list(own.peaks)}")
            for c in args.cases:
                if c in other.get("chosen", {}) and c not in tuning["chosen"]:
                    tuning["trials"][c] = other["trials"][c]
                    tuning["chosen"][c] = other["chosen"][c]
        tuning["from"] = " ".join(str(p) for p in own.tuning_from)
    for k, peak in enumerate(own.peaks):
        todo = [c for c in rules.rotated(args.cases, k)
                if f"{peak:g}" not in tuning["trials"].get(c, {})]
        if not todo:
            continue
        driver._progress(f"tuning at peak {peak:g}: {todo}")

        def on_entry(res: dict[str, Any], entry: dict[str, Any], peak: float = peak) -> None:
            tuning["trials"].setdefault(res["name"], {})[f"{peak:g}"] = entry

        launch(own, args, rec, todo, {c: peak for c in todo}, on_entry)
    ddp_trials = {float(p): t for p, t in tuning["trials"].get("ddp", {}).items()}
    if ddp_trials and rules.pick_peak(ddp_trials) is None:
        save(rec, own.out)
        raise SystemExit(f"race campaign: ddp reached the target {args.target:g} at none of the "
                         f"peaks within --max-samples: size the workload (more samples, an "
                         f"--anneal-after schedule) before racing to it")
    for c in args.cases:
        if c in tuning["chosen"]:
            continue
        trials = {float(p): t for p, t in tuning["trials"][c].items()}
        pick = rules.pick_peak(trials)
        if pick is None:  # nobody reached the target: the best final metric
            sign = -1.0 if args.workload == "asr" else 1.0
            pick = max(trials, key=lambda p: sign * (trials[p].get("final_metric") or -1e9))
        tuning["chosen"][c] = pick
    for c in args.cases:
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
            rec["runs"].append({"run": run, "order": rules.rotated(args.cases, run),
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

                launched = launch(own, args, rec, todo, peaks, on_entry)
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
    skipped = driver.skip_torchft(args)
    if skipped:
        print(f"race campaign: without the torchft cases: {skipped}", file=sys.stderr)
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
