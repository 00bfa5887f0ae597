"""The multi-node launches of the hierarchical / wire-dtype / global-average tests.

Two layouts, each launched once per test session with all of its cases: ``torchrun`` with
``--nnodes 2 --node-rank k`` (2 processes each) on loopback, and 2 fake SLURM nodes of 2 tasks
(``SLURM_NNODES=2``, ``SLURM_NODEID``, ``SLURM_LOCALID``, as ``srun`` sets them). Also the
NumPy references the results are compared with.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from tests.cases import Case, check, write_cases
from tests.launch import base_env, free_port, launch_processes, read_rank_results, run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "hier_cases.py"
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

_done: dict[str, Path] = {}
_outputs: dict[str, str] = {}


def small_layout_run(tmp_factory, nodes: int, devices: int) -> tuple[Path, str]:
    """Launch the cases of the ``nodes x devices`` layout (1 x 2: :data:`ONE_NODE`; 2 x 1:
    :data:`ONE_PROC_HIER` and :data:`ONE_PROC_FLAT`) once; their folder and the output."""
    key = f"{nodes}x{devices}"
    if key not in _done:
        cases = [ONE_NODE] if nodes == 1 else [ONE_PROC_HIER, ONE_PROC_FLAT]
        tmp = tmp_factory.mktemp(f"multinode_{key}")
        write_cases(tmp / "cases.json", cases)
        _outputs[key] = check(run_torchrun(SCRIPT, str(tmp), str(tmp / "cases.json"),
                                           nprocs=devices, nnodes=nodes, timeout=900))
        _done[key] = tmp
    return _done[key], _outputs[key]


def torchrun_run(tmp_factory) -> Path:
    """Launch :data:`TORCHRUN_CASES` once (2 torchruns, ``--nnodes 2``); their folder."""
    if "torchrun" not in _done:
        tmp = tmp_factory.mktemp("multinode_torchrun")
        write_cases(tmp / "cases.json", TORCHRUN_CASES)
        check(run_torchrun(SCRIPT, str(tmp), str(tmp / "cases.json"), nprocs=DEVICES,
                           nnodes=NODES, timeout=1500))
        _done["torchrun"] = tmp
    return _done["torchrun"]


def slurm_env(node: int, local: int, port: int) -> dict[str, str]:
    """The variables ``srun`` sets for task ``local`` of node ``node`` (2 nodes x 2 tasks)."""
    return base_env(
        SLURM_NTASKS=str(WORLD), SLURM_NTASKS_PER_NODE=str(DEVICES), SLURM_NNODES=str(NODES),
        SLURM_PROCID=str(node * DEVICES + local), SLURM_LOCALID=str(local),
        SLURM_NODEID=str(node), SLURM_JOB_NAME="lightning-gossip-test", SLURM_JOB_ID="4243",
        SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port),
    )


def slurm_run(tmp_factory) -> Path:
    """Launch :data:`SLURM_CASES` once as 2 fake SLURM nodes of 2 tasks; their folder."""
    if "slurm" not in _done:
        tmp = tmp_factory.mktemp("multinode_slurm")
        write_cases(tmp / "cases.json", SLURM_CASES)
        port = free_port()
        commands = [([sys.executable, str(SCRIPT), str(tmp), str(tmp / "cases.json")],
                     slurm_env(node, local, port))
                    for node in range(NODES) for local in range(DEVICES)]
        launched = launch_processes(commands, timeout=900)
        assert not launched.timed_out, launched.stdout[-12000:]
        check(launched.completed())
        _done["slurm"] = tmp
    return _done["slurm"]


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
