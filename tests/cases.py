"""The multi-process fits the strategy tests check, grouped by world size.

Process start-up dominates short runs, so every world size is launched once per test run with
all of its cases for both strategies (``tests/shared_runs.py``, ``world_run`` in
``conftest.py``); each test then reads the JSON its case wrote. Also the NumPy references the
results are compared with.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lightning_gossip import topology as T
from testbed.launch import check, read_rank_results, run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "gossip_cases.py"
FP32 = dict(rtol=0, atol=2e-6)


@dataclass
class Case:
    """One fit run by ``tests/scripts/gossip_cases.py`` on every rank, and what a test expects.

    The test side builds cases, :func:`launch` writes them as JSON (:meth:`to_json`) and every
    rank reads them back (:meth:`from_json`); results go to ``OUT/<name>/rank<r>.json``.
    """

    name: str
    strategy: Literal["dpsgd", "adpsgd", "ddp"] = "dpsgd"
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    # the model and the data
    task: Literal["tiny", "digits"] = "tiny"  # "digits": scikit-learn's digits, a small MLP
    lr: float = 0.0
    offset: float = 0.0  # scale of the rank-dependent offset added to the weights at start
    seed: int = 0  # torch seed (+ rank unless ``different_init`` is False)
    different_init: bool = True
    width: int = 3
    batchnorm: bool = False
    manual: bool = False  # manual optimization
    halve_lr_every_epoch: bool = False  # a StepLR scheduler (gamma 0.5, every epoch)
    batches: int = 6
    batch_size: int = 4  # (the digits cases use 16)
    train_samples: int | None = None  # the first samples only (default: batches x size x world)
    # the Trainer
    epochs: int = 1
    val_batches: int | float = 0  # Lightning's limit_val_batches (0: no validation)
    accumulate: int = 1
    precision: str = "32-true"
    num_nodes: int = 1
    log: bool = False  # CSVLogger in OUT/<name>/logs/version_0
    save_checkpoint: bool = False  # OUT/<name>/model.ckpt after the fit
    resume_case: str | None = None  # resume from the checkpoint that case saved (same launch)
    # disturbances
    delay_ms: float = 0  # a random sleep of up to this after every batch (seeded per rank)
    delay_seed: int = 0
    slow_rank: int | None = None  # this rank sleeps ``slow_ms`` after every batch
    slow_ms: float = 0
    mismatch_rank: int | None = None  # this rank's model is one unit wider
    raise_at: dict[str, int] | None = None  # {"rank", "step"}: that rank raises from that step
    nan_at: dict[str, int] | None = None  # {"rank", "step"}: that rank's weights become NaN
    stop_at: int | None = None  # every rank sets trainer.should_stop after this many steps
    #: ``gossip_every_n_steps=AutoPeriod(**auto_period)`` (the settings of "auto")
    auto_period: dict[str, Any] | None = None
    # what the test expects (not read by the ranks)
    exact_topology: str | None = None  # weights follow this topology's mixing (lr = 0)
    exact_delay_by_one: bool = False  # ... with the exchange applied one step late

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        """The inverse of :meth:`to_json` (an unknown key is an error)."""
        return cls(**data)

    def results(self, folder: Path, world: int) -> list[dict]:
        """The JSON every rank wrote for this case in the launch that wrote to ``folder``."""
        return read_rank_results(Path(folder) / self.name, world)


# -- D-PSGD -------------------------------------------------------------------------------------
EXACT_TOPOLOGIES = ("ring", "random_ring", "one_peer_exponential")
DP_BASE = {"final_average": False, "topology": "random_ring", "seed": 5}


def dpsgd_exact(topo: str, overlap: bool = True) -> Case:
    """lr = 0 from rank-dependent offsets: each step must be one exact mixing-matrix product."""
    mode = "overlap" if overlap else "blocking"
    return Case(f"dp_{topo}_{mode}", strategy_kwargs={**DP_BASE, "topology": topo,
                                                       "overlap": overlap},
                offset=1.0, exact_topology=topo)


def _exact_features(name: str, **kw: Any) -> Case:
    return Case(name, strategy_kwargs=DP_BASE, offset=1.0, exact_topology="random_ring", **kw)


DP_WS1 = Case("dp_ws1", lr=0.1)
DP_RING = replace(dpsgd_exact("ring"), name="dp_ring")
EXACT_5 = (*(dpsgd_exact(t) for t in EXACT_TOPOLOGIES), dpsgd_exact("random_ring", False))
EXACT_4 = (*EXACT_5, *(dpsgd_exact(t, False) for t in EXACT_TOPOLOGIES if t != "random_ring"))
DP_DELAY_BY_ONE = Case("dp_delay_by_one", strategy_kwargs={**DP_BASE, "delay_by_one": True},
                       offset=1.0, exact_topology="random_ring", exact_delay_by_one=True)
DP_ACCUMULATE = _exact_features("dp_accumulate", accumulate=2, batches=8)
DP_MANUAL = _exact_features("dp_manual", manual=True)
DP_BF16 = _exact_features("dp_bf16", precision="bf16-mixed")
DP_LOGGING = Case("dp_logging", strategy_kwargs={**DP_BASE, "consensus_every_n_steps": 2},
                  offset=1.0, log=True, exact_topology="random_ring")
DP_TRAIN_CKPT = Case("dp_train_ckpt",
                     strategy_kwargs={"final_average": False, "consensus_every_n_steps": 3},
                     lr=0.5, save_checkpoint=True, batchnorm=True, batches=8)
DP_FINAL_AVERAGE = Case("dp_final_average", lr=0.5, batchnorm=True)
DP_RESUME = Case("dp_resume", strategy_kwargs={"final_average": False}, lr=0.5, batchnorm=True,
                 batches=8, epochs=2, resume_case=DP_TRAIN_CKPT.name)
_DIGITS = dict(task="digits", lr=0.05, epochs=4, val_batches=1.0, different_init=False,
               batch_size=16)
CONV_DDP = Case("conv_ddp", strategy="ddp", **_DIGITS)
CONV_DPSGD = Case("conv_dpsgd", strategy_kwargs={"topology": "random_ring"}, **_DIGITS)
CONV_ADPSGD = Case("conv_adpsgd", strategy="adpsgd", **_DIGITS)


def dpsgd_cases(world: int) -> list[Case]:
    """The D-PSGD (and convergence) cases launched with ``world`` ranks."""
    if world == 1:
        return [DP_WS1]
    if world in (2, 3):
        return [DP_RING]
    if world != 4:
        return list(EXACT_5)
    return [*EXACT_4, DP_DELAY_BY_ONE, DP_ACCUMULATE, DP_MANUAL, DP_BF16, DP_LOGGING,
            DP_TRAIN_CKPT, DP_FINAL_AVERAGE, DP_RESUME, CONV_DDP, CONV_DPSGD, CONV_ADPSGD]


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


def assert_exact(results: list[dict], name: str, seed: int = 5,
                 delay_by_one: bool = False) -> None:
    """Every rank's weights after every step are the NumPy mixing of the start weights."""
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


