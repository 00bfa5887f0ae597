"""Smoke test of the race (``benchmarks/race/driver.py``) on a tiny emulated cluster.

Needs root and iproute2 (network namespaces, veth, bridge, ``tc``); skips with the reason
elsewhere. 2 nodes x 1 process, ``--quick``:

* ``digits`` (0.25 MB model, at most 30 steps per case), six cases: ``ddp``, ``ddp_bf16``,
  ``ddp_powersgd2``, ``postlocal4``, ``dpsgd`` and ``adpsgd``. Checks the JSON's shape, that
  every case started from the same model (same first validation), that the DDP hooks the race
  registers really ran (bytes on the link: bf16 about half of ddp's, PowerSGD a few %,
  post-local SGD about a quarter after its warm-up), that the times to the target agree with
  the curves, that adpsgd (validated at epoch ends) does not deadlock, and that no namespace or
  link is left;
* ``asr`` (the recipe's BLSTM at 1 x 64, a 256-utterance corpus) with node 1 slow: ``ddp`` and
  ``adpsgd``; checks the WER direction of the target and times, the model size in the JSON,
  that both cases started from the same parameters (their hash), that the handicap is one
  number for both cases and the slow node slept exactly it, that each case recorded its
  achieved slowdown, and the PNG.
* ``torchft`` (2 nodes x 2 processes: a replica group of two DDP ranks per node, the
  configuration of the real races), ``digits``: ``ddp``, ``torchft_localsgd``,
  ``torchft_diloco``; checks that torchft's manager committed the syncs that 30 steps with
  ``sync_every=16`` make and that the link bytes show them. Skips when torchft (the optional
  ``race`` extra) is not installed.
* ``decentdp`` (2 nodes x 2 processes, ``digits``): ``ddp``, Decent-DP with its recommended
  ``alternating-exp-ring`` and its ``ring``; checks the link bytes against its topology's
  (``decentdp_case.expected_ratio``), and that R, the seed and the link are recorded.
  Skips when decent-dp (the ``race`` extra) is not installed.
* the campaign (``benchmarks/race/campaign.py``), ``digits``, ``ddp`` and ``dpsgd`` with node 1
  slow: tuning at one peak, 2 runs in rotated order, the record's schema and checks (a seed per
  run, the same in every case; the tuning launches' commit and load; R and the link at the
  top), and a second call that finds nothing left to run.

Timings are never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.race import decentdp_case, rules, torchft_cases
from testbed import cluster_net
from testbed.launch import ROOT, base_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def rules_args() -> list[str]:
    """The race rules' checks a smoke run on a shared machine must relax: latency only where
    ``netem`` exists, and a start above the load threshold (recorded as loaded)."""
    latency = "0.5" if cluster_net.latency_problem(PREFIX) is None else "0"
    return ["--latency-ms", latency, "--allow-load"]

#: this module's own name prefix, no extension of a benchmark's or another test's (see
#: ``tests/test_cluster_smoke.py``): a concurrent race (``lgr``) is left alone
PREFIX = "trs"


@pytest.fixture(scope="module")
def netns_available() -> None:
    reason = cluster_net.check_available(PREFIX)
    if reason:
        pytest.skip(f"emulated cluster unavailable here: {reason}")


def test_race_quick_2x1(netns_available: None, tmp_path: Path) -> None:
    """Four cases race; hooks ran (link bytes); curves, target and JSON agree; nothing left."""
    out, png = tmp_path / "race.json", tmp_path / "race.png"
    cmd = [sys.executable, "-m", "benchmarks.race", "--nodes", "2", "--procs", "1",
           "--rate", "100", "--quick", "--eval-every", "64", "--warmup", "8", "--cases", "ddp",
           "ddp_bf16", "ddp_powersgd2", "postlocal4", "dpsgd", "adpsgd", "--prefix", PREFIX,
           "--json", str(out), "--png", str(png), *rules_args(),
           # a target out of reach and a budget that never ends a case: every case runs its
           # 30 steps, so the hook checks always see 22 steps after post-local SGD's warm-up
           "--target", "99.9", "--budget", "100000"]
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=900)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert (report["workload"], report["nodes"], report["procs"], report["rate_mbit"]) == (
        "digits", 2, 1, 100.0)
    cases = {c["name"]: c for c in report["cases"]}
    assert list(cases) == ["ddp", "ddp_bf16", "ddp_powersgd2", "postlocal4", "dpsgd", "adpsgd"]
    ddp = cases["ddp"]
    assert report["target"] == 99.9
    # --quick caps every case at 30 steps; adpsgd is validated (and stopped) at epoch ends
    # only, where its shared cursor has used every one of the 1437 training samples once
    synchronous = ("ddp", "ddp_bf16", "ddp_powersgd2", "postlocal4", "dpsgd")
    assert [cases[n]["steps"] for n in synchronous] == [30] * 5
    assert cases["adpsgd"]["curve_samples"] == [0, 1437]
    assert cases["dpsgd"]["curve_samples"] == list(range(0, 30 * 2 * 16 + 1, 2 * 2 * 16))
    assert ddp["metric_at_ddp_time"] == ddp["final_metric"]
    first = {name: c["curve"][0] for name, c in cases.items()}
    for name, c in cases.items():
        for key in ("time_to_target_s", "metric_at_ddp_time", "final_metric",
                    "bytes_per_step_inter_node", "curve"):
            assert key in c, (name, key)
        assert first[name] == [0.0, first["ddp"][1]], (name, first)  # same seed, same model
        assert c["init_params_sha256"] == ddp["init_params_sha256"], name
        assert c["lr"] == 0.05, name  # SGD: the per-learner rule's factor is 1
        assert c["final_metric"] == c["curve"][-1][1]
        seconds = [s for s, _ in c["curve"]]
        assert seconds == sorted(seconds)
        reached = [s for s, m in c["curve"] if m >= report["target"]]
        assert c["time_to_target_s"] == (reached[0] if reached else None), name
        assert c["bytes_per_step_inter_node"] > 0
    # Hooks: the link bytes say they ran (a skipped hook would send ddp's bytes).
    assert cases["ddp_bf16"]["hook_check"]["ok"], cases["ddp_bf16"]["hook_check"]
    assert 0.4 <= cases["ddp_bf16"]["hook_check"]["measured_ratio"] <= 0.6
    assert cases["postlocal4"]["hook_check"]["ok"], cases["postlocal4"]["hook_check"]
    assert cases["ddp_powersgd2"]["hook_check"]["ok"], cases["ddp_powersgd2"]["hook_check"]
    assert cases["ddp_powersgd2"]["hook_check"]["measured_ratio"] < 0.25
    warm = cases["postlocal4"]["bytes_per_step_warmup"]
    assert 0.8 <= warm / ddp["bytes_per_step_inter_node"] <= 1.2  # global all-reduce first
    # every record keeps R and its terms, the seed, the link's round trip and delay method
    r = report["comm_compute"]
    assert r["replica_bytes"] == 2 * report["params"] and r["compute_step_s"] > 0
    assert r["replica_transfer_s"] is not None and report["comm_compute_ratio"] == r[
        "comm_compute_ratio"] == round(r["replica_transfer_s"] / r["compute_step_s"], 3)
    assert report["seed"] == 0 and all(c["seed"] == 0 for c in cases.values())
    assert report["pin_nodes"] is False and report["link"]["rate_mbit"] == 100.0
    if report["latency_ms"] > 0:
        assert report["link"]["rtt_ms"] > 0 and report["link"]["delay_method"] in (
            "netem", "nfqueue")
    prefix, suffix = report["cluster"]["prefix"], report["cluster"]["suffix"]
    assert (cluster_net.leftovers(f"{prefix}-{suffix}-")
            + cluster_net.leftovers(f"{prefix}{suffix}")) == []


def test_race_decentdp_quick_2x2(netns_available: None, tmp_path: Path) -> None:
    """Decent-DP in the race: its topology's bytes on the link, R recorded."""
    missing = decentdp_case.unavailable()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "decentdp.json"
    cmd = [sys.executable, "-m", "benchmarks.race", "--nodes", "2", "--procs", "2",
           # validations every 2 steps: Decent-DP's exchange in flight (launched at the end of a
           # step) is waited for on the clock before each, not left to the window whose bytes
           # the race subtracts (decentdp_case.settle)
           "--rate", "100", "--quick", "--eval-every", "128", "--cases", "ddp", "decentdp",
           "decentdp_ring", "--seed", "3", "--prefix", PREFIX, "--json", str(out),
           "--target", "99.9", "--budget", "100000", *rules_args()]  # every case runs its 30 steps
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=900)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    report = json.loads(out.read_text())
    cases = {c["name"]: c for c in report["cases"]}
    assert list(cases) == ["ddp", "decentdp", "decentdp_ring"]
    for name in ("decentdp", "decentdp_ring"):
        c = cases[name]
        assert c["steps"] == 30 and c["seed"] == 3
        assert c["init_params_sha256"] == cases["ddp"]["init_params_sha256"]
        # a skipped exchange would send nothing; an all-reduce of gradients, ddp's bytes
        assert c["hook_check"]["ok"], (name, c["hook_check"])
        assert c["final_metric"] > c["curve"][0][1], name  # it learns
    assert report["comm_compute_ratio"] is not None
    print({n: (c["hook_check"]["measured_ratio"], c["hook_check"]["expected_ratio"],
               c["final_metric"]) for n, c in cases.items() if "hook_check" in c},
          report["comm_compute"])


