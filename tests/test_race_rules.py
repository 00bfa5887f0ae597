"""The race's scoring on stored records: ``summarise``, ``ratios`` and ``hook_check``
(``benchmarks/race/driver.py``) and the race rules (``benchmarks/race/rules.py``: handicap check,
range-overlap claims, schema, tuning pick, the score of a campaign record).

Pure functions on JSON: no process is started. The stored race records were scored by the race
when they were made; re-scoring their raw curves must give the same numbers, and the checks
must fail where a record breaks them.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import pytest

from benchmarks.race import driver, rules
from testbed.launch import ROOT

RECORDS = ROOT / "benchmarks" / "results" / "race"
DERIVED = ("time_to_target_s", "metric_at_ddp_time", "hook_check", "time_ratio_vs_ddp",
           "time_ratio_vs_best_peer", "samples_to_target")


def _raw(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A stored record and its cases without what ``summarise`` derives."""
    rec = json.loads((RECORDS / name).read_text())
    cases = [{k: v for k, v in copy.deepcopy(c).items() if k not in DERIVED}
             for c in rec["cases"]]
    return rec, cases


@pytest.mark.parametrize("name", ["asr_2x2_200mbit_idle.json", "asr_2x2_25mbit_torchft.json"])
def test_summarise_reproduces_a_stored_record(name: str) -> None:
    rec, cases = _raw(name)
    out = driver.summarise(cases, higher_is_better=False, warmup=rec["config"]["warmup"])
    for mine, stored in zip(out, rec["cases"]):
        for key in DERIVED[:-1]:
            a, b = mine.get(key), stored.get(key)
            if key == "hook_check" and a is not None and b is not None:  # (its words moved)
                a, b = ({k: v for k, v in x.items() if k != "what"} for x in (a, b))
            assert a == b, (stored["name"], key)
    # asr_2x2_200mbit_idle: ddp reached 73.15 % at its own 1920 samples
    if name == "asr_2x2_200mbit_idle.json":
        ddp = next(c for c in out if c["name"] == "ddp")
        assert ddp["time_ratio_vs_ddp"] == 1.0 and ddp["samples_to_target"] == 1920


def test_hook_check_fails_when_the_hook_sent_ddp_s_bytes() -> None:
    rec, cases = _raw("asr_2x2_200mbit_idle.json")
    ddp = next(c for c in cases if c["name"] == "ddp")
    bf16 = next(c for c in cases if c["name"] == "ddp_bf16")
    post = next(c for c in cases if c["name"] == "postlocal16")
    warmup = rec["config"]["warmup"]
    assert driver.hook_check(bf16, ddp, warmup)["ok"]
    assert driver.hook_check(post, ddp, warmup)["ok"]
    skipped = dict(bf16, bytes_per_step_inter_node=ddp["bytes_per_step_inter_node"])
    check = driver.hook_check(skipped, ddp, warmup)
    assert not check["ok"] and check["measured_ratio"] == 1.0
    unsynced = dict(post, bytes_per_step_after_warmup=ddp["bytes_per_step_inter_node"])
    assert not driver.hook_check(unsynced, ddp, warmup)["ok"]
    assert driver.hook_check(ddp, ddp, warmup) is None  # ddp has no hook to check


def test_ratios_use_ddp_and_the_best_peer() -> None:
    results = [{"name": "ddp", "time_to_target_s": 100.0},
               {"name": "ddp_bf16", "time_to_target_s": 80.0},
               {"name": "postlocal16", "time_to_target_s": 60.0},
               {"name": "adpsgd_hier_bf16", "time_to_target_s": 30.0},
               {"name": "dpsgd", "time_to_target_s": None}]
    driver.ratios(results)
    got = {r["name"]: (r["time_ratio_vs_ddp"], r["time_ratio_vs_best_peer"]) for r in results}
    assert got == {"ddp": (1.0, 1.667), "ddp_bf16": (0.8, 1.333), "postlocal16": (0.6, 1.0),
                   "adpsgd_hier_bf16": (0.3, 0.5), "dpsgd": (None, None)}


