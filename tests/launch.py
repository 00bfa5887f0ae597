"""Launch real multi-process runs from tests: N ranks on gloo, each writes its results to disk.

Used by every multi-process test. Ranks are started with ``torchrun`` (Lightning detects the
torchelastic environment) or with Lightning's own popen launcher (the script is started once and
Lightning re-runs it for the other ranks).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PL_DISABLE_FORK="1",
    )
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> subprocess.CompletedProcess:
    """Wait for every process (killing all on timeout); the first non-zero exit code wins."""
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            raise AssertionError(f"run timed out after {timeout}s:\n{out[-6000:]}") from None
        outs.append(out)
        codes.append(p.returncode)
    rc = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(procs[0].args, rc, "\n".join(outs), "")


def run_torchrun(
    script: str | Path,
    *args: str,
    nprocs: int,
    timeout: float = 240,
    nnodes: int = 1,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nprocs`` ranks with torchrun; ``nnodes > 1`` fakes several nodes.

    With ``nnodes > 1`` one torchrun per node is started on this machine (node ranks
    0..nnodes-1), as a multi-node job would be. Returns the node-0 process result with the
    output of all nodes concatenated.
    """
    port = free_port()
    cmd_base = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
                f"--nnodes={nnodes}", "--master-addr=127.0.0.1", f"--master-port={port}"]
    procs = []
    for node in range(nnodes):
        cmd = [*cmd_base, f"--node-rank={node}", str(script), *args]
        procs.append(subprocess.Popen(cmd, env=env or base_env(), cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return _wait_all(procs, timeout)


def run_fake_slurm(
    script: str | Path, *args: str, ntasks: int, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Start ``ntasks`` processes the way ``srun`` would on one node (SLURM_* variables set).

    Lightning's SLURM environment then provides the ranks, as on a real cluster.
    """
    port = str(free_port())
    procs = []
    for task in range(ntasks):
        env = base_env(
            SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task), SLURM_NODEID="0", SLURM_NNODES="1",
            SLURM_JOB_NAME="lightning-gossip-test", SLURM_JOB_ID="4242",
            SLURM_NODELIST="127.0.0.1", MASTER_PORT=port,
        )
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=ROOT,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return _wait_all(procs, timeout)


def run_lightning(
    script: str | Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``script`` once; Lightning's popen launcher starts the other ranks itself."""
    env = env or base_env()
    env.setdefault("MASTER_PORT", str(free_port()))
    try:
        return subprocess.run([sys.executable, str(script), *args], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
        raise AssertionError(f"run timed out after {timeout}s:\n{out[-6000:]}") from None


def check(result: subprocess.CompletedProcess) -> str:
    """Assert the run succeeded; show the tail of its output otherwise."""
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-8000:]}"
    return result.stdout


def read_rank_results(out_dir: Path, world_size: int) -> list[dict]:
    """Load ``rank{r}.json`` for every rank."""
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world_size)]