def assert_case_exact(results: list[dict], case: Case) -> None:
    """:func:`assert_exact` with the topology (and delay) the case expects."""
    assert case.exact_topology is not None, f"{case.name} expects no exact mixing"
    assert_exact(results, case.exact_topology, delay_by_one=case.exact_delay_by_one)


# -- AD-PSGD ------------------------------------------------------------------------------------
AD_LR0 = dict(strategy="adpsgd", offset=1.0, epochs=3, log=True)
AD_NO_AVG = {"final_average": False, "consensus_every_n_steps": 1, "timeout": 60}
AD_WS1 = Case("ad_ws1", strategy="adpsgd", lr=0.1)
AD_RING_LR0 = Case("ad_ring_lr0", strategy_kwargs={**AD_NO_AVG, "pairing": "ring"}, **AD_LR0)
AD_RANDOM_LR0 = Case("ad_random_lr0",
                     strategy_kwargs={**AD_NO_AVG, "pairing": "random", "seed": 3}, **AD_LR0)
AD_DELAY_LR0 = Case("ad_delay_lr0", strategy_kwargs={**AD_NO_AVG, "delay_by_one": True},
                    **AD_LR0)
AD_STRESS = Case("ad_stress", strategy="adpsgd", lr=0.3, epochs=3, val_batches=2, delay_ms=15,
                 delay_seed=1, batches=10, batchnorm=True,
                 strategy_kwargs={"max_staleness": 0, "timeout": 60, "pairing": "random"})