def test_the_rule_applies_to_every_method_with_an_optimizer_per_learner() -> None:
    lrs = {c: rules.case_lr(driver.CASES[c], 3e-3, 2, 2, "adam") for c in driver.CASES}
    rule = round(3e-3 * 2 ** 0.5, 8)
    for c in ("postlocal4", "postlocal16", "torchft_localsgd", "torchft_diloco",
              "dpsgd_hier_bf16", "adpsgd_hier_bf16"):
        assert lrs[c] == pytest.approx(rule, rel=1e-5), c
    for c in ("dpsgd", "adpsgd", "adpsgd_bf16"):  # 4 learners
        assert lrs[c] == pytest.approx(6e-3), c
    for c in ("ddp", "ddp_bf16", "ddp_powersgd2", "ddp_powersgd4"):
        assert lrs[c] == 3e-3, c
    assert {rules.case_lr(driver.CASES[c], 0.05, 2, 2, "sgd") for c in driver.CASES} == {0.05}


def test_handicap_check_rejects_slowdowns_more_than_10_percent_apart() -> None:
    assert rules.handicap_check({"ddp": 1.95, "adpsgd": 2.0, "dpsgd": 2.1})["ok"]
    bad = rules.handicap_check({"ddp": 1.9, "adpsgd": 2.1})
    assert not bad["ok"] and bad["spread"] == pytest.approx(0.1053, abs=1e-4)
    assert not rules.handicap_check({"ddp": 2.0, "adpsgd": None})["ok"]  # unmeasured: rejected
    # the stored per-case sleep of the withdrawn --slow-follows-load race fails it
    rec = json.loads((RECORDS / "asr_4x1_200mbit_slow1_idle.json").read_text())
    slept = {c["name"]: max(c["slow_slept_per_step_s"]) for c in rec["cases"]}
    assert not rules.handicap_check(slept)["ok"]


def test_claims_only_where_ranges_do_not_overlap() -> None:
    assert rules.claim([100, 105, 110], [120, 130, 125]) == "faster"
    assert rules.claim([120, 130, 125], [100, 105, 110]) == "slower"
    assert rules.claim([100, 105, 121], [120, 130, 125]) is None  # 121 > 120: overlap
    assert rules.claim([100, 105], [120, 130]) is None  # 2 runs: too few
    assert rules.claim([100, 105, 110], [None, None, None]) == "faster"
    assert rules.claim([100, None, 110], [120, 130, 125]) is None


def test_rotation_puts_every_case_first_once() -> None:
    cases = ["ddp", "ddp_bf16", "adpsgd_hier_bf16"]
    assert [rules.rotated(cases, r)[0] for r in range(3)] == cases
    assert all(sorted(rules.rotated(cases, r)) == sorted(cases) for r in range(5))


def test_target_and_resolution_rules() -> None:
    assert rules.target_problems("asr", 12.0, 160, 4800) == []
    assert len(rules.target_problems("asr", 12.5, 160, 4800)) == 1
    assert len(rules.target_problems("asr", 20.0, 160, 3200)) == 1  # converged: 12 % or lower
    assert len(rules.target_problems("asr", 12.0, 320, 3200)) == 1  # 0.1 > 0.05
    # the records of schema 2 were made and are scored under the 20 % limit of their time
    old = rules.max_target_wer(2)
    assert rules.target_problems("asr", 20.0, 160, 3200, old) == []
    assert len(rules.target_problems("asr", 20.5, 160, 3200, old)) == 1
    # every withdrawn asr record breaks the target rule
    for path in sorted(RECORDS.glob("asr_*.json")):
        rec = json.loads(path.read_text())
        assert rules.target_problems("asr", rec["target"], 320, None), path.name


def fair_record(times: dict[str, list[float | None]], **top: Any) -> dict[str, Any]:
    """A campaign record with these times (3 runs each unless given), valid by default."""
    runs = max(len(t) for t in times.values())
    rec: dict[str, Any] = {
        "workload": "asr", "target": 20.0, "latency_ms": 0.5, "rate_mbit": 200.0,
        "slow_node": None, "eval_every": 160, "nodes": 2, "procs": 2,
        "tuning": {"procedure": "each case at its best of 3e-3 and 6e-3, the rule for all"},
        "runs": [{"run": r, "launches": [{"commit": {"sha": "abc", "dirty": False}}]}
                 for r in range(runs)],
        "cases": {name: {"kind": driver.CASES[name]["kind"], "lr": 3e-3, "runs": [
            {"run": r, "time_to_target_s": t, "samples_to_target": 3200, "lr": 3e-3,
             "curve": [[0.0, 100.0], [t or 999.0, 19.0]]} for r, t in enumerate(ts)]}
            for name, ts in times.items()},
    }
    rec.update(top)
    return rec