@pytest.mark.timeout(2400)  # feature extraction and 2 cases of a BLSTM: >10 min when loaded
def test_race_asr_quick_slow_node(netns_available: None, tmp_path: Path) -> None:
    """asr: WER (lower is better) drives target and times; one fixed handicap, its achieved
    slowdown recorded per case; the rule's learning rates; PNG written."""
    out = tmp_path / "asr.json"
    cmd = [sys.executable, "-m", "benchmarks.race", "--workload", "asr",
           "--nodes", "2", "--procs", "1", "--rate", "100", "--quick", "--eval-every", "32",
           "--cases", "ddp", "adpsgd", "--slow-node", "1", "--prefix", PREFIX,
           "--json", str(out), "--budget", "100000", *rules_args()]
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=2000)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0  # the default PNG: next to the JSON
    assert (report["workload"], report["slow_node"]) == ("asr", 1)
    assert report["params"] > 0 and report["model_bytes"] == 4 * report["params"]
    cases = {c["name"]: c for c in report["cases"]}
    assert list(cases) == ["ddp", "adpsgd"]
    ddp = cases["ddp"]
    assert report["target"] == ddp["final_metric"] + 0.5  # WER: the slack is upwards
    extra = report["slow_extra_s"]
    assert extra > 0
    for c in cases.values():
        # same seed, same model: the initial parameters' hash (the first WER, 100 % for every
        # blank model, could not tell two models apart)
        assert c["init_params_sha256"] == ddp["init_params_sha256"]
        assert all(0.0 <= m for _, m in c["curve"])
        reached = [s for s, m in c["curve"] if m <= report["target"]]
        assert c["time_to_target_s"] == (reached[0] if reached else None)
        # the fixed handicap: one number for every case; node 1 (rank 1) slept exactly it
        assert c["slow_extra_s"] == extra
        assert c["slow_slept_per_step_s"][0] == 0
        assert c["slow_slept_per_step_s"][1] == pytest.approx(extra, abs=1e-3)
        assert c["slowdown"] == pytest.approx(1 + extra / c["slow_local_step_s"], abs=1e-3)
    # the per-learner rule for every case alike: 2 ranks of adpsgd are 2 learners (Adam)
    assert ddp["lr"] == 3e-3 and cases["adpsgd"]["lr"] == pytest.approx(3e-3 * 2 ** 0.5)
    assert ddp["time_to_target_s"] is not None  # its own final WER is within the target
    # every case is validated at the end of a chunk of 32 utterances (the race's asr epoch)
    assert all(n % 32 == 0 for n in cases["adpsgd"]["curve_samples"])
    # every rank's steps and the gossip counters are recorded (ddp: no gossip, equal steps)
    assert ddp["steps_per_rank"] == [ddp["steps"]] * 2 and ddp["gossip_stats"] == [{}, {}]
    adpsgd = cases["adpsgd"]
    assert len(adpsgd["steps_per_rank"]) == 2 and adpsgd["steps_per_rank"][0] == adpsgd["steps"]
    assert all(s["exchanges"] > 0 for s in adpsgd["gossip_stats"])


