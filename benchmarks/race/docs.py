"""The race's parts of the docs, generated from the records in ``benchmarks/results/race/``.

Writes, between markers, the race tables of ``docs/races.md`` (``<!-- race-table:begin -->``
... ``<!-- race-table:end -->``), the decision table by R of ``docs/choosing.md``
(``decision-table``), the README's results sentence (``results-sentence``), the withdrawn
records' table (``withdrawn-table``) and the demo's parity table of ``docs/benchmarks.md``
(``parity-table``, from ``benchmarks/results/parity/demo_parity.json``), wherever those
markers are. ``tests/test_race_docs.py`` checks that the committed docs equal this text.

Campaign records are those of ``benchmarks/race/campaign.py``: the races by regime of R
(schema 3: R measured, ``comm_compute_ratio``, a seed per run, the 12 % target) under
``benchmarks/results/race/regimes/``, and the earlier campaign's (schema 2: target 20 %, R not
measured, seed 0 in every run) under ``benchmarks/results/race/fair/``. Each is scored by
``rules.score`` (claims only where the rules allow them: 3 accepted runs per case, ranges that
do not overlap, a converged target, latency emulated, one clean commit). Every other race
record, from before the rules, is listed as withdrawn with the reasons read from the record
itself.

The decision table (:func:`decision_table`) has a row per regime (:data:`REGIMES`: R, stragglers,
latency) and record: what to use is the case with the lowest median time to the target, with
every case whose runs' range overlaps it; the ``"auto"`` cell is the median of the
``gossip_every_n_steps="auto"`` case over its family's best fixed period's. A regime without a
record of its own shows the schema-2 records raced on the link the campaign uses for it,
labelled as such, or says that it was not raced yet.

    python -m benchmarks.race.docs          # rewrite the marked parts
    python -m benchmarks.race.docs --check  # exit 1 where the docs differ from the records
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.perf.parity_demo import OUT as PARITY
from benchmarks.perf.parity_demo import table as parity_table
from benchmarks.race import driver, rules

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "race"
FAIR = RESULTS / "fair"
REGIME_RECORDS = RESULTS / "regimes"
LOG = "benchmarks/results/race/LOG.md"
WITHDRAWN = "benchmarks/results/race/WITHDRAWN.md"

MARKERS = {
    "race-table": ("<!-- race-table:begin -->", "<!-- race-table:end -->"),
    "results-sentence": ("<!-- results-sentence:begin -->", "<!-- results-sentence:end -->"),
    "withdrawn-table": ("<!-- withdrawn-table:begin -->", "<!-- withdrawn-table:end -->"),
    "parity-table": ("<!-- parity-table:begin -->", "<!-- parity-table:end -->"),
    "decision-table": ("<!-- decision-table:begin -->", "<!-- decision-table:end -->"),
}
"""Name -> (begin, end) markers of a generated part."""

TARGETS = {"docs/choosing.md": ("decision-table",), "docs/races.md": ("race-table",),
           "docs/benchmarks.md": ("parity-table",),
           "README.md": ("results-sentence",), WITHDRAWN: ("withdrawn-table",)}
"""Which generated parts each file may hold (a file without a part's markers is left alone;
each part lives in one file only)."""

WITHDRAWN_SUMMARY = (
    "The earlier races are withdrawn: the library's cases alone got the per-learner learning-rate "
    "rule (unequal tuning), the target was ddp's WER early in training (71-80 %, the blank "
    "phase), every race was one run with ddp always first, and the slow node's handicap "
    "differed per case; no link latency was emulated. In the ASR races, moreover, every case "
    "but adpsgd trained on one chunk of the training set again and again (Lightning never "
    "advanced the race's chunk sampler; adpsgd's shared cursor did).")
"""Why the races before the rules are withdrawn, in one paragraph."""


def wrap(paragraph: str) -> str:
    """A paragraph wrapped at 99 columns, as the docs' prose is."""
    return textwrap.fill(paragraph, width=99, break_long_words=False, break_on_hyphens=False)


