"""The race's rules (docs/races.md, "Race rules"), as pure functions the race enforces.

Modelled on MLPerf Training's time-to-train rules: the same tuning procedure for every case, a
converged target, several runs per case with the case order rotated, a claim only where the
ranges of the runs do not overlap, a fixed handicap, the machine idle. Nothing here starts a
process; ``benchmarks/race/driver.py`` and ``benchmarks/race/campaign.py`` call these functions, and
``benchmarks/race/docs.py`` scores the records with them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

MAX_TARGET_WER = 12.0
"""The ASR target must be a dev WER at or below this: close to converged (ddp at 3e-3 first
reached 11.5 % at 4800 samples, 9.4 % at 5280, 7.2 % at 5920:
``benchmarks/results/race/sizing/``), not mid-descent."""

MAX_TARGET_WER_SCHEMA_2 = 20.0
"""The ASR target limit of the records of schema 2 and before (the campaigns of 3-5 Dec 2026
were run and scored under it; :func:`max_target_wer`)."""

SCHEMA = 3
"""Version of the campaign record's layout: 3 adds per-run seeds, ``comm_compute_ratio``,
``link`` (the measured round trip and the delay method), ``pin_nodes`` and the tuning
launches' commit and load."""

MAX_RATIO_STEP = 0.05
"""One validation interval may move a ratio to ddp by at most this: the interval is at most
this fraction of the samples ddp needs to reach the target."""

MIN_RUNS = 3
"""Runs per case (not rejected) before any claim is made from a race."""

HANDICAP_TOLERANCE = 0.10
"""With a slow node, the cases' achieved slowdowns of one run may differ by at most this
(largest over smallest, minus 1); otherwise the run is rejected."""

MAX_FOREIGN_CPU = 0.10
"""A run is rejected when processes not of the race used more than this fraction of the
machine's CPU time during it (the machine was not idle)."""

DEFAULT_MAX_LOAD = 1.0
"""The race refuses to start above this 1-minute load average (``--max-load``)."""

DATA_CENTRE = {"rate_mbit": 200.0, "latency_ms": 0.5}
"""Link of the data-centre races: rate each way, one-way delay (``tc netem`` or
``testbed/link_delay.py``)."""

TWO_SITES = {"rate_mbit": 100.0, "latency_ms": 25.0}
"""Link of the race between two sites."""

PEAK_LRS = {"asr": (3e-3, 6e-3, 1.2e-2), "digits": (0.05, 0.1, 0.2)}
"""The three peak rates every case is tried at (before the per-learner rule), per workload:
ddp's rate, twice and four times it (the two-rate tuning of schema 2 picked the top rate for
most cases). A case may name its own three (``"peaks"`` in ``driver.CASES``: DiLoCo's grid
reaches a lower inner rate)."""

TUNING_SEED = 0
"""Seed of every tuning trial (initialisation and data order)."""

RUN_SEED_BASE = 1
"""Run ``k`` of every case trains from seed ``RUN_SEED_BASE + k`` (:func:`run_seed`)."""


def run_seed(run: int) -> int:
    """The seed of run ``run`` (initialisation and data order): distinct per run, the same for
    every case's run ``run``, so run ``k`` compares like with like, and not the tuning's.

    >>> [run_seed(k) for k in range(3)], TUNING_SEED
    ([1, 2, 3], 0)
    """
    return RUN_SEED_BASE + run


def max_target_wer(schema: int | None) -> float:
    """The ASR target limit a record is scored under: :data:`MAX_TARGET_WER` from schema 3 on,
    :data:`MAX_TARGET_WER_SCHEMA_2` for the records made before it (None: before schemas).

    >>> max_target_wer(3), max_target_wer(2), max_target_wer(None)
    (12.0, 20.0, 20.0)
    """
    return MAX_TARGET_WER if (schema or 0) >= 3 else MAX_TARGET_WER_SCHEMA_2