def test_race_torchft_quick_2x2(netns_available: None, tmp_path: Path) -> None:
    """torchft's LocalSGD and DiLoCo: lighthouse, quorum, one commit per 16 steps, link bytes."""
    missing = torchft_cases.unavailable()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "torchft.json"
    cmd = [sys.executable, "-m", "benchmarks.race", "--nodes", "2", "--procs", "2",
           "--rate", "100", "--quick", "--eval-every", "128", "--cases", "ddp",
           "torchft_localsgd", "torchft_diloco", "--prefix", PREFIX, "--json", str(out),
           "--target", "99.9", "--budget", "100000", *rules_args()]  # every case runs its 30 steps
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=900)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    assert "torchft lighthouse at http://" in result.stdout
    report = json.loads(out.read_text())
    cases = {c["name"]: c for c in report["cases"]}
    assert list(cases) == ["ddp", "torchft_localsgd", "torchft_diloco"]
    for name in ("torchft_localsgd", "torchft_diloco"):
        c = cases[name]
        assert c["steps"] == 30 and c["period"] == 16
        assert c["torchft_commits"] == 1, (name, c["torchft_commits"])  # 30 // 16 syncs
        assert c["curve"][0] == [0.0, cases["ddp"]["curve"][0][1]]  # same seed, same model
        # one model average per node's local rank every 16 steps: 2 x 1 M / (ddp's 1.5 M) / 16
        # per step over 30 steps; a sync that did not cross the link would send ~nothing
        assert c["hook_check"]["expected_ratio"] == round(
            torchft_cases.expected_ratio(30, 16, 2, 2), 4)
        assert c["hook_check"]["ok"], (name, c["hook_check"])
    prefix, suffix = report["cluster"]["prefix"], report["cluster"]["suffix"]
    assert (cluster_net.leftovers(f"{prefix}-{suffix}-")
            + cluster_net.leftovers(f"{prefix}{suffix}")) == []