def test_score_claims_under_the_rules_and_withholds_otherwise() -> None:
    times = {"ddp": [300.0, 310.0, 305.0], "ddp_bf16": [250.0, 260.0, 240.0],
             "postlocal16": [200.0, 230.0, 210.0], "adpsgd_hier_bf16": [150.0, 160.0, 205.0]}
    score = rules.score(fair_record(times))
    assert score["withheld"] == [] and score["best_peer"] == "postlocal16"
    row = score["cases"]["adpsgd_hier_bf16"]
    assert (row["median"], row["min"], row["max"]) == (160.0, 150.0, 205.0)
    assert row["vs_ddp"] == round(160 / 305, 3) and row["vs_best_peer"] == round(160 / 210, 3)
    assert row["claim_vs_ddp"] == "faster"
    assert row["claim_vs_best_peer"] is None  # 205 overlaps postlocal16's 200-230
    assert score["cases"]["postlocal16"]["claim_vs_ddp"] == "faster"
    # each broken rule withholds every claim
    for top in ({"latency_ms": 0.0}, {"target": 73.15}, {"eval_every": 320},
                {"allow_load": True}):
        broken = rules.score(fair_record(times, **top))
        assert broken["withheld"], top
        assert all(r["claim_vs_ddp"] is None for r in broken["cases"].values()), top
    two = rules.score(fair_record({k: v[:2] for k, v in times.items()}))
    assert any("fewer than 3" in w for w in two["withheld"])
    mixed = fair_record(times)
    mixed["runs"][1]["launches"][0]["commit"] = {"sha": "def", "dirty": False}
    assert "runs not all from one clean commit" in rules.score(mixed)["withheld"]
    # a tree that differed from the commit only in the race's own records ran the same code
    results = fair_record(times)
    results["runs"][1]["launches"][0]["commit"] = {
        "sha": "abc", "dirty": True, "changes": ["benchmarks/results/race/fair/x.json"]}
    assert not rules.score(results)["withheld"]
    for commit in ({"sha": "abc", "dirty": True},  # before changes were kept: any change
                   {"sha": "abc", "dirty": False, "changes": ["benchmarks/race/rules.py"]}):
        results["runs"][1]["launches"][0]["commit"] = commit
        assert "runs not all from one clean commit" in rules.score(results)["withheld"]


def test_a_rejected_run_does_not_count() -> None:
    times = {"ddp": [300.0, 310.0, 305.0, 500.0], "adpsgd_hier_bf16": [150.0, 160.0, 170.0, 90.0]}
    rec = fair_record(times)
    rec["runs"][3]["rejected"] = "achieved slowdowns 1.8-2.1 differ by more than 10%"
    assert [r["run"] for r in rules.accepted_runs(rec, "ddp")] == [0, 1, 2]
    assert rules.score(rec)["cases"]["adpsgd_hier_bf16"]["min"] == 150.0


def test_validate_record_names_what_is_missing() -> None:
    rec = fair_record({"ddp": [1.0, 2.0, 3.0]}, slow_node=1)
    problems = rules.validate_record(rec)
    assert problems == [f"ddp run {i}: missing slowdown (slow node set)" for i in range(3)]
    del rec["tuning"]
    del rec["cases"]["ddp"]["runs"][0]["lr"]
    problems = rules.validate_record(rec)
    assert "missing top key tuning" in problems and "ddp run 0: missing lr" in problems
    assert rules.validate_record({"cases": {}})[-1].startswith("cases must be")


def test_pick_peak_takes_the_fewest_samples() -> None:
    trials = {3e-3: {"samples_to_target": 3520, "time_to_target_s": 300.0},
              6e-3: {"samples_to_target": 3200, "time_to_target_s": 310.0},
              1.2e-2: {"samples_to_target": None, "time_to_target_s": None}}
    assert rules.pick_peak(trials) == 6e-3
    trials[3e-3]["samples_to_target"] = 3200  # a tie: the shorter time
    assert rules.pick_peak(trials) == 3e-3