OPTIMIZER = {"asr": "adam", "digits": "sgd"}
"""The optimizer of each workload (the rule's factor applies to Adam only)."""

REMEDY_SUFFIXES = ("_overlap", "_avg16", "_outer16", "_balanced")
"""Case names ending so are the remedies' (issue 29, deliverable 4), raced next to their
baselines in a race of their own."""


def remedies_race(rec: dict[str, Any]) -> bool:
    """Whether a record is the remedies' race (its peers are fewer than the main race's).

    >>> remedies_race({"cases": {"ddp": {}, "dpsgd_hier_bf16_overlap": {}}})
    True
    >>> remedies_race({"cases": {"ddp": {}, "dpsgd_hier_bf16": {}}})
    False
    """
    cases = rec.get("cases")  # (a list in the records from before the rules)
    return isinstance(cases, dict) and any(name.endswith(REMEDY_SUFFIXES) for name in cases)


TUNING_WORDS = (
    "Every case was run once, from seed {seed} (initialisation and data order), at each of its "
    "three peak rates ({peaks}: ddp's rate, twice and four times it; a case may name its own "
    "three, as DiLoCo's lower inner rate); a case whose learners run one optimizer each between "
    "averages (dpsgd, adpsgd, post-local SGD, torchft LocalSGD, DiLoCo's inner optimizer, "
    "Decent-DP) has that peak multiplied by sqrt(learners) (Adam; 1 for SGD), the rule of "
    "docs/strategies.md; each case then races at the peak that reached the target with the "
    "fewest samples (ties: the shorter time); a case whose best trial (or, where none reached "
    "the target, the best final metric) lay at an edge of its three was run once more at twice "
    "that edge or half of it. Every tuning launch started on an idle machine and "
    "is recorded with its commit, its load and the CPU share other processes took; a launch "
    "over the runs' limit of that share is tried again. Options other than the peak (periods, "
    "DiLoCo's outer optimizer, ddp's bucket size, PowerSGD's rank, the gossip period) are cases "
    "of their own, raced side by side; the best peer is the one with the lowest median.")
"""The tuning procedure, in words (the record's ``tuning.procedure``)."""


def learners(case: dict[str, Any], nodes: int, procs: int) -> int:
    """Independent optimizers between two averages of ``case`` on ``nodes`` x ``procs`` ranks.

    ddp and its hooks step one model on the mean gradient: 1. Post-local SGD, torchft's
    LocalSGD and DiLoCo all-reduce gradients inside a node and average across nodes every
    period: one learner per node. Gossip: one per rank, or per node when hierarchical.

    >>> learners({"kind": "ddp"}, 2, 2), learners({"kind": "postlocal"}, 2, 2)
    (1, 2)
    >>> learners({"kind": "gossip", "kwargs": {}}, 2, 2)
    4
    >>> learners({"kind": "gossip", "kwargs": {"hierarchical": True}}, 2, 2)
    2
    >>> learners({"kind": "torchft_diloco"}, 4, 1), learners({"kind": "decentdp"}, 2, 2)
    (4, 4)
    """
    kind = case["kind"]
    if kind in ("ddp", "ddp_bf16", "ddp_powersgd"):
        return 1
    if kind in ("postlocal", "torchft_localsgd", "torchft_diloco"):
        return max(1, nodes)
    if kind == "decentdp":  # an optimizer per rank, gossip between ranks
        return max(1, nodes * procs)
    if kind == "gossip":
        if case.get("kwargs", {}).get("hierarchical"):
            return max(1, nodes)
        return max(1, nodes * procs)
    raise ValueError(f"unknown case kind {kind!r}")


def lr_factor(case: dict[str, Any], nodes: int, procs: int, optimizer: str) -> float:
    """The rule's factor on the peak rate: sqrt(learners) under Adam, 1 under SGD.

    >>> lr_factor({"kind": "postlocal"}, 2, 2, "adam") == 2 ** 0.5
    True
    >>> lr_factor({"kind": "gossip", "kwargs": {}}, 2, 2, "adam")
    2.0
    >>> lr_factor({"kind": "gossip", "kwargs": {}}, 2, 2, "sgd")
    1.0
    """
    if optimizer != "adam":
        return 1.0
    return math.sqrt(learners(case, nodes, procs))


