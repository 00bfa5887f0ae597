"""The multi-process fits the strategy tests check, grouped by world size.

Process start-up dominates short runs, so every world size is launched once per session
(``world_run`` in ``conftest.py``) with all of its cases for both strategies; each test then
reads the JSON its case wrote. Also the NumPy references the results are compared with.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from lightning_gossip import topology as T
from tests.launch import check, read_rank_results, run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "gossip_cases.py"
FP32 = dict(rtol=0, atol=2e-6)

# -- D-PSGD -------------------------------------------------------------------------------------
EXACT_TOPOLOGIES = ("ring", "random_ring", "one_peer_exponential")
DP_BASE = {"final_average": False, "topology": "random_ring", "seed": 5}


def dpsgd_exact(topo: str, overlap: bool = True) -> dict:
    return {"strategy_kwargs": {**DP_BASE, "topology": topo, "overlap": overlap}, "offset": 1.0}


def dpsgd_cases(world: int, tmp: Path) -> dict:
    if world == 1:
        return {"dp_ws1": {"strategy_kwargs": {}, "lr": 0.1}}
    if world in (2, 3):
        return {"dp_ring": dpsgd_exact("ring")}
    cases = {f"dp_{t}_overlap": dpsgd_exact(t) for t in EXACT_TOPOLOGIES}
    cases["dp_random_ring_blocking"] = dpsgd_exact("random_ring", overlap=False)
    if world != 4:
        return cases
    cases.update({f"dp_{t}_blocking": dpsgd_exact(t, overlap=False) for t in EXACT_TOPOLOGIES})
    cases["dp_delay_by_one"] = {"strategy_kwargs": {**DP_BASE, "delay_by_one": True}, "offset": 1.0}
    cases["dp_accumulate"] = {"strategy_kwargs": DP_BASE, "offset": 1.0, "accumulate": 2, "batches": 8}
    cases["dp_manual"] = {"strategy_kwargs": DP_BASE, "offset": 1.0, "manual": True}
    cases["dp_bf16"] = {"strategy_kwargs": DP_BASE, "offset": 1.0, "precision": "bf16-mixed"}
    cases["dp_logging"] = {"strategy_kwargs": {**DP_BASE, "consensus_every_n_steps": 2},
                           "offset": 1.0, "log": True}
    cases["dp_train_ckpt"] = {"strategy_kwargs": {"final_average": False, "consensus_every_n_steps": 3},
                              "lr": 0.5, "save_checkpoint": True, "batchnorm": True, "batches": 8}
    cases["dp_final_average"] = {"strategy_kwargs": {}, "lr": 0.5, "batchnorm": True}
    cases["dp_resume"] = {"strategy_kwargs": {"final_average": False}, "lr": 0.5, "batchnorm": True,
                          "batches": 8, "epochs": 2,
                          "resume_from": str(tmp / "dp_train_ckpt" / "model.ckpt")}
    digits = {"task": "digits", "lr": 0.05, "epochs": 4, "val_batches": 1.0, "different_init": False}
    cases["conv_ddp"] = {**digits, "strategy": "ddp"}
    cases["conv_dpsgd"] = {**digits, "strategy_kwargs": {"topology": "random_ring"}}
    cases["conv_adpsgd"] = {**digits, "strategy": "adpsgd", "strategy_kwargs": {}}
    return cases


def expected_mixing(x0: np.ndarray, name: str, steps: int, seed: int = 0,
                    delay_by_one: bool = False) -> list[np.ndarray]:
    """X after each step for lr = 0: ``prod_t W_t X0``, or the delay-by-one recursion."""
    topo = T.build(name, x0.shape[0], seed)
    eye = np.eye(len(x0))
    xs, prev, x = [], None, x0.copy()
    for t in range(steps):
        if delay_by_one:
            new = x if prev is None else x + (topo.mixing_matrix(t - 1) - eye) @ prev
            prev, x = x, new
        else:
            x = topo.mixing_matrix(t) @ x
        xs.append(x)
    if delay_by_one:  # the last exchange is applied when training ends
        xs.append(x + (topo.mixing_matrix(steps - 1) - eye) @ prev)
    return xs


def assert_exact(results: list[dict], name: str, seed: int = 5, delay_by_one: bool = False) -> None:
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    steps = len(results[0]["steps"])
    assert steps >= 3 and all(len(r["steps"]) == steps for r in results)
    want = expected_mixing(x0, name, steps, seed, delay_by_one)
    for t in range(steps):
        got = np.array([r["steps"][t] for r in results])
        np.testing.assert_allclose(got, want[t], **FP32, err_msg=f"{name} step {t}")
    final = np.array([r["final"] for r in results])
    np.testing.assert_allclose(final, want[-1], **FP32)
    assert np.abs(x0 - x0.mean(0)).max() > 0.1  # the replicas really disagreed
    assert np.abs(want[-1] - x0).max() > 1e-3  # and mixing is not a no-op


# -- AD-PSGD ------------------------------------------------------------------------------------
AD_LR0 = {"strategy": "adpsgd", "offset": 1.0, "epochs": 3, "log": True}
AD_NO_AVG = {"final_average": False, "consensus_every_n_steps": 1, "timeout": 60}
AD_STRESS = {"strategy": "adpsgd", "lr": 0.3, "epochs": 3, "val_batches": 2, "delay_ms": 15,
             "delay_seed": 1, "batches": 10, "batchnorm": True,
             "strategy_kwargs": {"max_staleness": 0, "timeout": 60, "topology": "random"}}


def adpsgd_cases(world: int) -> dict:
    if world == 1:
        return {"ad_ws1": {"strategy": "adpsgd", "strategy_kwargs": {}, "lr": 0.1}}
    cases = {"ad_ring_lr0": {**AD_LR0, "strategy_kwargs": {**AD_NO_AVG, "topology": "ring"}},
             "ad_stress": AD_STRESS}
    if world in (4, 5):
        cases["ad_random_lr0"] = {**AD_LR0, "strategy_kwargs": {**AD_NO_AVG, "topology": "random",
                                                                "seed": 3}}
        cases["ad_delay_lr0"] = {**AD_LR0, "strategy_kwargs": {**AD_NO_AVG, "delay_by_one": True}}
    if world == 4:
        cases["ad_straggler"] = {"strategy": "adpsgd", "epochs": 2, "batches": 12, "slow_rank": 1,
                                 "slow_ms": 60, "strategy_kwargs": {"timeout": 60}}
    return cases


def consensus_by_epoch(run: Path) -> list[float]:
    rows = list(csv.DictReader(open(run / "logs" / "version_0" / "metrics.csv")))
    return [float(r["gossip/consensus_distance"]) for r in rows if r.get("gossip/consensus_distance")]


def assert_conserved_and_contracting(run: Path, world: int) -> None:
    results = read_rank_results(run, world)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    final = np.array([r["final"] for r in results], dtype=np.float64)
    assert np.abs(x0 - x0.mean(0)).max() > 0.1  # replicas really started apart
    np.testing.assert_allclose(final.sum(0), x0.sum(0), rtol=0, atol=5e-6 * world)
    assert sum(r["gossip_stats"]["exchanges"] for r in results) > 0
    d0 = np.mean([np.sum((x - x0.mean(0)) ** 2) for x in x0]) / np.sum(x0.mean(0) ** 2)
    per_epoch = consensus_by_epoch(run)
    assert len(per_epoch) == 3
    assert per_epoch[0] < d0 and all(a >= b - 1e-12 for a, b in zip(per_epoch, per_epoch[1:]))
    assert per_epoch[-1] < 0.5 * d0


def assert_stress_ok(run: Path, world: int) -> None:
    results = read_rank_results(run, world)
    finals = np.array([r["final"] for r in results])
    np.testing.assert_allclose(finals, np.broadcast_to(finals[0], finals.shape), rtol=0, atol=1e-6)
    assert np.isfinite(results[0]["val_acc"])
    assert sum(r["global_step"] for r in results) == 3 * 10 * world  # every batch used once
    assert any(r["gossip_stats"]["staleness_waits"] > 0 for r in results)  # the bound was hit


# -- launching ----------------------------------------------------------------------------------
def launch(tmp: Path, cases: dict, nprocs: int, nnodes: int = 1, expect_ok: bool = True,
           timeout: float = 600):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(SCRIPT, str(tmp), str(tmp / "cases.json"), nprocs=nprocs, nnodes=nnodes,
                          timeout=timeout)
    if expect_ok:
        check(result)
    return result


def all_cases(world: int, tmp: Path) -> dict:
    return {**dpsgd_cases(world, tmp), **adpsgd_cases(world)}