def test_foreign_cpu_and_proc_stat() -> None:
    busy, total = rules.busy_jiffies("cpu  10 0 10 70 10 0 0 0 0 0")
    assert (busy, total) == (20, 100)
    assert rules.foreign_cpu_fraction(150.0, 140.0, 50.0, 2) == 0.1
    assert rules.foreign_cpu_fraction(100.0, 140.0, 50.0, 2) == 0.0  # never negative


def schema3_record(times: dict[str, list[float | None]], **top: Any) -> dict[str, Any]:
    """:func:`fair_record` as the campaign writes it from schema 3 on: a seed per run, R, the
    link measured, the pinning flag, the 12 % target."""
    rec = fair_record(times, schema=3, target=12.0, comm_compute_ratio=0.55,
                      comm_compute={"comm_compute_ratio": 0.55, "replica_transfer_s": 0.196,
                                    "compute_step_s": 0.357},
                      link={"rtt_ms": 1.04, "delay_method": "nfqueue"}, pin_nodes=False)
    for case in rec["cases"].values():
        for run in case["runs"]:
            run["seed"] = rules.run_seed(run["run"])
    rec.update(top)
    return rec


def test_each_run_has_its_own_seed_the_same_in_every_case() -> None:
    seeds = [rules.run_seed(k) for k in range(5)]
    assert len(set(seeds)) == 5 and rules.TUNING_SEED not in seeds
    times = {"ddp": [300.0, 310.0, 305.0], "postlocal16": [200.0, 230.0, 210.0]}
    rec = schema3_record(times)
    assert rules.validate_record(rec) == [] and rules.score(rec)["withheld"] == []
    same = copy.deepcopy(rec)  # every run from seed 0, as the races of schema 2 were
    for case in same["cases"].values():
        for run in case["runs"]:
            run["seed"] = 0
    assert "ddp: runs 0, 1, 2 share seed 0" in rules.validate_record(same)
    assert rules.score(same)["withheld"]
    mixed = copy.deepcopy(rec)  # run 1 of one case from another seed: not like with like
    mixed["cases"]["postlocal16"]["runs"][1]["seed"] = 9
    assert "run 1: seeds differ between cases ([2, 9])" in rules.validate_record(mixed)
    missing = copy.deepcopy(rec)
    del missing["cases"]["ddp"]["runs"][2]["seed"]
    assert "ddp run 2: no seed" in rules.validate_record(missing)


def test_schema_3_enforces_the_12_percent_target_and_keeps_r_and_the_link() -> None:
    times = {"ddp": [300.0, 310.0, 305.0], "postlocal16": [200.0, 230.0, 210.0]}
    early = rules.score(schema3_record(times, target=20.0))["withheld"]
    assert "target dev WER 20 % is above 12 % (not converged)" in early
    assert rules.score(fair_record(times, target=20.0))["withheld"] == []  # schema 2's rule
    for key in rules.TOP_KEYS_SCHEMA_3:
        rec = schema3_record(times)
        del rec[key]
        assert f"missing top key {key}" in rules.validate_record(rec), key
        assert rules.score(rec)["withheld"], key
    no_rtt = schema3_record(times, link={"rtt_ms": None, "delay_method": "netem"})
    assert "link must keep the measured round trip and the delay method" in \
        rules.validate_record(no_rtt)
    # no latency asked: no round trip to keep (the record is withheld for that already)
    assert rules.validate_record(schema3_record(times, latency_ms=0.0, link={})) == []


def test_a_race_without_ddp_takes_its_samples_from_a_reference() -> None:
    times = {"ddp_bf16": [300.0, 310.0, 305.0], "postlocal16": [200.0, 230.0, 210.0]}
    assert "no ddp case" in rules.score(schema3_record(times))["withheld"]
    ref = schema3_record(times, ddp_reference={"samples_to_target": 4800})
    assert rules.score(ref)["withheld"] == []
    coarse = schema3_record(times, ddp_reference={"samples_to_target": 1600})
    assert any("validation every 160" in w for w in rules.score(coarse)["withheld"])


