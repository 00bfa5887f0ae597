"""The shared launches: every strategy case of one process layout runs in one launch per run.

Process start-up (Python, torch, Lightning: about 6 s of CPU per rank) dominates the short
fits the strategy tests check, so the cases are grouped by the layout they need and each layout
is launched once per test run (``shared_run`` in ``conftest.py``), whichever test file needs it
first; the tests read the JSON each case wrote. A layout may end with one case that is
expected to fail (a rank raises, sends NaN, holds a different model): the cases before it have
written their results by then, and the failure test reads the launch's output.

All layouts run ``tests/scripts/hier_cases.py`` (``gossip_cases.py`` with start offsets drawn
per node for hierarchical cases; the same fits otherwise).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from testbed.launch import base_env, free_port, launch_processes, torchrun_command
from tests import cases as C
from tests import multinode as M
from tests import period_cases as P
from tests import remedies as R
from tests.cases import Case, write_cases

SCRIPT = Path(__file__).parent / "scripts" / "hier_cases.py"


@dataclass(frozen=True)
class Layout:
    """How the ranks of a shared launch are started, and the cases they run in turn."""

    nprocs: int  # processes per node
    nnodes: int
    launcher: Literal["torchrun", "slurm"]
    cases: tuple[Case, ...]
    failing: Case | None = None  # run last; the launch is expected to fail in it
    timeout: float = 1800
    script: Path = SCRIPT  # the rank script

    @property
    def world(self) -> int:
        """The number of ranks."""
        return self.nprocs * self.nnodes

    def all_cases(self) -> list[Case]:
        """The cases in launch order (the failing one last)."""
        return [*self.cases, *((self.failing,) if self.failing else ())]


# the failure cases: each ends the launch it is the last case of
AD_RAISES = Case("ad_fail", strategy="adpsgd", epochs=5, batches=20, lr=0.1,
                 raise_at={"rank": 2, "step": 4}, strategy_kwargs={"timeout": 60})
AD_NAN = Case("ad_nan", strategy="adpsgd", epochs=3, batches=20, lr=0.1,
              nan_at={"rank": 1, "step": 3}, strategy_kwargs={"timeout": 60})
DP_MISMATCH = Case("dp_mismatch", mismatch_rank=1)
#: a flat dpsgd case on 2 torchrun nodes (the default topology)
DP_NODES = Case("dp_nodes", strategy_kwargs={"final_average": False, "seed": 5}, offset=1.0,
                num_nodes=2, exact_topology="random_ring")


def _on_nodes(cases: list[Case], nodes: int) -> tuple[Case, ...]:
    """``cases`` with the Trainer's ``num_nodes`` of the layout (flat cases do not depend on it)."""
    return tuple(replace(c, num_nodes=nodes) for c in cases)


LAYOUTS: dict[str, Layout] = {
    "world1": Layout(1, 1, "torchrun", tuple(C.all_cases(1))),
    "world2": Layout(2, 1, "torchrun", (*C.all_cases(2), M.ONE_NODE, M.AH_ONE_NODE),
                     failing=AD_NAN),
    # as srun starts them: Lightning's SLURM environment gives the ranks
    "world3": Layout(3, 1, "slurm", tuple(C.all_cases(3)), failing=AD_RAISES),
    # 2 torchrun nodes of 2: the flat 4-rank cases, the hierarchical ones of both strategies
    "world4": Layout(2, 2, "torchrun", (*_on_nodes(C.all_cases(4), 2), DP_NODES,
                                        *M.TORCHRUN_CASES, *M.ADPSGD_2X2, *P.CASES)),
    "world5": Layout(5, 1, "torchrun", tuple(C.all_cases(5)), failing=DP_MISMATCH),
    # 2 fake SLURM nodes of 2 tasks (SLURM_NNODES, SLURM_NODEID, SLURM_LOCALID as srun sets)
    "slurm2x2": Layout(2, 2, "slurm", tuple(M.SLURM_CASES)),
    # 2 nodes of one process: hierarchical equals flat
    "nodes2x1": Layout(1, 2, "torchrun", (M.ONE_PROC_HIER, M.ONE_PROC_FLAT, M.AH_ONE_PROC,
                                          M.AD_ONE_PROC_FLAT)),
    # the remedies: outer optimizer on the global average, overlapped node all-reduce
    "remedies2x2": Layout(2, 2, "torchrun", tuple(R.CASES), script=R.SCRIPT),
}


def slurm_env(nodes: int, tasks: int, node: int, local: int, port: int) -> dict[str, str]:
    """The variables ``srun`` sets for task ``local`` of node ``node``."""
    return base_env(
        SLURM_NTASKS=str(nodes * tasks), SLURM_NTASKS_PER_NODE=str(tasks),
        SLURM_NNODES=str(nodes), SLURM_PROCID=str(node * tasks + local),
        SLURM_LOCALID=str(local), SLURM_NODEID=str(node), SLURM_JOB_NAME="lightning-gossip-test",
        SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port),
    )


def launch_layout(key: str, folder: Path) -> None:
    """Run the cases of ``LAYOUTS[key]`` in one launch; results, ``output.txt`` and
    ``returncode`` under ``folder``. Fails (with the output) if a case that should succeed
    left no result, or if the launch failed without a failing case."""
    layout = LAYOUTS[key]
    write_cases(folder / "cases.json", layout.all_cases())
    args = [str(folder), str(folder / "cases.json")]
    port = free_port()
    if layout.launcher == "torchrun":
        commands = [(torchrun_command(layout.script, *args, nprocs=layout.nprocs,
                                      nnodes=layout.nnodes, node_rank=node, port=port),
                     base_env())
                    for node in range(layout.nnodes)]
    else:
        commands = [([sys.executable, str(layout.script), *args],
                     slurm_env(layout.nnodes, layout.nprocs, node, local, port))
                    for node in range(layout.nnodes) for local in range(layout.nprocs)]
    launched = launch_processes(commands, layout.timeout)
    text = launched.stdout
    (folder / "output.txt").write_text(text)
    (folder / "returncode").write_text(str(launched.returncode))
    assert not launched.timed_out, f"{key} timed out:\n{text[-12000:]}"
    missing = [c.name for c in layout.cases for r in range(layout.world)
               if not (folder / c.name / f"rank{r}.json").exists()]
    assert not missing, f"{key}: no result from {sorted(set(missing))}:\n{text[-12000:]}"
    if layout.failing is None:
        assert launched.returncode == 0, f"{key}: exit code {launched.returncode}:\n{text[-8000:]}"


def output(folder: Path) -> str:
    """The output of every process of the shared launch that wrote to ``folder``."""
    return (Path(folder) / "output.txt").read_text()


def returncode(folder: Path) -> int:
    """The launch's exit code (the first non-zero one of its processes)."""
    return int((Path(folder) / "returncode").read_text())


def timings(folder: Path) -> list[dict]:
    """The ``TIMING`` lines of the launch (CPU and wall seconds per rank and case)."""
    out = []
    for line in output(folder).splitlines():
        if "TIMING {" in line:
            out.append(json.loads(line[line.index("TIMING {") + 7:]))
    return out
