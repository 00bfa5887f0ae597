"""Multi-node D-PSGD as a user meets it: plain Lightning scripts on 2 nodes x 2 processes.

One ``torchrun --nnodes 2`` launch of ``tests/scripts/multinode_user.py`` runs every scenario
in turn (``hierarchical=True`` unless said otherwise); the last one makes rank 1 raise, so the
launch must fail with that rank's message and leave no process behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.launch import (
    base_env,
    free_port,
    launch_processes,
    read_rank_results,
    torchrun_command,
)

SCRIPT = Path(__file__).parent / "scripts" / "multinode_user.py"
NODES, DEVICES = 2, 2
WORLD = NODES * DEVICES
SCENARIOS = ["unused", "bf16", "eval", "ckpt", "time_dpsgd", "crash"]

multiprocess = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str, int]:
    out = tmp_path_factory.mktemp("multinode_user")
    port = free_port()

    commands = [(torchrun_command(SCRIPT, str(out), *SCENARIOS, nprocs=DEVICES, nnodes=NODES,
                                  node_rank=node, port=port), base_env())
                for node in range(NODES)]
    launched = launch_processes(commands, timeout=1800)
    assert not launched.timed_out, launched.stdout[-12000:]
    return out, launched.stdout, launched.returncode


def _results(run: tuple[Path, str, int], name: str) -> list[dict]:
    return read_rank_results(run[0] / name, WORLD)


def _assert_identical_in_nodes(rows: np.ndarray, what: str) -> None:
    for node in range(NODES):
        ranks = rows[node * DEVICES:(node + 1) * DEVICES]
        assert (ranks == ranks[0]).all(), f"node {node} ranks differ ({what})"


def _per_step(results: list[dict], key: str = "steps") -> np.ndarray:
    """(steps, ranks, numel)."""
    return np.array([r[key] for r in results], dtype=np.float64).transpose(1, 0, 2)


@multiprocess
def test_branch_used_by_some_ranks_keeps_node_ranks_identical(run):
    # rank r uses a branch when (r + batch) is even: in every step one rank of each node has a
    # gradient for it and the other none; BatchNorm buffers and a frozen layer besides
    results = _results(run, "unused")
    steps = _per_step(results)
    assert len(steps) == results[0]["global_step"] > 0
    for t, x in enumerate(steps):
        _assert_identical_in_nodes(x, f"after step {t}")
        assert np.abs(x[0] - x[DEVICES]).max() > 0  # nodes differ: gossip, not DDP
    assert np.abs(steps[-1][0] - np.array(results[0]["start"])).max() > 1e-3


@multiprocess
def test_bf16_wire_with_bf16_mixed_clipping_and_accumulation(run):
    results = _results(run, "bf16")
    steps = _per_step(results)
    assert results[0]["global_step"] == 2 * 8 // 2  # 2 epochs of 8 batches, accumulating 2
    assert np.isfinite(steps).all()
    # after each optimizer step (odd batches); between them BatchNorm statistics of the
    # first micro-batch are still the rank's own (they are averaged after the step)
    for t, x in enumerate(steps[1::2]):
        _assert_identical_in_nodes(x, f"after optimizer step {t}")


@multiprocess
def test_validate_and_test_around_fit(run):
    results = _results(run, "eval")
    for key in ("validate_before", "test_before", "validate_after", "test_after"):
        values = [r[key][0] for r in results]
        assert all(v == values[0] for v in values), key  # consensus weights, synced metric
    assert results[0]["global_step"] == 8
    assert results[0]["validate_after"] != results[0]["validate_before"]


@multiprocess
def test_checkpoint_then_resume_from_last(run):
    results = _results(run, "ckpt")
    first = results[0]["first"]
    assert first["last"].endswith("last.ckpt") and first["best"]
    ckpt = np.array(results[0]["ckpt"])
    starts = np.array([r["resumed_start"] for r in results])
    # every_n_train_steps=3: last.ckpt is the one of step 15 (early stopping ended at 16)
    assert results[0]["ckpt_step"] == first["global_step"] // 3 * 3 > 0
    # every rank resumes from the checkpoint's consensus weights
    for rank in range(WORLD):
        np.testing.assert_array_equal(starts[rank], ckpt, err_msg=f"rank {rank}")
    finals = np.array([r["first"]["final"] for r in results])
    assert np.abs(finals[0] - finals[DEVICES]).max() > 0  # final_average=False: nodes differed
    resumed = results[0]["resumed_global_step"] - results[0]["ckpt_step"]
    assert resumed == len(results[0]["resumed_steps"]) > 0
    for t, x in enumerate(_per_step(results, "resumed_steps")):
        _assert_identical_in_nodes(x, f"after resumed step {t}")


@multiprocess
def test_global_averages_under_max_time(run):
    results = _results(run, "time_dpsgd")
    assert results[0]["global_step"] > 0
    assert len({r["global_step"] for r in results}) == 1
    finals = np.array([r["final"] for r in results])
    _assert_identical_in_nodes(finals, "at the end")
    last = np.array(results[0]["steps"][-1])  # rank 0 after its last step
    np.testing.assert_array_equal(last, finals[0])


@multiprocess
def test_a_raising_rank_fails_the_whole_run_with_its_message(run):
    out, stdout, returncode = run
    assert returncode != 0
    assert "user error on rank 1 at step 3" in stdout
    # the others name rank 1 (rank 0 in the node's gradient all-reduce, unless torchrun's
    # agent stops it first; rank 3 in the exchange with rank 1)
    assert "rank(s) 1 failed with an error and left the run" in stdout
    assert (out / "crash_time").exists()
    assert not (out / "crash" / "rank0.json").exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
