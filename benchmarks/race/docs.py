"""The race's parts of the docs, generated from the records in ``benchmarks/results/race/``.

Writes, between markers, the race tables of ``docs/choosing.md`` and ``docs/races.md``
(``<!-- race-table:begin -->`` ... ``<!-- race-table:end -->``), the README's results
sentence (``<!-- results-sentence:begin -->`` ... ``<!-- results-sentence:end -->``) and the
demo's parity table of ``docs/benchmarks.md`` (``parity-table``, from
``benchmarks/results/parity/demo_parity.json``), wherever those markers are.
``tests/test_race_docs.py`` checks that the committed docs equal this text.

Fair records are the campaign records of ``benchmarks/race/campaign.py`` under
``benchmarks/results/race/fair/``; each is scored by ``rules.score`` (claims only where
the rules allow them: 3 accepted runs per case, ranges that do not overlap, a converged target,
latency emulated, one clean commit). Every other race record there, from before the rules, is
listed as withdrawn with the reasons read from the record itself.

    python -m benchmarks.race.docs          # rewrite the marked parts
    python -m benchmarks.race.docs --check  # exit 1 where the docs differ from the records
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.perf.parity_demo import OUT as PARITY
from benchmarks.perf.parity_demo import table as parity_table
from benchmarks.race import rules

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "race"
FAIR = RESULTS / "fair"
LOG = "benchmarks/results/race/LOG.md"
WITHDRAWN = "benchmarks/results/race/WITHDRAWN.md"

MARKERS = {
    "race-table": ("<!-- race-table:begin -->", "<!-- race-table:end -->"),
    "results-sentence": ("<!-- results-sentence:begin -->", "<!-- results-sentence:end -->"),
    "withdrawn-table": ("<!-- withdrawn-table:begin -->", "<!-- withdrawn-table:end -->"),
    "parity-table": ("<!-- parity-table:begin -->", "<!-- parity-table:end -->"),
}
"""Name -> (begin, end) markers of a generated part."""

TARGETS = {"docs/choosing.md": ("race-table",), "docs/races.md": ("race-table",),
           "docs/benchmarks.md": ("parity-table",),
           "README.md": ("results-sentence",), WITHDRAWN: ("withdrawn-table",)}
"""Which generated parts each file may hold (a file without a part's markers is left alone)."""

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
    """(file name, record) of every campaign record, by name."""
    if not folder.is_dir():
        return []
    return [(p.name, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]


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
    if rules.remedies_race(rec):
        words += ", the remedies' race"
    return words


def _f(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def fair_table(name: str, rec: dict[str, Any]) -> str:
    """One campaign record as a markdown section: setting, target, rules, one row per case."""
    score = rules.score(rec)
    handicap = rec.get("handicap") or {}
    lines = [wrap(f"**{setting(rec)}** (`benchmarks/results/race/fair/{name}`): target "
                  f"{rec['target']:g} % {'dev WER' if rec['workload'] == 'asr' else 'accuracy'}"
                  f", validation every {rec.get('eval_every')} samples"
                  + (f", handicap +{handicap['extra_s_per_step']:.3f} s per step on node "
                     f"{rec['slow_node']}" if handicap.get("extra_s_per_step") else "") + "."),
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
              withdrawn: list[tuple[str, dict[str, Any]]]) -> str:
    """The text between the race-table markers."""
    parts = []
    if fair:
        parts += [fair_table(name, rec) for name, rec in fair]
    else:
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
    races = []
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
        races.append(f"on {setting(rec)} (best peer `{best}`): `{case}` "
                     f"{row['vs_ddp']:.2f}x{vs_best}")
    if not races:
        return wrap("No speed-up is claimed at present: the earlier races against DDP, its "
                    "compression hooks, post-local SGD and torchft are withdrawn (unequal "
                    "learning rates, an early target, single runs, a handicap that differed "
                    "per case, a sampler that fed every case but adpsgd one chunk of the "
                    "data), and no race has yet been run under the "
                    "[race rules](docs/races.md#race-rules); "
                    "[docs/choosing.md](docs/choosing.md) says how to choose meanwhile.")
    return wrap("Under the [race rules](docs/races.md#race-rules) (equal tuning, a "
                "converged target, 3 runs each, a claim only where the ranges do not overlap), "
                "median time to the target over ddp's, for the library's fastest case "
                + "; ".join(races) + " ([docs/choosing.md](docs/choosing.md)).")


def generated() -> dict[str, str]:
    """Part name -> its text, from the records now in ``benchmarks/results/race/``."""
    fair = fair_records()
    withdrawn = withdrawn_records()
    return {"race-table": race_part(fair, withdrawn), "withdrawn-table": withdrawn_table(withdrawn),
            "results-sentence": results_sentence(fair),
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