@pytest.mark.timeout(2400)
def test_race_campaign_quick(netns_available: None, tmp_path: Path) -> None:
    """The campaign (``benchmarks/race/campaign.py``) at the smoke size: tuning at one peak,
    then 2 runs in rotated order with a fixed handicap; the record is valid under the schema,
    every case has its runs with the rule's rate, the slowdown and the same initial model, each
    run has its checks, and a second call (the same ``--out``) launches nothing."""
    out = tmp_path / "campaign.json"
    cmd = [sys.executable, "-m", "benchmarks.race.campaign", "--workload",
           "digits", "--nodes", "2", "--procs", "1", "--rate", "100", "--quick",
           "--eval-every", "64", "--target", "50", "--max-samples", "960", "--runs", "2",
           "--retries", "0", "--peaks", "0.05", "--cases", "ddp", "dpsgd", "--slow-node", "1",
           "--prefix", PREFIX, "--out", str(out), *rules_args()]
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=2000)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    rec = json.loads(out.read_text())
    assert rules.validate_record(rec) == []
    assert rec["tuning"]["chosen"] == {"ddp": 0.05, "dpsgd": 0.05}
    assert set(rec["tuning"]["trials"]["ddp"]) == {"0.05"}
    extra = rec["handicap"]["extra_s_per_step"]
    assert extra > 0
    shas: dict[int, set[str]] = {0: set(), 1: set()}
    for name, case in rec["cases"].items():
        assert [r["run"] for r in case["runs"]] == [0, 1], name
        for r in case["runs"]:
            assert r["lr"] == 0.05 and r["slow_extra_s"] == extra, name
            assert r["slowdown"] == pytest.approx(1 + extra / r["slow_local_step_s"], abs=1e-3)
            assert r["seed"] == rules.run_seed(r["run"]), (name, r["run"])
            shas[r["run"]].add(r["init_params_sha256"])
            reached = [n for (_, m), n in zip(r["curve"], r["curve_samples"]) if m >= 50]
            assert r["samples_to_target"] == (reached[0] if reached else None)
    # run k: every case from the same parameters; each run its own seed, its own parameters
    assert len(shas[0]) == len(shas[1]) == 1 and shas[0] != shas[1]
    assert rules.seed_problems(rec) == []
    for name, trials in rec["tuning"]["trials"].items():
        for trial in trials.values():
            assert trial["seed"] == rules.TUNING_SEED, name
            assert trial["commit"] and trial["load_before"] >= 0, name
    assert rec["tuning"]["launches"] and all(
        "foreign_cpu_fraction" in launch and launch["commit"]["sha"]
        for launch in rec["tuning"]["launches"])
    assert rec["schema"] == rules.SCHEMA and rec["pin_nodes"] is False
    assert rec["comm_compute_ratio"] == rec["comm_compute"]["comm_compute_ratio"] is not None
    assert rec["link"]["rate_mbit"] == 100.0
    assert [r["order"] for r in rec["runs"]] == [["ddp", "dpsgd"], ["dpsgd", "ddp"]]
    assert [next(e["position"] for e in rec["cases"]["ddp"]["runs"] if e["run"] == r)
            for r in (0, 1)] == [0, 1]
    for run in rec["runs"]:
        assert run["done"] and "handicap" in run and run["launches"][0]["status"] == "ok"
        assert 0.0 <= run["foreign_cpu_fraction"][0] <= 1.0
    assert rec["score"]["withheld"]  # 2 runs, a shared machine: no claim
    again = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=600)
    assert again.returncode == 0 and "done" not in again.stdout, again.stdout[-3000:]
    assert json.loads(out.read_text())["cases"] == rec["cases"]