def test_issue_47_cases_are_built_as_named() -> None:
    from benchmarks.race import campaign, worker

    cases = driver.CASES
    for period in (4, 16, 64):
        assert cases[f"postlocal{period}"]["period"] == period
        for lr, momentum in ((1.0, 0.0), (0.7, 0.9), (0.8, 0.5)):
            diloco = cases[f"torchft_diloco{period}_o{round(lr * 10)}m{round(momentum * 10)}"]
            assert (diloco["period"], diloco["outer_lr"], diloco["outer_momentum"]) == (
                period, lr, momentum)
    assert cases["torchft_localsgd4"]["period"] == 4 and cases["torchft_localsgd"]["period"] == 16
    assert (cases["ddp_b1"]["bucket_cap_mb"], cases["ddp_b4"]["bucket_cap_mb"]) == (1.0, 4.0)
    assert cases["decentdp"]["topology"] == "alternating-exp-ring"
    assert rules.learners(cases["decentdp"], 2, 2) == 4
    # the identity point's inner rates reach one below ddp's
    ns = argparse.Namespace(peaks=rules.PEAK_LRS["asr"])
    assert campaign.case_peaks(ns, "asr", "torchft_diloco16_o10m0")[0] < rules.PEAK_LRS["asr"][0]
    assert campaign.case_peaks(ns, "asr", "ddp") == rules.PEAK_LRS["asr"]
    assert len(rules.PEAK_LRS["asr"]) == 3
    # the gossip period goes to the strategy only where it is not 1: today's cases still run
    # on a library without the option
    p4 = cases["dpsgd_hier_bf16_p4"]
    assert worker.library_kwargs(p4) == {"hierarchical": True, "wire_dtype": "bf16",
                                         "gossip_every_n_steps": 4}
    assert "gossip_every_n_steps" not in worker.library_kwargs(
        {"kwargs": dict(p4["kwargs"], gossip_every_n_steps=1)})
    for name in ("dpsgd_hier_bf16", "adpsgd_hier_bf16", "dpsgd", "adpsgd_bf16"):
        assert driver.library_option_problem(cases[name]) is None, name
    problem = driver.library_option_problem(p4)
    assert problem is None or "gossip_every_n_steps" in problem


def test_ddp_bucket_size_reaches_the_strategy() -> None:
    from datetime import timedelta

    from benchmarks.race import worker

    strategy = worker.make_strategy(driver.CASES["ddp_b4"], timedelta(seconds=30))
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 4.0}
    assert worker.make_strategy(driver.CASES["ddp"], timedelta(seconds=30))._ddp_kwargs == {}


def test_narrowing_keeps_each_family_s_fastest_and_drops_the_rest_from_claims() -> None:
    from benchmarks.race import campaign

    times = {"ddp_bf16": [300.0, 310.0, 305.0], "postlocal16": [200.0, 230.0, 210.0],
             "postlocal64": [180.0], "dpsgd_hier_bf16": [150.0, 160.0, 170.0],
             "dpsgd_hier_bf16_p4": [190.0]}
    rec = schema3_record(times, ddp_reference={"samples_to_target": 4800})
    narrowed = campaign.narrowed(rec, list(times), 1)
    assert narrowed["kept"] == ["ddp_bf16", "postlocal64", "dpsgd_hier_bf16"]
    assert set(narrowed["dropped"]) == {"postlocal16", "dpsgd_hier_bf16_p4"}
    # as the campaign records it when postlocal16 won the first run
    rec["narrowed"] = {"after_runs": 1, "kept": ["ddp_bf16", "postlocal16", "dpsgd_hier_bf16"],
                       "dropped": {"postlocal64": "slower", "dpsgd_hier_bf16_p4": "slower"}}
    score = rules.score(rec)
    assert score["withheld"] == []  # the dropped variants' single runs withhold nothing
    assert score["best_peer"] == "postlocal16"  # not postlocal64's single 180 s
    assert score["cases"]["postlocal64"]["dropped"]
    assert score["cases"]["postlocal64"]["claim_vs_best_peer"] is None
    assert score["cases"]["dpsgd_hier_bf16"]["claim_vs_best_peer"] == "faster"