def fair_records(folder: Path = FAIR) -> list[tuple[str, dict[str, Any]]]:
    """(file name, record) of every campaign record in ``folder``, by name."""
    if not folder.is_dir():
        return []
    return [(p.name, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]


def regime_records(folder: Path = REGIME_RECORDS) -> list[tuple[str, dict[str, Any]]]:
    """(file name, record) of every record of the races by regime of R (schema 3)."""
    return fair_records(folder)


def tuning_only(rec: dict[str, Any]) -> bool:
    """Whether a campaign record holds a tuning and no race run (``--runs 0``).

    >>> tuning_only({"cases": {"ddp": {"runs": []}}}), tuning_only({"cases": {"ddp": {
    ...     "runs": [{"run": 0}]}}})
    (True, False)
    """
    cases = rec.get("cases")
    return isinstance(cases, dict) and not any(c.get("runs") for c in cases.values())


def r_words(rec: dict[str, Any]) -> str:
    """R as a record states it: measured (schema 3: ``comm_compute_ratio``), or not.

    >>> r_words({"schema": 3, "comm_compute_ratio": 2.173}), r_words({"schema": 2})
    ('R 2.17 (measured)', 'R not measured (schema 2)')
    """
    r = rec.get("comm_compute_ratio")
    if r is not None:
        return f"R {r:.2f} (measured)"
    return f"R not measured (schema {rec.get('schema') or 'before 2'})"


def record_terms(rec: dict[str, Any]) -> str:
    """What a record's claims rest on, in words: its target, its seeds and its R.

    >>> record_terms({"schema": 2, "target": 20.0, "metric": "dev WER, % (lower is better)",
    ...               "cases": {"a": {"runs": [{"run": 0}, {"run": 1}]}}})
    'to 20 % dev WER, one seed for every run, R not measured (schema 2)'
    >>> record_terms({"schema": 3, "target": 12.0, "metric": "dev WER, % (lower is better)",
    ...               "comm_compute_ratio": 2.31, "cases": {"a": {"runs": [
    ...                   {"run": 0, "seed": 1}, {"run": 1, "seed": 2}]}}})
    'to 12 % dev WER, a seed per run, R 2.31 (measured)'
    """
    metric = (rec.get("metric") or "").split(",")[0] or "the metric"
    words = [f"to {rec['target']:g} % {metric}"]
    cases = rec.get("cases") if isinstance(rec.get("cases"), dict) else {}
    runs = [run for case in cases.values() for run in case.get("runs", [])]
    seeded = bool(runs) and all(run.get("seed") is not None for run in runs)
    words.append("a seed per run" if seeded and not rules.seed_problems(rec)
                 else "one seed for every run")
    words.append(r_words(rec))
    return ", ".join(words)


def withdrawal_reasons(rec: dict[str, Any]) -> list[str]:
    """Why a race record from before the rules is not evidence, read from the record.

    >>> print("; ".join(withdrawal_reasons({"workload": "asr", "target": 73.15, "slow_node": 1,
    ...     "config": {"slow_follows_load": True}, "cases": [{"kind": "gossip"}],
    ...     "machine_before": {"loadavg_1_5_15": [0.9, 1, 1]}})))
    learning-rate rule for the library only; target 73.2 % WER (early); only adpsgd saw all \
the data; one run, ddp first; handicap followed each case's load; no latency
    """
    reasons = []
    config = rec.get("config") or {}
    gossip = any(c.get("kind") == "gossip" for c in rec.get("cases", []))
    if rec.get("workload") == "asr" and gossip and "lr_rule" not in rec:
        reasons.append("learning-rate rule for the library only")
    target = rec.get("target")
    if rec.get("workload") == "asr" and target is not None and target > rules.MAX_TARGET_WER:
        reasons.append(f"target {target:.1f} % WER (early)")
    if rec.get("workload") == "asr" and "init_params_sha256" not in (rec.get("cases") or [{}])[0]:
        reasons.append("only adpsgd saw all the data")
    reasons.append("one run, ddp first")
    if rec.get("slow_node") is not None:
        if config.get("slow_follows_load"):
            reasons.append("handicap followed each case's load")
        elif config.get("recalibrate"):
            reasons.append("handicap recalibrated per case")
        else:
            reasons.append("achieved slowdown not recorded")
    if not rec.get("latency_ms"):
        reasons.append("no latency")
    load = (rec.get("machine_before") or {}).get("loadavg_1_5_15", [0])[0]
    if load > rules.DEFAULT_MAX_LOAD:
        reasons.append(f"loaded (load {load:.0f})")
    return reasons


def withdrawn_records(folder: Path = RESULTS) -> list[tuple[str, dict[str, Any]]]:
    """(file name, record) of every race record from before the rules."""
    out = []
    for p in sorted(folder.glob("*.json")):
        rec = json.loads(p.read_text())
        if rec.get("benchmark") == "race":
            out.append((p.name, rec))
    return out


def setting(rec: dict[str, Any]) -> str:
    """A race's setting in words, e.g. ``asr, 2x2 at 200 Mbit/s, 0.5 ms, node 1 slower``."""
    words = f"{rec['workload']}, {rec['nodes']}x{rec['procs']} at {rec['rate_mbit']:g} Mbit/s"
    if rec.get("latency_ms"):
        words += f", {rec['latency_ms']:g} ms"
    if rec.get("slow_node") is not None:
        words += f", node {rec['slow_node']} slower"
        if not rec.get("pin_nodes"):
            words += ", nodes not pinned"
    if rules.remedies_race(rec):
        words += ", the remedies' race"
    return words


def _f(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def fair_table(name: str, rec: dict[str, Any], folder: str = "fair") -> str:
    """One campaign record as a markdown section: setting, target, R, rules, one row per case
    (a tuning record: its setting, R and picks)."""
    if tuning_only(rec):
        return wrap(f"**The tuning: {setting(rec)}** (`benchmarks/results/race/{folder}/{name}`"
                    f"): target {rec['target']:g} % "
                    f"{'dev WER' if rec['workload'] == 'asr' else 'accuracy'}, {r_words(rec)}. "
                    + (tuning_words(rec) or "No peak picked yet."))
    score = rules.score(rec)
    handicap = rec.get("handicap") or {}
    lines = [wrap(f"**{setting(rec)}** (`benchmarks/results/race/{folder}/{name}`): target "
                  f"{rec['target']:g} % {'dev WER' if rec['workload'] == 'asr' else 'accuracy'}"
                  f", validation every {rec.get('eval_every')} samples, {r_words(rec)}"
                  + (f", handicap +{handicap['extra_s_per_step']:.3f} s per step on node "
                     f"{rec['slow_node']}" if handicap.get("extra_s_per_step") else "")
                  + (", nodes pinned to CPUs of their own" if rec.get("pin_nodes") else "")
                  + "."),
             "",
             "| case | peak lr | runs | median s | min-max s | / ddp | / best peer | "
             "vs ddp | vs best peer |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for case, row in score["cases"].items():
        lo_hi = "-" if row["min"] is None else f"{_f(row['min'])}-{_f(row['max'])}"
        lines.append(f"| {case} | {_f(row['lr'], '.3g')} | {row['n']} | {_f(row['median'])} | "
                     f"{lo_hi} | {_f(row['vs_ddp'], '.2f')} | {_f(row['vs_best_peer'], '.2f')}"
                     f" | {row['claim_vs_ddp'] or '-'} | {row['claim_vs_best_peer'] or '-'} |")
    lines.append("")
    if pace := pace_table(rec):
        lines += [wrap("Where the time goes (medians of the runs that reached the target):"),
                  "", pace, ""]
    if tuned := tuning_words(rec):
        lines += [wrap(tuned), ""]
    for auto in auto_comparisons(rec):
        lines += [wrap(auto_sentence(auto)), ""]
    if score["withheld"]:
        lines.append(wrap("No claim from this race: " + "; ".join(score["withheld"]) + "."))
    else:
        lines.append(wrap(f"Best peer: {score['best_peer'] or 'none'}. 'faster'/'slower': "
                          f"every run of the case reached the target before/after every run of "
                          f"the other; '-': the ranges overlap, no claim."))
    return "\n".join(lines)


def pace_table(rec: dict[str, Any]) -> str:
    """Where each case's time goes (empty before any run reached the target): its median
    samples to the target and its median seconds per 1000 samples trained until then, each
    over ddp's. A time ratio is about the product of the two: needing more samples, or
    training each sample more slowly.

    >>> run = lambda t, n: {"time_to_target_s": t, "samples_to_target": n}
    >>> print(pace_table({"cases": {"ddp": {"runs": [run(300.0, 3000)]},
    ...                             "x": {"runs": [run(120.0, 2400), run(None, None)]}}}))
    | case | samples to target | / ddp | s per 1000 samples | / ddp |
    |---|---:|---:|---:|---:|
    | ddp | 3000 | 1.00 | 100.0 | 1.00 |
    | x | 2400 (1 not reached) | 0.80 | 50.0 | 0.50 |
    """
    rows: dict[str, tuple[float, float, int]] = {}
    for case in rec.get("cases", {}):
        runs = [r for r in rules.accepted_runs(rec, case)
                if r.get("samples_to_target") and r.get("time_to_target_s") is not None]
        if runs:
            rows[case] = (statistics.median(r["samples_to_target"] for r in runs),
                          statistics.median(1000 * r["time_to_target_s"] / r["samples_to_target"]
                                            for r in runs),
                          len(rules.accepted_runs(rec, case)) - len(runs))
    if not rows:
        return ""
    base = rows.get("ddp")
    lines = ["| case | samples to target | / ddp | s per 1000 samples | / ddp |",
             "|---|---:|---:|---:|---:|"]
    for case, (samples, pace, missed) in rows.items():
        note = f" ({missed} not reached)" if missed else ""
        lines.append(f"| {case} | {samples:.0f}{note} | "
                     f"{_f(samples / base[0] if base else None, '.2f')} | {pace:.1f} | "
                     f"{_f(pace / base[1] if base else None, '.2f')} |")
    return "\n".join(lines)


def tuning_words(rec: dict[str, Any]) -> str:
    """The tuning's picks in a sentence (empty before any): each case's peak and its samples to
    the target, or that it reached it at no peak.

    >>> words = tuning_words({"tuning": {"peaks": [3e-3, 6e-3], "chosen": {"ddp": 6e-3, "x": 3e-3},
    ...     "trials": {"ddp": {"0.006": {"samples_to_target": 3360}},
    ...                "x": {"0.003": {"samples_to_target": None, "final_metric": 40.9}}}}})
    >>> words.split("target): ", 1)[1]
    'ddp 0.006 (3360 samples), x 0.003 (the target at no peak; final 40.9).'
    """
    tuning = rec.get("tuning") or {}
    chosen, trials = tuning.get("chosen") or {}, tuning.get("trials") or {}
    if not chosen:
        return ""
    picks = []
    for case, peak in chosen.items():
        trial = (trials.get(case) or {}).get(f"{peak:g}") or {}
        samples = trial.get("samples_to_target")
        picks.append(f"{case} {peak:g} ({samples} samples)" if samples is not None else
                     f"{case} {peak:g} (the target at no peak; final "
                     f"{_f(trial.get('final_metric'), '.1f')})")
    peaks = ", ".join(f"{p:g}" for p in tuning.get("peaks") or [])
    return (f"Tuning (peaks {peaks}; the pick: the fewest samples to the target): "
            + ", ".join(picks) + ".")


def withdrawn_table(records: list[tuple[str, dict[str, Any]]]) -> str:
    """The races from before the rules: one row each, with its reasons."""
    lines = ["| withdrawn record | setting | why |", "|---|---|---|"]
    for name, rec in records:
        lines.append(f"| `{name}` | {setting(rec)} | {', '.join(withdrawal_reasons(rec))} |")
    return "\n".join(lines)


def race_part(fair: list[tuple[str, dict[str, Any]]],
              withdrawn: list[tuple[str, dict[str, Any]]],
              regimes: list[tuple[str, dict[str, Any]]] | None = None) -> str:
    """The text between the race-table markers: the races by regime, then the schema-2
    campaign's, then the withdrawn records in a paragraph."""
    parts = [fair_table(name, rec, "regimes") for name, rec in regimes or []]
    if fair:
        if regimes:
            parts.append(wrap("The earlier campaign's records (schema 2: target 20 % dev WER, "
                              "mid-descent; every run from seed 0; R not measured):"))
        parts += [fair_table(name, rec) for name, rec in fair]
    elif not regimes:
        parts.append(wrap("No race has been run under the race rules yet, so no speed-up is "
                          "claimed: ddp, one of its hooks, a periodic averager or a gossip "
                          "strategy may win."))
    parts.append(wrap(WITHDRAWN_SUMMARY + f" They are kept, {len(withdrawn)} records with the "
                      f"reasons per record in `{WITHDRAWN}` and their write-ups in `{LOG}`, "
                      "and are not evidence."))
    return "\n\n".join(parts)


def results_sentence(fair: list[tuple[str, dict[str, Any]]]) -> str:
    """The README's one results sentence: per race with claims, the library case fastest
    against ddp among those faster than ddp in every run (median time over ddp's, and over
    the best peer's with what the ranges allow); the tables hold the rest."""
    races: dict[str, list[str]] = {}  # what the claims rest on -> the races
    verdict = {"faster": "faster in every run", "slower": "slower in every run"}
    for _, rec in fair:
        score = rules.score(rec)
        if score["withheld"] or rules.remedies_race(rec):  # (fewer peers: in the tables)
            continue
        best = score["best_peer"]
        rows = [(row["vs_ddp"], case, row) for case, row in score["cases"].items()
                if row["claim_vs_ddp"] == "faster" and row["vs_ddp"] is not None
                and rules.library_case(rec["cases"][case])]
        if not rows:
            continue
        _, case, row = min(rows)
        vs_best = ""
        if best and row["vs_best_peer"] is not None:
            vs_best = (f" ({row['vs_best_peer']:.2f}x the best peer's, "
                       f"{verdict.get(row['claim_vs_best_peer'], 'the ranges overlap')})")
        races.setdefault(record_terms(rec), []).append(
            f"on {setting(rec)} (best peer `{best}`): `{case}` {row['vs_ddp']:.2f}x{vs_best}")
    if not races:
        return wrap("No speed-up is claimed at present: the earlier races against DDP, its "
                    "compression hooks, post-local SGD and torchft are withdrawn (unequal "
                    "learning rates, an early target, single runs, a handicap that differed "
                    "per case, a sampler that fed every case but adpsgd one chunk of the "
                    "data), and no race has yet been run under the "
                    "[race rules](docs/races.md#race-rules); "
                    "[docs/choosing.md](docs/choosing.md) says how to choose meanwhile.")
    return wrap("Under the [race rules](docs/races.md#race-rules) (equal tuning, 3 runs "
                "each, a claim only where the ranges do not overlap), "
                "median time to the target over ddp's, for the library's fastest case. "
                + " ".join(f"Races {terms}: " + "; ".join(found) + "."
                           for terms, found in races.items())
                + " ([docs/choosing.md](docs/choosing.md))")


# ------------------------------------------------------------------------------------------------
# "auto" against the best fixed period, and the decision table by R (docs/choosing.md)
# ------------------------------------------------------------------------------------------------
AUTO_GOAL = 1.10
"""Issue 47's goal for ``gossip_every_n_steps="auto"``: its median time to the target at most
this times its family's best fixed period's, in each regime."""


def _median_times(rec: dict[str, Any], case: str) -> tuple[float | None, list[float | None]]:
    """(median, the accepted runs' times to the target) of a case (a run that did not reach the
    target counts as infinitely slow: a median that is such a run is None)."""
    times = [r.get("time_to_target_s") for r in rules.accepted_runs(rec, case)]
    return rules.spread(times)["median"], times


def auto_comparisons(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ``gossip_every_n_steps="auto"`` case of a record: its median time to the target over
    that of the fastest fixed period of its family (the base and its ``_p<N>`` variants raced
    to the end; ``ratio`` None where either did not reach the target), the goal met or not,
    and the period each accepted run ended with (rank 0's).

    >>> run = lambda t, p: {"run": 0, "time_to_target_s": t, "auto_period": [
    ...     {"period": p, "decisions": []}]}
    >>> rec = {"cases": {"dpsgd_hier_bf16": {"runs": [{"run": 0, "time_to_target_s": 200.0}]},
    ...     "dpsgd_hier_bf16_p4": {"runs": [{"run": 0, "time_to_target_s": 100.0}]},
    ...     "dpsgd_hier_bf16_pauto": {"runs": [run(105.0, 3)]}}}
    >>> [(a["auto"], a["fixed"], a["ratio"], a["met"], a["periods"])
    ...  for a in auto_comparisons(rec)]
    [('dpsgd_hier_bf16_pauto', 'dpsgd_hier_bf16_p4', 1.05, True, [3])]
    """
    cases = rec.get("cases") if isinstance(rec.get("cases"), dict) else {}
    dropped = set((rec.get("narrowed") or {}).get("dropped") or {})
    out = []
    for name in cases:
        if name not in driver.CASES or not driver.auto_case(name):
            continue
        base = driver.family(name)
        fixed = [n for n in cases if n in driver.CASES and driver.family(n) == base
                 and not driver.auto_case(n) and n not in dropped]
        medians = {n: _median_times(rec, n)[0] for n in fixed}
        reached = [n for n in fixed if medians[n] is not None]
        best = min(reached, key=lambda n: medians[n]) if reached else None
        mine = _median_times(rec, name)[0]
        ratio = (round(mine / medians[best], 3) if best is not None and mine is not None
                 else None)
        periods = []
        for r in rules.accepted_runs(rec, name):
            ranks = r.get("auto_period") or []
            periods.append(ranks[0].get("period") if ranks and ranks[0] else None)
        out.append({"auto": name, "fixed": best, "ratio": ratio,
                    "met": ratio is not None and ratio <= AUTO_GOAL, "periods": periods,
                    "ratios": _auto_ratios(rec, name)})
    return out


def _auto_ratios(rec: dict[str, Any], name: str) -> list[float]:
    """The R of every decision of the accepted runs of an ``"auto"`` case (rank 0's: for
    ``dpsgd`` the same on every rank)."""
    out = []
    for r in rules.accepted_runs(rec, name):
        ranks = r.get("auto_period") or []
        if ranks and ranks[0]:
            out += [d["ratio"] for d in ranks[0].get("decisions", []) if "ratio" in d]
    return out


def auto_sentence(auto: dict[str, Any]) -> str:
    """One ``"auto"`` case against its family's best fixed period, in a sentence."""
    periods = ", ".join("-" if p is None else str(p) for p in auto["periods"]) or "none"
    ratios = auto["ratios"]
    measured = (f"; the R it measured, {min(ratios):.2f}-{max(ratios):.2f}" if ratios else "")
    name = f'`{auto["auto"]}` (`gossip_every_n_steps="auto"`)'
    if auto["fixed"] is None or auto["ratio"] is None:
        verdict = ("its family's fixed periods did not reach the target" if auto["fixed"] is None
                   else "it did not reach the target")
        return f"{name}: {verdict}{measured}; periods at the end of its runs: {periods}."
    goal = "met" if auto["met"] else "missed"
    return (f"{name}: {auto['ratio']:.2f}x the median time of its family's fastest fixed "
            f"period, `{auto['fixed']}` (goal at most {AUTO_GOAL:.2f}x: {goal}); periods at "
            f"the end of its runs: {periods}{measured}.")


def case_words(name: str, case: dict[str, Any] | None = None) -> str:
    """What a race case is, in words (the legend of the decision table).

    >>> case_words("dpsgd_hier_bf16_pauto")
    '`DPSGDStrategy(hierarchical=True, wire_dtype="bf16", gossip_every_n_steps="auto")`'
    >>> case_words("postlocal16"), case_words("ddp_bf16")
    ("torch's post-local SGD, period 16", "`DDPStrategy` with torch's `bf16_compress_hook`")
    """
    spec = dict(driver.CASES.get(name) or case or {})
    kind = spec.get("kind")
    if kind == "gossip":
        cls = {"dpsgd": "DPSGDStrategy", "adpsgd": "ADPSGDStrategy"}.get(
            spec.get("strategy") or "", "GossipStrategy")
        args = ", ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                         for k, v in (spec.get("kwargs") or {}).items())
        return f"`{cls}({args})`"
    if kind == "ddp":
        bucket = spec.get("bucket_cap_mb")
        return ("Lightning's `DDPStrategy`" if bucket is None
                else f"`DDPStrategy(bucket_cap_mb={bucket:g})`")
    if kind == "ddp_bf16":
        return "`DDPStrategy` with torch's `bf16_compress_hook`"
    if kind == "ddp_powersgd":
        return f"`DDPStrategy` with PowerSGD, rank {spec.get('rank')}"
    period = spec.get("period")
    if kind == "postlocal":
        return f"torch's post-local SGD, period {period}"
    if kind == "torchft_localsgd":
        return f"torchft's `LocalSGD`, period {period}"
    if kind == "torchft_diloco":
        outer = ("" if spec.get("outer_lr") is None else
                 f", outer lr {spec['outer_lr']:g}, momentum {spec.get('outer_momentum', 0):g}")
        return f"torchft's `DiLoCo`, period {period}{outer}"
    if kind == "decentdp":
        return f"Decent-DP, `{spec.get('topology')}`"
    return f"`{name}`"


@dataclass(frozen=True)
class Regime:
    """A row of the decision table: the R range, stragglers and latency it stands for, and the
    link the campaign races it on (``benchmarks/race/CAMPAIGN.md``)."""

    key: str
    r: str
    stragglers: str
    latency: str
    link: str


REGIMES = (
    Regime("low", "R < 1", "none", "0.5 ms one way", "200 Mbit/s (`low`)"),
    Regime("mid", "1.5 <= R <= 4", "none", "0.5 ms one way", "30 Mbit/s (`mid`)"),
    Regime("high", "R >= 6", "none", "0.5 ms one way", "8 Mbit/s (`high`)"),
    Regime("slow", "R < 1", "one node about 2x slower", "0.5 ms one way",
           "200 Mbit/s, node 1 slower, nodes pinned (`slow`)"),
    Regime("sites", "any", "none", "25 ms one way (two sites)", "100 Mbit/s (`sites`)"),
)
"""The regimes of issue 47, in the table's order."""

_RATES = {"mid": 30.0, "high": 8.0}
"""A schema-2 record (R not measured) stands in for these regimes only at the campaign's link."""


def regime_of(rec: dict[str, Any]) -> str | None:
    """The key of the regime a record belongs to (``None``: in none: a tuning record, the
    remedies' race, a schema-2 record on a link the campaign does not use for a regime; a
    measured R between two regimes gives ``"between"``). Stragglers and latency first, then R:
    measured (schema 3), or for a schema-2 record the link the campaign races the regime on.

    >>> regime_of({"comm_compute_ratio": 2.2, "latency_ms": 0.5, "cases": {"x": {"runs": [1]}}})
    'mid'
    >>> regime_of({"rate_mbit": 200.0, "latency_ms": 0.5, "cases": {"x": {"runs": [1]}}})
    'low'
    >>> regime_of({"comm_compute_ratio": 1.2, "latency_ms": 0.5, "cases": {"x": {"runs": [1]}}})
    'between'
    """
    if tuning_only(rec) or rules.remedies_race(rec):
        return None
    if rec.get("slow_node") is not None:
        return "slow"
    if (rec.get("latency_ms") or 0) >= 10:
        return "sites"
    r = rec.get("comm_compute_ratio")
    if r is None:
        rate = rec.get("rate_mbit") or 0
        if rate >= 200:
            return "low"
        return next((k for k, v in _RATES.items() if rate == v), None)
    if r < 1:
        return "low"
    if 1.5 <= r <= 4:
        return "mid"
    return "high" if r >= 6 else "between"


def recommendation(rec: dict[str, Any]) -> tuple[str, list[str]]:
    """What a record says to use: the case with the lowest median time to the target, with
    its ratios, and every other case whose runs' range overlaps its own (no claim between
    them); the cases named. Claims withheld by the rules: the reason instead."""
    score = rules.score(rec)
    if score["withheld"]:
        more = len(score["withheld"]) - 1
        return ("no claim: " + score["withheld"][0] + (f" (and {more} more)" if more else ""),
                [])
    rows = {n: row for n, row in score["cases"].items()
            if not row["dropped"] and row["median"] is not None}
    if not rows:
        return "no case reached the target", []
    best = min(rows, key=lambda n: rows[n]["median"])
    times = {n: _median_times(rec, n)[1] for n in rows}
    overlap = [n for n in rows if n != best and rules.claim(times[best], times[n]) is None]
    row = rows[best]
    ratios = []
    if row["vs_ddp"] is not None and best != "ddp":
        ratios.append(f"{row['vs_ddp']:.2f}x ddp's median time")
    peer = score["best_peer"]
    if peer and best != peer and row["vs_best_peer"] is not None:
        ratios.append(f"{row['vs_best_peer']:.2f}x the best peer's (`{peer}`)")
    words = f"`{best}`" + (f" ({', '.join(ratios)})" if ratios else "")
    if overlap:
        words += "; the runs of " + ", ".join(f"`{n}`" for n in overlap) + " overlap its range"
    else:
        words += ", faster than every other case in every run"
    return words, [best, *overlap]


def _record_words(folder: str, name: str, rec: dict[str, Any]) -> str:
    """The record cell: where it is, its target, R, what else it raced."""
    cases = rec.get("cases") if isinstance(rec.get("cases"), dict) else {}
    peers = [n for n in cases if n != "ddp" and not rules.library_case(cases[n])]
    words = (f"`{folder}/{name}`: target {rec.get('target'):g} % dev WER, {r_words(rec)}; "
             f"peers raced: {', '.join(peers) or 'none'}")
    if rec.get("slow_node") is not None and not rec.get("pin_nodes"):
        words += "; nodes not pinned (the slow node's idle CPU could serve the other)"
    return words


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def decision_table(regimes: list[tuple[str, dict[str, Any]]],
                   fair: list[tuple[str, dict[str, Any]]]) -> str:
    """The decision table by R (docs/choosing.md): a row per regime and record; a regime
    without a record of its own takes the schema-2 records raced on its link, or says that it
    was not raced yet. Then the legend of the cases named."""
    lines = ["| R | stragglers | latency | use (lowest median time to the target) | "
             '`"auto"` against the best fixed period | record |',
             "|---|---|---|---|---|---|"]
    named: list[str] = []
    placed = [(regime_of(rec), "regimes", name, rec) for name, rec in regimes]
    standins = [(regime_of(rec), "fair", name, rec) for name, rec in fair]
    rows = list(REGIMES)
    if any(key == "between" for key, *_ in placed):
        rows.append(Regime("between", "between the regimes", "none", "0.5 ms one way", "-"))
    for regime in rows:
        records = [x for x in placed if x[0] == regime.key]
        if not records:
            records = [x for x in standins if x[0] == regime.key]
        if not records:
            lines.append(f"| {regime.r} | {regime.stragglers} | {regime.latency} | not raced yet "
                         f"| not raced yet | none yet (the campaign's link for it: "
                         f"{regime.link}) |")
            continue
        for _, folder, name, rec in records:
            use, cases = recommendation(rec)
            autos = auto_comparisons(rec)
            for c in [*cases, *(c for a in autos for c in (a["auto"], a["fixed"]) if c)]:
                if c not in named:
                    named.append(c)
            auto = "; ".join(
                f"`{a['auto']}` " + ("-" if a["ratio"] is None else
                                     f"{a['ratio']:.2f}x `{a['fixed']}` "
                                     f"({'met' if a['met'] else 'missed'})")
                for a in autos) if autos else "not raced yet"
            r = (f"{rec['comm_compute_ratio']:.2f}" if rec.get("comm_compute_ratio") is not None
                 else "not measured" + (f" ({regime.r} by its link)" if regime.r != "any"
                                        else ""))
            stragglers = regime.stragglers
            handicap = (rec.get("handicap") or {}).get("extra_s_per_step")
            if rec.get("slow_node") is not None and handicap:
                stragglers = f"node {rec['slow_node']} slower by +{handicap:.3f} s per step"
            latency = f"{rec.get('latency_ms'):g} ms one way" + (
                " (two sites)" if (rec.get("latency_ms") or 0) >= 10 else "")
            lines.append(f"| {r} | {stragglers} | {latency} | {_cell(use)} | {_cell(auto)} | "
                         f"{_cell(_record_words(folder, name, rec))} |")
    legend = [f"`{n}`: {case_words(n)}" for n in named]
    if legend:
        lines += ["", wrap("The cases named: " + "; ".join(legend) + ".")]
    return "\n".join(lines)


def generated() -> dict[str, str]:
    """Part name -> its text, from the records now in ``benchmarks/results/race/``."""
    fair = fair_records()
    regimes = regime_records()
    withdrawn = withdrawn_records()
    return {"race-table": race_part(fair, withdrawn, regimes),
            "withdrawn-table": withdrawn_table(withdrawn),
            "results-sentence": results_sentence(regimes + fair),
            "decision-table": decision_table(regimes, fair),
            "parity-table": parity_table(json.loads(PARITY.read_text()))
            if PARITY.exists() else "(not measured yet)"}


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what lies between the markers replaced by ``body`` (on lines of its own).

    >>> replace_between("a\\n<!-- b -->\\nold\\n<!-- e -->\\nz", "<!-- b -->", "<!-- e -->", "new")
    'a\\n<!-- b -->\\nnew\\n<!-- e -->\\nz'
    """
    i = text.index(begin) + len(begin)
    j = text.index(end, i)
    return text[:i] + "\n" + body + "\n" + text[j:]


def render(path: Path, parts: dict[str, str]) -> str | None:
    """``path``'s text with its marked parts generated; None when it has none of them."""
    rel = str(path.relative_to(ROOT)) if path.is_absolute() else str(path)
    text = path.read_text()
    new, found = text, False
    for part in TARGETS.get(rel, ()):
        begin, end = MARKERS[part]
        if begin in new and end in new:
            new, found = replace_between(new, begin, end, parts[part]), True
    return new if found else None


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` compare) the marked parts; 1 where ``--check`` differs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = p.parse_args(argv)
    parts = generated()
    differ = []
    for rel in TARGETS:
        path = ROOT / rel
        new = render(path, parts) if path.exists() else None
        if new is None or new == path.read_text():
            continue
        differ.append(rel)
        if not args.check:
            path.write_text(new)
    verb = "differ from the records" if args.check else "rewritten"
    print(f"race docs: {verb}: {', '.join(differ) or 'none'}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
