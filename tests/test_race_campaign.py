"""The campaign's bookkeeping (``benchmarks/race/campaign.py``) without processes: its
``launch`` (one race launch on the emulated cluster, exercised for real by
``tests/test_race_smoke.py``) is replaced by one that reports made-up cases, so that the tuning's
rules can be checked exactly: every trial from the tuning seed and named with its launch's
commit and load, a launch on a busy machine tried again, variants taking their base's peak,
later trials capped at the samples the case's best trial needed, R and the link at the top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.race import campaign, rules

SAMPLES = {("ddp", 3e-3): 4800, ("ddp", 6e-3): 4480, ("ddp", 1.2e-2): None,
           ("postlocal16", 3e-3): 5440, ("postlocal16", 6e-3): 5120,
           ("postlocal16", 1.2e-2): 5120,
           ("decentdp", 1.5e-3): 6400, ("decentdp", 3e-3): None, ("decentdp", 6e-3): None,
           ("decentdp", 1.2e-2): None}
"""Samples to the target of each made-up tuning trial (None: not reached)."""

FINAL = {("decentdp", 3e-3): 15.3, ("decentdp", 6e-3): 33.0, ("decentdp", 1.2e-2): 41.0}
"""The final WER of the made-up trials that did not reach the target (others: 30)."""


class FakeLaunches:
    """Stands in for ``campaign.launch``: reports each case from ``SAMPLES``; the first launch
    saw a busy machine (other processes took half of the CPU)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, own: Any, args: Any, rec: dict[str, Any], cases: list[str],
                 peaks: dict[str, float], on_entry: Any, seed: int,
                 caps: dict[str, int | None] | None = None) -> dict[str, Any]:
        self.calls.append({"cases": list(cases), "peaks": dict(peaks), "seed": seed,
                           "caps": dict(caps or {})})
        for i, c in enumerate(cases):
            samples = SAMPLES[(c, peaks[c])]
            end = samples or 9600
            res = {"name": c, "target": 12.0, "seed": seed, "lr": peaks[c],
                   "curve": [[0.0, 100.0], [end / 20, 11.0 if samples else 30.0]],
                   "curve_samples": [0, end],
                   "final_metric": 11.0 if samples else FINAL.get((c, peaks[c]), 30.0)}
            on_entry(res, campaign.run_entry(res, False, None, i))
        busy = len(self.calls) == 1
        return {"status": "ok", "load_before": 0.25, "seed": seed,
                "foreign_cpu_fraction": 0.5 if busy else 0.01,
                "commit": {"sha": f"sha{len(self.calls)}", "dirty": False, "changes": []},
                "comm_compute": {"replica_bytes": 4_900_000, "replica_transfer_s": 0.2,
                                 "compute_step_s": 0.4, "comm_compute_ratio": 0.5},
                "link": {"rate_mbit": 200.0, "latency_ms": 0.5, "delay_method": "netem",
                         "rtt_ms": 1.1}}


def test_tuning_records_commit_load_and_seed_and_retries_a_busy_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own, args = campaign.parse(["--out", str(tmp_path / "r.json"), "--workload", "asr",
                                "--target", "12", "--max-samples", "9600", "--cases", "ddp",
                                "postlocal16", "postlocal64", "--allow-load"])
    fake = FakeLaunches()
    monkeypatch.setattr(campaign, "launch", fake)
    rec = campaign.new_record(own, args)
    campaign.tune(own, args, rec)
    tuning = rec["tuning"]
    # the busy first launch (peak 1) was tried again: 4 launches for 3 peaks
    assert [c["peaks"] for c in fake.calls][:2] == [{"ddp": 3e-3, "postlocal16": 3e-3}] * 2
    assert len(fake.calls) == 4 and len(tuning["launches"]) == 4
    assert tuning["launches"][0]["rejected"].startswith("other processes took 50%")
    assert sorted(t["case"] for t in tuning["rejected_trials"]) == ["ddp", "postlocal16"]
    # every trial: the tuning seed, its launch's commit and load; no variant is launched
    assert {c["seed"] for c in fake.calls} == {rules.TUNING_SEED}
    assert all("postlocal64" not in c["cases"] for c in fake.calls)
    for case, trials in tuning["trials"].items():
        assert set(trials) == {"0.003", "0.006", "0.012"}, case
        for trial in trials.values():
            assert trial["seed"] == rules.TUNING_SEED
            assert trial["commit"] == f"sha{trial['launch'] + 1}"
            assert trial["load_before"] == 0.25 and trial["foreign_cpu_fraction"] == 0.01
    # later trials stop where they could at most tie the case's best so far
    assert fake.calls[2]["caps"] == {"ddp": 4800, "postlocal16": 5440}
    assert fake.calls[3]["caps"] == {"ddp": 4480, "postlocal16": 5120}
    # the picks: fewest samples (ties: the shorter time); the variant takes its base's
    assert tuning["chosen"] == {"ddp": 6e-3, "postlocal16": 6e-3, "postlocal64": 6e-3}
    assert tuning["as"] == {"postlocal64": "postlocal16"}
    assert rec["cases"]["postlocal64"]["lr"] == rules.case_lr(
        {"kind": "postlocal"}, 6e-3, 2, 2, "adam")
    # R and the link at the record's top, from its launches
    saved = campaign.json.loads((tmp_path / "r.json").read_text())
    assert saved["comm_compute_ratio"] == 0.5 and saved["link"]["rtt_ms"] == 1.1
    assert saved["link"]["rtt_ms_per_launch"] == [1.1] * 4
    assert saved["schema"] == rules.SCHEMA and saved["pin_nodes"] is False


def test_a_case_best_at_its_grid_s_edge_is_tried_once_beyond_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own, args = campaign.parse(["--out", str(tmp_path / "r.json"), "--workload", "asr",
                                "--target", "12", "--max-samples", "9600", "--cases", "ddp",
                                "decentdp", "--allow-load"])
    fake = FakeLaunches()
    monkeypatch.setattr(campaign, "launch", fake)
    rec = campaign.new_record(own, args)
    campaign.tune(own, args, rec)
    tuning = rec["tuning"]
    # ddp's best (6e-3) is inside its grid; Decent-DP reached the target at none of its peaks
    # and did best (the lowest WER) at the lowest: one more trial at half of it, alone
    assert fake.calls[-1]["peaks"] == {"decentdp": 1.5e-3}
    assert set(tuning["trials"]["ddp"]) == {"0.003", "0.006", "0.012"}
    assert set(tuning["trials"]["decentdp"]) == {"0.0015", "0.003", "0.006", "0.012"}
    assert tuning["chosen"] == {"ddp": 6e-3, "decentdp": 1.5e-3}
    # started again, a tuned record launches nothing more
    n = len(fake.calls)
    campaign.tune(own, args, rec)
    assert len(fake.calls) == n


def test_the_campaign_refuses_a_target_above_12_percent(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        campaign.parse(["--out", str(tmp_path / "r.json"), "--workload", "asr", "--target",
                        "20", "--max-samples", "9600", "--cases", "ddp"])
    with pytest.raises(SystemExit):  # without ddp: its samples come from a reference record
        campaign.parse(["--out", str(tmp_path / "r.json"), "--workload", "asr", "--target",
                        "12", "--max-samples", "9600", "--cases", "ddp_bf16"])