def case_lr(case: dict[str, Any], peak: float, nodes: int, procs: int, optimizer: str) -> float:
    """The peak rate ``case`` trains at: ``peak`` times the rule's factor (rounded, 6 digits).

    >>> case_lr({"kind": "ddp"}, 3e-3, 2, 2, "adam")
    0.003
    >>> case_lr({"kind": "torchft_localsgd"}, 3e-3, 2, 2, "adam")
    0.00424264
    """
    return float(f"{peak * lr_factor(case, nodes, procs, optimizer):.6g}")


def pick_peak(trials: dict[float, dict[str, Any]]) -> float | None:
    """The tuning pick: the peak whose trial reached the target with the fewest samples (ties:
    the shorter time); None when no trial reached it.

    >>> pick_peak({3e-3: {"samples_to_target": 3200, "time_to_target_s": 300.0},
    ...            6e-3: {"samples_to_target": 2880, "time_to_target_s": 280.0}})
    0.006
    >>> pick_peak({3e-3: {"samples_to_target": None, "time_to_target_s": None}}) is None
    True
    """
    def key(item: tuple[float, dict[str, Any]]) -> tuple[float, float]:
        t = item[1]
        return (_inf(t.get("samples_to_target")), _inf(t.get("time_to_target_s")))

    reached = [item for item in trials.items() if item[1].get("samples_to_target") is not None]
    return min(reached, key=key)[0] if reached else None


def best_trial(trials: dict[float, dict[str, Any]], lower_is_better: bool) -> float | None:
    """The tuning pick (:func:`pick_peak`), or, where no trial reached the target, the peak
    with the best final metric (None: no trial)."""
    pick = pick_peak(trials)
    if pick is not None or not trials:
        return pick
    sign = -1.0 if lower_is_better else 1.0

    def score(peak: float) -> float:
        metric = trials[peak].get("final_metric")
        return sign * metric if metric is not None else -math.inf

    return max(trials, key=score)


def edge_peak(trials: dict[float, dict[str, Any]], grid: Sequence[float],
              lower_is_better: bool) -> float | None:
    """The one peak a case's grid is extended by: when its best trial (:func:`best_trial`)
    lies at an edge of its grid, the peak a factor 2 beyond that edge, once (the grid's best
    may lie outside it: Decent-DP and DiLoCo at their lowest peaks); None when the best is
    inside, the grid is not tried in full, or the extension was tried.

    >>> g = (3e-3, 6e-3, 1.2e-2)
    >>> t = {p: {"samples_to_target": None, "final_metric": m}
    ...      for p, m in zip(g, (15.3, 33.0, 40.0))}
    >>> edge_peak(t, g, lower_is_better=True)
    0.0015
    >>> t[1.5e-3] = {"samples_to_target": 6400, "time_to_target_s": 250.0}
    >>> edge_peak(t, g, lower_is_better=True) is None
    True
    >>> edge_peak({p: {"samples_to_target": 4800 - i, "time_to_target_s": 1.0}
    ...            for i, p in enumerate(g)}, g, lower_is_better=True)
    0.024
    """
    if len(grid) < 2 or any(p not in trials for p in grid) or len(trials) > len(grid):
        return None
    best = best_trial(trials, lower_is_better)
    lo, hi = min(grid), max(grid)
    if best == lo:
        return lo / 2
    if best == hi:
        return hi * 2
    return None


def rotated(cases: Sequence[str], run: int) -> list[str]:
    """The case order of run ``run``: rotated by ``run`` places (no case always first).

    >>> rotated(["ddp", "a", "b"], 0), rotated(["ddp", "a", "b"], 1), rotated(["ddp", "a"], 3)
    (['ddp', 'a', 'b'], ['a', 'b', 'ddp'], ['a', 'ddp'])
    """
    if not cases:
        return []
    k = run % len(cases)
    return list(cases[k:]) + list(cases[:k])


