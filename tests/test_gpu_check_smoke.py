"""Smoke test of ``benchmarks/gpu/check.py``: its CPU dry path (``--device cpu --quick``).

The same workers as on a GPU, with CPU tensors and gloo: every check runs (the CUDA-stream one
reports "skipped"), the exactness checks pass, the JSON has the documented shape. The GPU
paths themselves are untested until the script has run on a GPU (docs/gpu.md). Timings are
never asserted.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from testbed.launch import base_env, launch_processes

pytestmark = pytest.mark.multiprocess

CHECKS = {"dpsgd_exact", "adpsgd_sum", "adpsgd_stream", "bf16_dpsgd", "bf16_adpsgd",
          "time_ddp", "time_dpsgd_overlap", "time_dpsgd_delay1", "time_adpsgd"}


def _run(*args: str, timeout: float = 420) -> tuple[int, str]:
    # The tests' launcher: on timeout the stacks of the driver and its workers are shown and
    # the whole tree is killed.
    result = launch_processes([([sys.executable, "-m", "benchmarks.gpu.check", *args],
                                base_env())], timeout)
    assert not result.timed_out, f"timed out after {timeout}s:\n{result.stdout[-12000:]}"
    return result.returncode, result.stdout


def test_help() -> None:
    code, out = _run("--help", timeout=60)
    assert code == 0 and "--device" in out and "--json" in out and "--quick" in out


@pytest.mark.slow  # benchmark smoke run (1-2 minutes): make test-slow
def test_cpu_dry_run(tmp_path: Path) -> None:
    """``nccl,gloo``: NCCL refuses CPU tensors here, as it refuses two ranks on one GPU
    there, so the fallback to gloo runs as on the GPU machine."""
    out_path = tmp_path / "gpu_check.json"
    code, stdout = _run("--device", "cpu", "--quick", "--backend", "nccl,gloo",
                        "--json", str(out_path), "--workdir", str(tmp_path / "work"))
    assert code == 0, stdout[-8000:]
    report = json.loads(out_path.read_text())
    assert report["device"] == "cpu" and report["quick"] is True
    assert report["backend"] == "gloo"
    nccl, gloo = report["launches"]
    assert nccl["backend"] == "nccl" and nccl["probe_only"] and not nccl["timed_out"]
    assert all(nccl["probe_errors"])  # each rank says why
    assert gloo["backend"] == "gloo" and not gloo["probe_only"]
    assert set(report["checks"]) == CHECKS
    statuses = {name: c["status"] for name, c in report["checks"].items()}
    assert statuses.pop("adpsgd_stream") == "skipped"
    assert set(statuses.values()) == {"passed"}, report["checks"]
    assert report["checks"]["dpsgd_exact"]["detail"]["max_abs_error"] <= 1e-5
    assert report["checks"]["adpsgd_sum"]["detail"]["max_abs_sum_error"] <= 1e-5
    for case, ms in report["step_ms"].items():
        assert isinstance(ms, float) and math.isfinite(ms) and ms > 0, case
    assert "dpsgd_exact" in stdout and "passed" in stdout


def test_missing_gpu_is_reported(tmp_path: Path) -> None:
    """On a machine without CUDA, ``--device cuda`` stops at once and says what it needs."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out = _run("--device", "cuda", timeout=120)
    assert code == 2
    assert "torch.cuda.is_available() is False" in out and "docs/gpu.md" in out
