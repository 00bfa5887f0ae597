"""The multi-node cases of the hierarchical / wire-dtype / global-average tests, and the NumPy
references their results are compared with.

They run in the shared launches of ``tests/shared_runs.py``: 2 torchrun nodes of 2 processes
(``world4``, with the flat 4-rank cases), 2 fake SLURM nodes of 2 tasks (``slurm2x2``), 2 nodes
of one process (``nodes2x1``) and one node of 2 (``world2``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from testbed.launch import read_rank_results
from tests.cases import Case

NODES, DEVICES = 2, 2
WORLD = NODES * DEVICES
#: a 2-node mixing matrix that does not average in one step (halves the disagreement)
W2 = [[0.75, 0.25], [0.25, 0.75]]
EVERY = 3  # global_average_every_n_steps of the GA cases

_H = {"final_average": False, "hierarchical": True, "topology": W2}
_BASE = dict(num_nodes=NODES, offset=1.0)
HIER_EXACT = Case("hier_exact", strategy_kwargs=_H, **_BASE)
HIER_BLOCKING = Case("hier_blocking", strategy_kwargs={**_H, "overlap": False}, **_BASE)
HIER_DELAY = Case("hier_delay", strategy_kwargs={**_H, "delay_by_one": True}, **_BASE)
HIER_TRAIN = Case("hier_train", lr=0.5, batchnorm=True, batches=8, num_nodes=NODES,
                  strategy_kwargs={"final_average": False, "hierarchical": True})
HIER_BF16 = Case("hier_bf16", strategy_kwargs={**_H, "wire_dtype": "bf16"}, batches=30,
                 **_BASE)
BF16_RING = Case("bf16_ring", batches=40, strategy_kwargs={
    "final_average": False, "topology": "ring", "wire_dtype": "bf16"}, **_BASE)
BF16_RANDOM_RING = Case("bf16_random_ring", batches=40, strategy_kwargs={
    "final_average": False, "topology": "random_ring", "seed": 5, "wire_dtype": "bf16"}, **_BASE)
FP16_RING = replace(BF16_RING, name="fp16_ring", batches=20,
                    strategy_kwargs={**BF16_RING.strategy_kwargs, "wire_dtype": "fp16"})
GA_FLAT = Case("ga_flat", batches=7, strategy_kwargs={
    "final_average": False, "topology": "ring", "global_average_every_n_steps": EVERY}, **_BASE)
GA_HIER = Case("ga_hier", batches=7, lr=0.5, strategy_kwargs={
    **_H, "global_average_every_n_steps": EVERY}, **_BASE)
AD_GA = Case("ad_ga", strategy="adpsgd", epochs=2, strategy_kwargs={
    "final_average": False, "global_average_every_n_steps": 4, "timeout": 60,
    "consensus_every_n_steps": 1}, log=True, **_BASE)
_DIGITS = dict(task="digits", lr=0.05, epochs=4, val_batches=1.0, different_init=False,
               batch_size=16, num_nodes=NODES)
CONV_HIER = Case("conv_hier", strategy_kwargs={"hierarchical": True}, **_DIGITS)
CONV_HIER_BF16 = Case("conv_hier_bf16",
                      strategy_kwargs={"hierarchical": True, "wire_dtype": "bf16"}, **_DIGITS)
TORCHRUN_CASES = [HIER_EXACT, HIER_BLOCKING, HIER_DELAY, HIER_TRAIN, HIER_BF16, BF16_RING,
                  BF16_RANDOM_RING, FP16_RING, GA_FLAT, GA_HIER, AD_GA, CONV_HIER, CONV_HIER_BF16]

# hierarchical AD-PSGD (tests/test_hierarchical_adpsgd.py)
_AD = {"final_average": False, "consensus_every_n_steps": 1, "timeout": 60}
_AH = {**_AD, "hierarchical": True}
_AD_LR0 = dict(strategy="adpsgd", offset=1.0, epochs=3, log=True, num_nodes=NODES)
AH_LR0 = Case("ah_lr0", strategy_kwargs=_AH, **_AD_LR0)
AH_DELAY = Case("ah_delay_lr0", strategy_kwargs={**_AH, "delay_by_one": True}, **_AD_LR0)
AH_BF16 = Case("ah_bf16_lr0", strategy_kwargs={**_AH, "wire_dtype": "bf16"}, **_AD_LR0)
AD_BF16 = Case("ad_bf16_lr0", strategy_kwargs={**_AD, "wire_dtype": "bf16"}, **_AD_LR0)
AD_FP16 = Case("ad_fp16_lr0", strategy_kwargs={**_AD, "wire_dtype": "fp16",
                                               "pairing": "random", "seed": 3}, **_AD_LR0)
AH_TRAIN = Case("ah_train", strategy="adpsgd", lr=0.5, batchnorm=True, batches=8, epochs=2,
                num_nodes=NODES, strategy_kwargs={**_AH, "max_staleness": 1})
_AD_DIGITS = dict(strategy="adpsgd", task="digits", lr=0.05, epochs=4, val_batches=1.0,
                  different_init=False, batch_size=16, num_nodes=NODES)
CONV_AH = Case("conv_ah", strategy_kwargs={"hierarchical": True}, **_AD_DIGITS)
CONV_AH_BF16 = Case("conv_ah_bf16",
                    strategy_kwargs={"hierarchical": True, "wire_dtype": "bf16"}, **_AD_DIGITS)
#: node 1 slow (its rank 2 sleeps after every batch): node 0 must take more of each epoch
AH_STRAGGLER = Case("ah_straggler", strategy="adpsgd", epochs=2, batches=12, slow_rank=2,
                    slow_ms=60, num_nodes=NODES, strategy_kwargs={**_AH, "timeout": 60})
# the slow node's step is several times the fast node's and an epoch long enough for it to learn
# its pace, so it leaves the epoch's last batches (``shared_cursor="balanced"``)
AH_BALANCED = replace(AH_STRAGGLER, name="ah_balanced", slow_ms=100, batches=24,
                      strategy_kwargs={**AH_STRAGGLER.strategy_kwargs, "shared_cursor": "balanced"})
ADPSGD_2X2 = [AH_LR0, AH_DELAY, AH_BF16, AD_BF16, AD_FP16, AH_TRAIN, CONV_AH, CONV_AH_BF16,
              AH_STRAGGLER, AH_BALANCED]

AH_ONE_PROC = Case("ah_one_proc", strategy_kwargs=_AH, **{**_AD_LR0, "num_nodes": 2})
AD_ONE_PROC_FLAT = replace(AH_ONE_PROC, name="ad_one_proc_flat", strategy_kwargs=_AD)
AH_ONE_NODE = Case("ah_one_node", strategy="adpsgd", lr=0.5, batchnorm=True, offset=1.0,
                   num_nodes=1, strategy_kwargs=_AH)

SLURM_TRAIN = replace(HIER_TRAIN, name="slurm_hier_train")
SLURM_BF16 = replace(HIER_TRAIN, name="slurm_hier_bf16",
                     strategy_kwargs={**HIER_TRAIN.strategy_kwargs, "wire_dtype": "bf16"})
SLURM_FLAT = replace(HIER_TRAIN, name="slurm_flat",
                     strategy_kwargs={**HIER_TRAIN.strategy_kwargs, "hierarchical": False})
SLURM_CASES = [SLURM_TRAIN, SLURM_BF16, SLURM_FLAT]

# one node of 2 processes (plain data parallelism), and 2 nodes of one process (= flat)
ONE_NODE = Case("one_node_dp", lr=0.5, batchnorm=True, offset=1.0, num_nodes=1,
                strategy_kwargs={"final_average": False, "hierarchical": True})
ONE_PROC_HIER = Case("one_proc_hier", lr=0.5, batchnorm=True, offset=1.0, num_nodes=2,
                     strategy_kwargs={"final_average": False, "hierarchical": True})
ONE_PROC_FLAT = replace(ONE_PROC_HIER, name="one_proc_flat",
                        strategy_kwargs={"final_average": False, "hierarchical": False})

def results(folder: Path, case: Case, world: int = WORLD) -> list[dict]:
    """Every rank's JSON of ``case``, in global-rank order."""
    return read_rank_results(folder / case.name, world)


def node_mixing(x0: np.ndarray, w: np.ndarray, steps: int,
                delay_by_one: bool = False) -> list[np.ndarray]:
    """Node replicas after each step for lr = 0 (rows = nodes), as ``tests.cases``'s
    ``expected_mixing`` for a static matrix ``w``."""
    eye = np.eye(len(x0))
    xs, prev, x = [], None, x0.copy()
    for _ in range(steps):
        if delay_by_one:
            new = x if prev is None else x + (w - eye) @ prev
            prev, x = x, new
        else:
            x = w @ x
        xs.append(x)
    if delay_by_one:
        xs.append(x + (w - eye) @ prev)
    return xs


def relative_consensus(x: np.ndarray) -> float:
    """mean_i ||x_i - mean||^2 / ||mean||^2 of the rows of ``x``."""
    mean = x.mean(0)
    return float(np.mean(np.sum((x - mean) ** 2, axis=1)) / np.sum(mean**2))