AD_STRAGGLER = Case("ad_straggler", strategy="adpsgd", epochs=2, batches=12, slow_rank=1,
                    slow_ms=60, strategy_kwargs={"timeout": 60})
#: one batch per epoch: the ranks that claim none must still validate with the one that trains
#: and step their schedulers
AD_ONE_BATCH = Case("ad_one_batch", strategy="adpsgd", epochs=3, lr=0.1, train_samples=4,
                    val_batches=1.0, halve_lr_every_epoch=True,
                    strategy_kwargs={"timeout": 60})


def adpsgd_lr0_cases(world: int) -> list[Case]:
    """The lr = 0 AD-PSGD cases (sum conserved, consensus contracting) for ``world`` ranks."""
    return [AD_RING_LR0, *((AD_RANDOM_LR0, AD_DELAY_LR0) if world in (4, 5) else ())]


def adpsgd_cases(world: int) -> list[Case]:
    """The AD-PSGD cases launched with ``world`` ranks."""
    if world == 1:
        return [AD_WS1]
    cases = [AD_RING_LR0, AD_STRESS]
    if world in (4, 5):
        cases += [AD_RANDOM_LR0, AD_DELAY_LR0]
    if world == 4:
        cases.append(AD_STRAGGLER)
    if world == 3:
        cases.append(AD_ONE_BATCH)
    return cases


def stress_repeats(repeats: int) -> list[Case]:
    """``repeats`` copies of :data:`AD_STRESS` with other delay seeds (the soak test)."""
    return [replace(AD_STRESS, name=f"stress{i}", delay_seed=100 + i) for i in range(repeats)]


def consensus_by_epoch(run: Path) -> list[float]:
    """The consensus distance the CSV logger recorded, in order."""
    rows = list(csv.DictReader(open(run / "logs" / "version_0" / "metrics.csv")))
    key = "gossip/consensus_distance"
    return [float(r[key]) for r in rows if r.get(key)]


def assert_conserved_and_contracting(run: Path, world: int) -> None:
    """lr = 0 AD-PSGD: the sum of the replicas is conserved, the consensus distance shrinks."""
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
    """The randomized run finished with every batch used once and the staleness bound hit."""
    results = read_rank_results(run, world)
    finals = np.array([r["final"] for r in results])
    np.testing.assert_allclose(finals, np.broadcast_to(finals[0], finals.shape), rtol=0,
                               atol=1e-6)
    assert np.isfinite(results[0]["val_acc"])
    assert sum(r["global_step"] for r in results) == 3 * 10 * world  # every batch used once
    assert any(r["gossip_stats"]["staleness_waits"] > 0 for r in results)  # the bound was hit


# -- launching ----------------------------------------------------------------------------------
def launch(tmp: Path, cases: list[Case], nprocs: int, nnodes: int = 1, expect_ok: bool = True,
           timeout: float = 600):
    """Run ``cases`` one after the other in one torchrun launch; results under ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    write_cases(tmp / "cases.json", cases)
    result = run_torchrun(SCRIPT, str(tmp), str(tmp / "cases.json"), nprocs=nprocs, nnodes=nnodes,
                          timeout=timeout)
    if expect_ok:
        check(result)
    return result


def write_cases(path: Path, cases: list[Case]) -> None:
    """Write ``cases`` for the rank script (names must be unique: they name the folders)."""
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"duplicate case names: {names}"
    path.write_text(json.dumps([c.to_json() for c in cases]))


def read_cases(path: Path) -> list[Case]:
    """The cases :func:`write_cases` wrote."""
    return [Case.from_json(d) for d in json.loads(Path(path).read_text())]


def all_cases(world: int) -> list[Case]:
    """The strategy cases of world size ``world`` (``tests/shared_runs.py`` adds the
    multi-node ones and a failing last case to some launches)."""
    return [*dpsgd_cases(world), *adpsgd_cases(world)]