def test_variants_take_their_base_s_peak_and_trials_stop_where_they_cannot_win() -> None:
    from benchmarks.race import campaign

    assert driver.family("postlocal64") == "postlocal16"
    assert driver.family("torchft_diloco16_o10m0") == "torchft_diloco16_o7m9"
    assert driver.family("torchft_diloco16_o7m9") == "torchft_diloco16_o7m9"
    assert driver.family("ddp_b1") == "ddp" and driver.family("decentdp_ring") == "decentdp"
    assert driver.family("adpsgd_hier_bf16_p16") == "adpsgd_hier_bf16"
    own = argparse.Namespace(tuning_max_samples=None)
    args = argparse.Namespace(max_samples=9600)
    assert campaign.trial_cap(own, args, {"0.003": {"samples_to_target": 5120}}) == 5120
    assert campaign.trial_cap(own, args, {"0.003": {"samples_to_target": None}}) is None
    own.tuning_max_samples = 7200
    assert campaign.trial_cap(own, args, {"0.003": {"samples_to_target": None}}) == 7200


def test_a_tuning_record_is_a_ddp_reference(tmp_path: Any) -> None:
    from benchmarks.race import campaign

    tuning_only = {"cases": {"ddp": {"runs": []}}, "runs": [], "target": 12.0, "tuning": {
        "chosen": {"ddp": 0.006}, "trials": {"ddp": {
            "0.003": {"samples_to_target": 4800}, "0.006": {"samples_to_target": 4480}}}}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(tuning_only))
    ref = campaign.ddp_reference(path)
    assert ref["samples_to_target"] == 4480 and ref["how"] == "ddp's picked tuning trial"
    raced = schema3_record({"ddp": [300.0, 310.0, 305.0]})
    for sample, run in zip((4480, 4800, 4640), raced["cases"]["ddp"]["runs"]):
        run["samples_to_target"] = sample
    path.write_text(json.dumps(raced))
    assert campaign.ddp_reference(path)["samples_to_target"] == 4640


def test_the_auto_cases_race_beside_their_family_s_fastest_fixed_period() -> None:
    """``*_hier_bf16_pauto``: ``gossip_every_n_steps="auto"`` reaches the strategy, the base's
    peak is theirs, ``--narrow-after`` keeps them next to the fastest fixed period of their
    base (the goal compares the two over every run), and the record keeps each run's
    decisions."""
    from benchmarks.race import campaign, worker

    for s in ("dpsgd", "adpsgd"):
        name = f"{s}_hier_bf16_pauto"
        case = driver.CASES[name]
        assert worker.library_kwargs(case) == {"hierarchical": True, "wire_dtype": "bf16",
                                               "gossip_every_n_steps": "auto"}
        assert case["strategy"] == s and rules.library_case(case)
        assert driver.family(name) == f"{s}_hier_bf16" and driver.auto_case(name)
        assert driver.narrowing_family(name) == name
        assert rules.learners(case, 2, 2) == 2  # hierarchical: one learner per node
        assert driver.library_option_problem(case) is None  # the library takes "auto"
    assert not any(driver.auto_case(c) for c in driver.CASES if not c.endswith("_pauto"))
    times = {"ddp_bf16": [300.0], "dpsgd_hier_bf16": [170.0], "dpsgd_hier_bf16_p4": [150.0],
             "dpsgd_hier_bf16_p16": [160.0], "dpsgd_hier_bf16_pauto": [155.0],
             "adpsgd_hier_bf16": [150.0], "adpsgd_hier_bf16_pauto": [165.0]}
    rec = schema3_record(times, ddp_reference={"samples_to_target": 4800})
    narrowed = campaign.narrowed(rec, list(times), 1)
    assert narrowed["kept"] == ["ddp_bf16", "dpsgd_hier_bf16_p4", "dpsgd_hier_bf16_pauto",
                                "adpsgd_hier_bf16", "adpsgd_hier_bf16_pauto"]
    # each run keeps the decisions the worker gathered from every rank
    decisions = {"period": 3, "decisions": [{"step": 11, "period": 3, "compute_ms": 200.0,
                                             "exchange_ms": 500.0, "ratio": 2.5}],
                 "postponed": []}
    res = {"name": "dpsgd_hier_bf16_pauto", "target": 12.0, "curve": [[0.0, 100.0],
           [120.0, 11.5]], "curve_samples": [0, 4800], "auto_period": [decisions] * 4}
    entry = campaign.run_entry(res, False, 0, 0)
    assert entry["auto_period"] == [decisions] * 4 and entry["time_to_target_s"] == 120.0
