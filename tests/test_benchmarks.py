"""Smoke tests of the benchmark scripts: they run in ``--quick`` mode and write well-formed JSON.

Timings are never asserted (they depend on the machine and its load); only that every case ran
and the report has the documented shape.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from testbed.launch import base_env, launch_processes

pytestmark = pytest.mark.multiprocess

STEP_CASES = {"solo", "local", "ddp", "dpsgd_blocking", "dpsgd_overlap", "dpsgd_delay1"}


def _run(script: str, *args: str, timeout: float = 600) -> str:
    """``python -m benchmarks.perf.<script> ARGS`` (from the repository root)."""
    # The launcher of the tests: on timeout the stacks of the driver and of its ranks are shown
    # and the whole tree is killed (a plain subprocess timeout would leave the ranks running).
    result = launch_processes([([sys.executable, "-m", f"benchmarks.perf.{script}", *args],
                                base_env())], timeout)
    assert not result.timed_out, f"timed out after {timeout}s:\n{result.stdout[-12000:]}"
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    return result.stdout


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("script", ["step_time", "straggler", "wire_convergence"])
def test_help(script: str) -> None:
    out = _run(script, "--help", timeout=60)
    assert "--quick" in out and "--out" in out


@pytest.mark.slow  # benchmark smoke run: make test-slow
def test_flat_ops_reports_both_layouts(tmp_path: Path) -> None:
    out = tmp_path / "flat_ops.json"
    _run("flat_ops", "--repeats", "2", "--out", str(out), timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["layout"]) for r in rows] == [
        (m, lay) for m in ("mlp_10.5M_8_tensors", "many_small_600_tensors")
        for lay in ("plain", "flat")]
    for r in rows:
        assert r["segments"] == (1 if r["layout"] == "flat" else r["tensors"])
        assert all(_positive(r["ms"][op]) for op in ("pack", "add_", "copy_"))


@pytest.mark.slow  # benchmark smoke run: make test-slow
def test_step_time_quick(tmp_path: Path) -> None:
    out_path = tmp_path / "step_time.json"
    stdout = _run("step_time", "--quick", "--out", str(out_path))
    report = json.loads(out_path.read_text())
    assert report["benchmark"] == "step_time" and report["quick"] is True
    assert {"cpu_model", "usable_cores", "torch", "lightning", "loadavg_1_5_15"} <= set(
        report["machine"])
    assert report["parameters"] > 0
    (launch,) = report["launches"]
    assert launch["world_size"] == 2
    assert set(launch["cases"]) == STEP_CASES
    for case in launch["cases"].values():
        assert _positive(case["median_step_s"])
        assert case["steps_measured_per_rank"] > 0
    for key in ("blocking_over_overlap", "overlap_over_solo", "overlap_over_local"):
        assert _positive(launch[key])
    assert "| dpsgd_overlap |" in stdout and "| dpsgd_overlap |" in report["markdown"]
    if Path("/proc/self/task").is_dir():  # CPU per thread (Linux): the training thread works,
        for name, case in launch["cases"].items():  # dpsgd's communication thread mixes
            assert case["cpu_s_per_step"]["training"] > 0, name
        assert launch["cases"]["dpsgd_overlap"]["cpu_s_per_step"]["lightning-gossip-comm"] > 0
        assert "CPU ms per step per rank" in report["markdown"]


@pytest.mark.slow  # benchmark smoke run: make test-slow
def test_straggler_quick(tmp_path: Path) -> None:
    out_path = tmp_path / "straggler.json"
    stdout = _run("straggler", "--quick", "--out", str(out_path))
    report = json.loads(out_path.read_text())
    assert report["benchmark"] == "straggler" and report["quick"] is True
    assert {"cpu_model", "usable_cores", "torch", "lightning"} <= set(report["machine"])
    assert report["sleep_s"] >= 0 and _positive(report["calibrated_local_step_s"])
    expected = {f"{s}/{m}" for s in ("ddp", "dpsgd", "adpsgd") for m in ("equal", "straggler")}
    assert set(report["runs"]) == expected
    for run in report["runs"].values():
        assert _positive(run["samples_per_s"]) and _positive(run["wall_s"])
        assert len(run["steps_per_rank"]) == 2 and _positive(run["straggler_step_ratio"])
        assert 0.0 <= run["val_acc"] <= 1.0
        assert _positive(run["over_ddp"])
        (rnd,) = run["rounds"]
        assert rnd["samples"] > 0 and sum(rnd["steps_per_rank"]) > 0
    assert "| adpsgd | straggler |" in stdout


@pytest.mark.slow  # benchmark smoke run: make test-slow
def test_wire_convergence_quick(tmp_path: Path) -> None:
    out_path = tmp_path / "wire.json"
    stdout = _run("wire_convergence", "--quick", "--cases", "dpsgd_fp32", "dpsgd_bf16",
                  "--out", str(out_path))
    results = json.loads(out_path.read_text())["results"]
    assert set(results) == {f"{w}/{c}" for w in ("digits", "transformer")
                            for c in ("dpsgd_fp32", "dpsgd_bf16")}
    for key, res in results.items():
        assert res["steps"] > 0
        if key.startswith("transformer"):
            assert math.isfinite(res["val_loss"]) and res["val_ppl"] > 1
        else:
            assert 0 <= res["val_acc"] <= 1
    assert "| transformer | dpsgd_bf16 |" in stdout