def _inf(x: float | None) -> float:
    return math.inf if x is None else float(x)


def spread(times: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of a case's times to the target (a run that did not reach it counts
    as infinitely slow; a median that is such a run is None).

    >>> spread([300.0, 280.0, 310.0])
    {'n': 3, 'median': 300.0, 'min': 280.0, 'max': 310.0, 'not_reached': 0}
    >>> spread([300.0, None, None])
    {'n': 3, 'median': None, 'min': 300.0, 'max': None, 'not_reached': 2}
    """
    values = sorted(_inf(t) for t in times)
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "not_reached": 0}

    def fin(x: float) -> float | None:
        return None if math.isinf(x) else x

    return {"n": len(values), "median": fin(statistics.median(values)), "min": fin(values[0]),
            "max": fin(values[-1]), "not_reached": sum(t is None for t in times)}


def claim(a: Sequence[float | None], b: Sequence[float | None],
          min_runs: int = MIN_RUNS) -> str | None:
    """``"faster"`` when every run of ``a`` reached the target before every run of ``b``,
    ``"slower"`` when the reverse, None when the ranges overlap or either has fewer than
    ``min_runs`` runs (a run that did not reach the target is infinitely slow).

    >>> claim([100, 110, 120], [130, 150, 140])
    'faster'
    >>> claim([100, 110, 135], [130, 150, 140]) is None
    True
    >>> claim([200, 210, 220], [100, 110, 120]), claim([100, 110, 120], [130, None, 140])
    ('slower', 'faster')
    >>> claim([100, 110], [130, 150]) is None
    True
    >>> claim([None, None, None], [None, None, None]) is None
    True
    """
    if len(a) < min_runs or len(b) < min_runs:
        return None
    a_max, a_min = max(_inf(t) for t in a), min(_inf(t) for t in a)
    b_max, b_min = max(_inf(t) for t in b), min(_inf(t) for t in b)
    if a_max < b_min:
        return "faster"
    if b_max < a_min:
        return "slower"
    return None


def handicap_check(slowdowns: dict[str, float | None],
                   tolerance: float = HANDICAP_TOLERANCE) -> dict[str, Any]:
    """Whether the cases of one run saw the same handicap: largest over smallest achieved
    slowdown at most ``1 + tolerance``.

    >>> handicap_check({"ddp": 2.0, "adpsgd": 2.1})["ok"]
    True
    >>> handicap_check({"ddp": 1.8, "adpsgd": 2.1})
    {'ok': False, 'min': 1.8, 'max': 2.1, 'spread': 0.1667, 'tolerance': 0.1, 'missing': []}
    """
    known = {k: v for k, v in slowdowns.items() if v is not None}
    missing = sorted(k for k, v in slowdowns.items() if v is None)
    if not known:
        return {"ok": False, "min": None, "max": None, "spread": None, "tolerance": tolerance,
                "missing": missing}
    lo, hi = min(known.values()), max(known.values())
    ratio = hi / lo - 1.0 if lo > 0 else math.inf
    return {"ok": ratio <= tolerance + 1e-9 and not missing, "min": round(lo, 4),
            "max": round(hi, 4), "spread": round(ratio, 4), "tolerance": tolerance,
            "missing": missing}


def slowdown(extra_s: float, local_step_s: float) -> float | None:
    """A slow node's achieved step-time ratio: (its local step + the extra sleep) over its local
    step, the local step under training's contention estimated right before the case (the
    worker's ``achieved_local_step``: its step alone now, times the calibration's contention).

    >>> slowdown(0.7, 0.7), slowdown(0.7, 0.0)
    (2.0, None)
    """
    if local_step_s <= 0:
        return None
    return round((local_step_s + extra_s) / local_step_s, 4)


def target_problems(workload: str, target: float | None, eval_every: int,
                    ddp_samples_to_target: float | None,
                    max_wer: float = MAX_TARGET_WER) -> list[str]:
    """What makes a race's target or validation interval break the rules (empty: none);
    ``max_wer``: the ASR target limit (:func:`max_target_wer` of the record's schema).

    >>> target_problems("asr", 12.0, 160, 4800)
    []
    >>> for problem in target_problems("asr", 20.0, 320, 1920):
    ...     print(problem)
    target dev WER 20 % is above 12 % (not converged)
    validation every 320 samples is 0.167 of ddp's 1920 samples to the target (> 0.05)
    >>> target_problems("asr", 20.0, 160, 3840, max_wer=20.0), target_problems("asr", None, 0, None)
    ([], ['no fixed target'])
    """
    problems = []
    if target is None:
        problems.append("no fixed target")
    elif workload == "asr" and target > max_wer:
        problems.append(f"target dev WER {target:g} % is above {max_wer:g} % "
                        f"(not converged)")
    if ddp_samples_to_target:
        step = eval_every / ddp_samples_to_target
        if step > MAX_RATIO_STEP + 1e-9:
            problems.append(f"validation every {eval_every} samples is {step:.3f} of ddp's "
                            f"{ddp_samples_to_target:g} samples to the target "
                            f"(> {MAX_RATIO_STEP:g})")
    return problems


def busy_jiffies(proc_stat_cpu_line: str) -> tuple[int, int]:
    """(busy, total) jiffies of ``/proc/stat``'s ``cpu`` line (idle and iowait are not busy).

    >>> busy_jiffies("cpu  100 5 50 800 20 3 2 0 0 0")
    (160, 980)
    """
    fields = [int(x) for x in proc_stat_cpu_line.split()[1:]]
    total = sum(fields[:8])
    return total - fields[3] - fields[4], total


def foreign_cpu_fraction(busy_s: float, own_cpu_s: float, elapsed_s: float,
                         cpus: int) -> float:
    """Share of the machine's CPU time used by processes that are not the race's.

    >>> foreign_cpu_fraction(busy_s=190.0, own_cpu_s=180.0, elapsed_s=100.0, cpus=2)
    0.05
    """
    if elapsed_s <= 0 or cpus <= 0:
        return 0.0
    return round(max(0.0, busy_s - own_cpu_s) / (elapsed_s * cpus), 4)


def load_problem(load_1min: float, max_load: float) -> str | None:
    """Why the machine is not idle enough to race (None: it is).

    >>> load_problem(0.3, 1.0) is None
    True
    >>> load_problem(3.5, 1.0)
    '1-minute load 3.5 is above 1 (the machine is not idle)'
    """
    if load_1min > max_load:
        return f"1-minute load {load_1min:g} is above {max_load:g} (the machine is not idle)"
    return None


TOP_KEYS = ("workload", "target", "latency_ms", "rate_mbit", "slow_node", "tuning")
"""Keys every fair race record has at its top (besides ``cases``)."""

TOP_KEYS_SCHEMA_3 = ("comm_compute_ratio", "comm_compute", "link", "pin_nodes")
"""Keys a record of schema 3 or later has at its top as well: R and its two terms, the
cluster's measured round trip and delay method, whether the nodes ran on CPUs of their own."""

RUN_KEYS = ("time_to_target_s", "lr", "curve")
"""Keys every run of a case has (plus ``slowdown`` with a slow node)."""


def validate_record(rec: dict[str, Any]) -> list[str]:
    """What a race record lacks against the schema of the rules (empty: valid).

    >>> validate_record({"workload": "asr"})[:2]
    ['missing top key target', 'missing top key latency_ms']
    """
    problems = [f"missing top key {k}" for k in TOP_KEYS if k not in rec]
    cases = rec.get("cases")
    if not isinstance(cases, dict) or not cases:
        return problems + ["cases must be a non-empty mapping of case name to its runs"]
    tuning = rec.get("tuning")
    if "tuning" in rec and not (isinstance(tuning, dict) and tuning.get("procedure")):
        problems.append("tuning must say its procedure in words")
    for name, case in cases.items():
        runs = case.get("runs") if isinstance(case, dict) else None
        if not isinstance(runs, list):
            problems.append(f"{name}: no runs list")
            continue
        for i, run in enumerate(runs):
            for key in RUN_KEYS:
                if key not in run:
                    problems.append(f"{name} run {i}: missing {key}")
            if rec.get("slow_node") is not None and "slowdown" not in run:
                problems.append(f"{name} run {i}: missing slowdown (slow node set)")
            t = run.get("time_to_target_s")
            if t is not None and not (isinstance(t, (int, float)) and t >= 0):
                problems.append(f"{name} run {i}: time_to_target_s {t!r} is not a duration")
    if (rec.get("schema") or 0) >= 3:
        problems += [f"missing top key {k}" for k in TOP_KEYS_SCHEMA_3 if k not in rec]
        link = rec.get("link") or {}
        if "link" in rec and (rec.get("latency_ms") or 0) > 0 and not (
                link.get("rtt_ms") and link.get("delay_method")):
            problems.append("link must keep the measured round trip and the delay method")
        problems += seed_problems(rec)
    return problems


def seed_problems(rec: dict[str, Any]) -> list[str]:
    """What breaks the seed rule in a record (empty: none): every run of a case has a ``seed``,
    a case's runs have distinct seeds, and run ``k`` has the same seed in every case.

    >>> seed_problems({"cases": {"a": {"runs": [{"run": 0, "seed": 1}, {"run": 1, "seed": 2}]},
    ...                          "b": {"runs": [{"run": 0, "seed": 1}, {"run": 1, "seed": 2}]}}})
    []
    >>> for p in seed_problems({"cases": {"a": {"runs": [{"run": 0, "seed": 0},
    ...                                                  {"run": 1, "seed": 0}]},
    ...                                   "b": {"runs": [{"run": 0, "seed": 5}, {"run": 1}]}}}):
    ...     print(p)
    a: runs 0, 1 share seed 0
    b run 1: no seed
    run 0: seeds differ between cases ([0, 5])
    """
    problems, by_run = [], {}
    cases = rec.get("cases") if isinstance(rec.get("cases"), dict) else {}
    for name, case in cases.items():
        seen: dict[int, list[Any]] = {}
        for i, run in enumerate(case.get("runs", [])):
            if run.get("seed") is None:
                problems.append(f"{name} run {run.get('run', i)}: no seed")
                continue
            seen.setdefault(run["seed"], []).append(run.get("run", i))
            by_run.setdefault(run.get("run", i), set()).add(run["seed"])
        problems += [f"{name}: runs {', '.join(str(r) for r in runs)} share seed {seed}"
                     for seed, runs in seen.items() if len(runs) > 1]
    problems += [f"run {k}: seeds differ between cases ({sorted(seeds)})"
                 for k, seeds in sorted(by_run.items()) if len(seeds) > 1]
    return problems


def accepted_runs(rec: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The runs of case ``name`` that count: not in a run the race rejected."""
    rejected = {r["run"] for r in rec.get("runs", []) if r.get("rejected")}
    return [r for r in rec["cases"][name]["runs"]
            if r.get("run") not in rejected and not r.get("rejected")]


def library_case(case: dict[str, Any]) -> bool:
    """Whether a case is one of the library's strategies (gossip), not ddp or a peer."""
    return case.get("kind") == "gossip"


def code_changed(changes: Sequence[str]) -> bool:
    """Whether a tree that differs from its commit in ``changes`` (tracked paths) ran other
    code: a change outside ``benchmarks/results/``, where races write their records.

    >>> code_changed(["benchmarks/results/race/a.json"]), code_changed(["lightning_gossip/x.py"])
    (False, True)
    """
    return any(not p.startswith("benchmarks/results/") for p in changes)


def _dirty(commit: dict[str, Any]) -> bool:
    """A launch's tree ran code other than its commit's (a record without ``changes``, written
    before they were kept: its ``dirty`` flag counted any change)."""
    changes = commit.get("changes")
    return bool(commit.get("dirty")) if changes is None else code_changed(changes)


def score(rec: dict[str, Any]) -> dict[str, Any]:
    """Per case the spread of its accepted runs, its median over ddp's and over the best
    peer's, and the claims the rules allow against ddp and the best peer; plus why claims are
    withheld for the whole race (``withheld``: empty when none).

    The best peer is the peer (not ddp, not a library case) with the lowest median.
    """
    withheld = list(validate_record(rec))
    if rec.get("latency_ms") in (None, 0, 0.0):
        withheld.append("no link latency emulated")
    if rec.get("allow_load"):
        withheld.append("started on a loaded machine (--allow-load)")
    shas = {(launch.get("commit") or {}).get("sha") for r in rec.get("runs", [])
            for launch in r.get("launches", [])}
    dirty = any(_dirty(launch.get("commit") or {}) for r in rec.get("runs", [])
                for launch in r.get("launches", []))
    if len(shas) > 1 or dirty:
        withheld.append("runs not all from one clean commit")
    ddp_samples = None
    cases = rec.get("cases", {}) if isinstance(rec.get("cases"), dict) else {}
    times = {n: [r.get("time_to_target_s") for r in accepted_runs(rec, n)] for n in cases}
    if "ddp" in cases:
        samples = [r.get("samples_to_target") for r in accepted_runs(rec, "ddp")]
        samples = [s for s in samples if s is not None]
        ddp_samples = statistics.median(samples) if samples else None
    elif rec.get("ddp_reference"):
        # fp32 ddp left out where its step is several times every other case's (R >= 1.5):
        # its samples to the target, which the link does not change (the same seeds, the same
        # data order, deterministic all-reduces), come from the race it ran in
        ddp_samples = rec["ddp_reference"].get("samples_to_target")
    else:
        withheld.append("no ddp case")
    withheld += target_problems(rec.get("workload", ""), rec.get("target"),
                                int(rec.get("eval_every") or 0), ddp_samples,
                                max_target_wer(rec.get("schema")))
    # variants a campaign dropped after its first runs (``--narrow-after``): shown, no claim
    dropped = set((rec.get("narrowed") or {}).get("dropped") or {})
    short = sorted(n for n, t in times.items() if len(t) < MIN_RUNS and n not in dropped)
    if short:
        withheld.append(f"fewer than {MIN_RUNS} accepted runs: {', '.join(short)}")
    spreads = {n: spread(t) for n, t in times.items()}
    peers = [n for n in cases if n != "ddp" and not library_case(cases[n])
             and spreads[n]["median"] is not None and n not in dropped]
    best = min(peers, key=lambda n: spreads[n]["median"]) if peers else None
    ddp_median = spreads.get("ddp", {}).get("median")
    out: dict[str, Any] = {"withheld": withheld, "best_peer": best, "cases": {}}
    for n in cases:
        med = spreads[n]["median"]
        row = dict(spreads[n], lr=cases[n].get("lr"))
        row["vs_ddp"] = round(med / ddp_median, 3) if med is not None and ddp_median else None
        best_med = spreads[best]["median"] if best else None
        row["vs_best_peer"] = round(med / best_med, 3) if med is not None and best_med else None
        row["claim_vs_ddp"] = (None if withheld or n == "ddp" or n in dropped
                               else claim(times[n], times.get("ddp", [])))
        row["claim_vs_best_peer"] = (None if withheld or best is None or n == best
                                     or n in dropped else claim(times[n], times[best]))
        row["dropped"] = n in dropped
        out["cases"][n] = row
    return out
