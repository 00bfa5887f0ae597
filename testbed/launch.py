"""The one launcher of real multi-process runs, used by the tests and by the benchmarks.

N ranks on gloo, each writes its results to disk. Ranks are started with ``torchrun``
(Lightning detects the torchelastic environment), the way ``srun`` would start them (SLURM
variables), or with Lightning's own popen launcher (the script is started once and Lightning
re-runs it for the other ranks). Every variant goes through :func:`launch_processes`, which

* reads the output of every process as it comes (no pipe can fill up and stall a rank);
* on timeout first dumps the Python stacks of every process of the launch (``py-spy dump`` when
  it is installed, otherwise ``SIGABRT`` with faulthandler enabled through
  ``PYTHONFAULTHANDLER``), so a hang can be located from the output, then kills them all;
* kills every process it started, and their descendants, on any exit (an error, ``Ctrl-C``,
  ``SIGTERM`` of the caller). torchrun starts its ranks in sessions of their own, so the
  process tree is walked in ``/proc`` rather than signalling one process group;
* with ``reap_stopped=True`` (a torchrun launch with a rank frozen by ``SIGSTOP``), kills a
  stopped rank as soon as every other rank has ended: torchrun's agent stops its ranks with
  ``SIGTERM``, which a stopped process does not handle until it runs again, and kills it only
  30 s later.

With ``LG_NO_LAUNCH=1`` (``make test-fast``) every launch fails at once, naming the marker a
test that launches processes must carry (``multiprocess``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
STACK_DUMP_GRACE_S = 5.0  # how long the processes get to print their stacks before the kill


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(**extra: str) -> dict[str, str]:
    """Environment for the ranks: one thread each, the repository importable, no launcher vars.

    ``extra`` is applied last (e.g. ``MASTER_PORT`` or SLURM variables).
    """
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PL_DISABLE_FORK="1",
    )
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


# -- process tree -------------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before children (read from ``/proc``)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
    found: list[int] = []
    frontier = {pid}
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier and c not in found]
        found += kids
        frontier = set(kids)
    return found


def signal_all(pids: Sequence[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``, ignoring the ones already gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _tree(procs: Sequence[subprocess.Popen]) -> list[int]:
    """The started processes and all their descendants (roots last)."""
    pids: list[int] = []
    for p in procs:
        pids += descendants(p.pid)
    return pids + [p.pid for p in procs]


def _kill_tree(procs: Sequence[subprocess.Popen]) -> None:
    signal_all(_tree(procs), signal.SIGKILL)
    for p in procs:  # same-group leftovers that were reparented already
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def _proc_table() -> dict[int, tuple[int, str]]:
    """``pid -> (parent pid, state letter)`` of every process, read from ``/proc``."""
    table: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            table[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return table


def stopped_alone(roots: Sequence[int], table: dict[int, tuple[int, str]]) -> list[int]:
    """The children of ``roots`` (torchrun agents: their children are the ranks) that are
    stopped (state ``T``: ``SIGSTOP``) once no other child of any root runs (each has ended:
    gone, or a zombie not yet reaped): the frozen ranks nobody can wait on any more, which the
    agents are now only waiting for.

    >>> table = {10: (1, "S"), 11: (10, "Z"), 12: (10, "T"), 13: (10, "S"), 20: (1, "S"),
    ...          21: (20, "T")}
    >>> stopped_alone([10, 20], table)  # rank 13 (of the other agent than 21) still runs
    []
    >>> table[13] = (10, "Z")
    >>> stopped_alone([10, 20], table)
    [12, 21]
    """
    ranks = [pid for pid, (ppid, _) in table.items() if ppid in roots]
    if any(table[pid][1] not in "TZX" for pid in ranks):
        return []
    return sorted(pid for pid in ranks if table[pid][1] == "T")


def _reap_stopped(procs: Sequence[subprocess.Popen], done: threading.Event,
                  killed: list[int], every_s: float = 0.5) -> None:
    """Until ``done``: kill (``SIGKILL``) the ranks :func:`stopped_alone` finds under
    ``procs``, recording their pids in ``killed``."""
    while not done.wait(every_s):
        for pid in stopped_alone([p.pid for p in procs], _proc_table()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)


def dump_stacks(procs: Sequence[subprocess.Popen]) -> str:
    """Make every process of the launch show its Python stacks; returns text to add to the log.

    With ``py-spy`` on ``PATH`` its ``dump`` of each process is returned (the processes keep
    running). Otherwise each process gets ``SIGABRT``: with ``PYTHONFAULTHANDLER`` set (the
    launcher sets it) Python prints every thread's stack to the process's own output, which the
    launcher is reading, and exits.
    """
    pids = [p.pid for p in procs]
    for p in procs:
        pids += descendants(p.pid)
    spy = shutil.which("py-spy")
    if spy is None:  # launchers first (so none reacts to a dead rank), then one by one
        for pid in pids:
            signal_all([pid], signal.SIGABRT)
            time.sleep(0.3)  # the dumps share a pipe: one at a time reads better
        return f"[launch] sent SIGABRT to {len(pids)} processes for their stacks\n"
    parts = []
    for pid in pids:
        try:
            out = subprocess.run([spy, "dump", "--pid", str(pid)], text=True, timeout=30,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            out = f"py-spy failed: {e}\n"
        parts.append(f"[launch] py-spy dump of pid {pid}:\n{out}")
    return "".join(parts)


# -- the launcher -------------------------------------------------------------------------------
@dataclass
class Launched:
    """What :func:`launch_processes` observed: each process's output and exit code."""

    args: list[str]
    outputs: list[str]
    returncodes: list[int | None]
    timed_out: bool = False
    diagnostics: str = ""

    @property
    def returncode(self) -> int:
        """The first non-zero exit code, or 0 (-9 and the like for killed processes)."""
        return next((c for c in self.returncodes if c != 0 and c is not None), 0)

    @property
    def stdout(self) -> str:
        """The outputs of all processes, in start order, then the diagnostics of a timeout."""
        return "\n".join(self.outputs) + self.diagnostics

    def completed(self) -> subprocess.CompletedProcess:
        """As a ``subprocess.CompletedProcess`` (stderr is merged into stdout)."""
        return subprocess.CompletedProcess(self.args, self.returncode, self.stdout, "")


@dataclass
class _Reader:
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While launching, ``SIGTERM`` of the caller raises ``SystemExit`` so the ranks get killed."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def launch_processes(
    commands: Sequence[tuple[Sequence[str], dict[str, str]]],
    timeout: float,
    log: TextIO | None = None,
    on_line: Callable[[str], None] | None = None,
    reap_stopped: bool = False,
) -> Launched:
    """Start every ``(argv, env)`` in ``ROOT`` and wait for all of them, at most ``timeout`` s.

    stdout and stderr of each process are read as they come, kept, written to ``log`` and
    passed to ``on_line`` line by line. On timeout the stacks of every process are dumped
    (:func:`dump_stacks`) and everything is killed; ``timed_out`` is then set. Whatever
    happens, no process of the launch outlives this call.

    ``reap_stopped`` (torchrun launches: each command an agent whose children are the ranks):
    a rank stopped by ``SIGSTOP`` (a frozen rank) is killed as soon as every other rank of
    the launch has ended (:func:`stopped_alone`, checked every 0.5 s), as its agent kills it
    after 30 s; the output then says so. Not for Lightning's launcher, whose rank 0 is the
    other ranks' parent (and kills them itself with ``SIGKILL``).
    """
    if os.environ.get("LG_NO_LAUNCH") == "1":  # set by `make test-fast`
        raise AssertionError("this test launches processes: mark it @pytest.mark.multiprocess "
                             "(LG_NO_LAUNCH=1 forbids launches)")
    lock = threading.Lock()
    readers: list[_Reader] = []

    def pump(reader: _Reader) -> None:
        assert reader.proc.stdout is not None
        for line in reader.proc.stdout:
            with lock:
                reader.lines.append(line)
                if log is not None:
                    log.write(line)
                if on_line is not None:
                    on_line(line)

    timed_out, diagnostics = False, ""
    stragglers: list[int] = []
    reaped: list[int] = []
    reaping = threading.Event()
    with _sigterm_raises():
        try:
            for argv, env in commands:
                env = {**env, "PYTHONFAULTHANDLER": "1"}
                proc = subprocess.Popen(list(argv), env=env, cwd=ROOT, text=True,
                                        errors="replace", stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                reader = _Reader(proc)
                reader.thread = threading.Thread(target=pump, args=(reader,), daemon=True)
                reader.thread.start()
                readers.append(reader)
            if reap_stopped:
                threading.Thread(target=_reap_stopped, daemon=True,
                                 args=([r.proc for r in readers], reaping, reaped)).start()
            deadline = time.monotonic() + timeout
            for r in readers:
                try:
                    r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
            if timed_out:
                # every process now: once a launcher dies its workers are reparented and
                # no longer found from it (a SIGSTOPped rank does not die of SIGABRT)
                stragglers = _tree([r.proc for r in readers])
                diagnostics = dump_stacks([r.proc for r in readers])
                end = time.monotonic() + STACK_DUMP_GRACE_S
                while time.monotonic() < end and any(r.proc.poll() is None for r in readers):
                    time.sleep(0.1)
        finally:
            reaping.set()
            _kill_tree([r.proc for r in readers])
            signal_all(stragglers, signal.SIGKILL)
            for r in readers:
                r.proc.wait()
                if r.thread is not None:
                    r.thread.join(timeout=10)
    if reaped:
        diagnostics += (f"[launch] killed the stopped process(es) {sorted(set(reaped))} once "
                        "every other rank had ended\n")
    if timed_out:
        diagnostics += f"[launch] timed out after {timeout}s; every process was killed\n"
    with lock:
        outputs = ["".join(r.lines) for r in readers]
    return Launched(args=list(commands[0][0]), outputs=outputs,
                    returncodes=[r.proc.returncode for r in readers],
                    timed_out=timed_out, diagnostics=diagnostics)


def _finish(launched: Launched) -> subprocess.CompletedProcess:
    if launched.timed_out:
        raise AssertionError(f"run timed out (stacks of every process below):\n"
                             f"{launched.stdout[-12000:]}")
    return launched.completed()


def program(script: str | Path) -> list[str]:
    """How ``python`` (or ``torchrun``) is told to run ``script``: a module name
    (``"benchmarks.race.worker"``: no ``/``, no ``.py``) as ``-m NAME``, run from :data:`ROOT`
    like every launch; a file (a ``Path``, or a string with ``/`` or ending in ``.py``) by its
    path.

    >>> program("benchmarks.perf.step_time")
    ['-m', 'benchmarks.perf.step_time']
    >>> program(Path("tests/scripts/fault_cases.py"))
    ['tests/scripts/fault_cases.py']
    """
    if isinstance(script, Path) or "/" in script or script.endswith(".py"):
        return [str(script)]
    return ["-m", script]


def torchrun_command(script: str | Path, *args: str, nprocs: int, nnodes: int = 1,
                     node_rank: int = 0, port: int) -> list[str]:
    """The ``torchrun`` command line for one node of a run on this machine (``script``: a file
    or a module name, see :func:`program`)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
            f"--nnodes={nnodes}", "--master-addr=127.0.0.1", f"--master-port={port}",
            f"--node-rank={node_rank}", *program(script), *args]


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
    output of all nodes concatenated. A timeout raises ``AssertionError`` with the stacks.
    """
    port = free_port()
    commands = [(torchrun_command(script, *args, nprocs=nprocs, nnodes=nnodes, node_rank=node,
                                  port=port), env or base_env()) for node in range(nnodes)]
    return _finish(launch_processes(commands, timeout))


def fake_slurm_commands(script: str | Path, *args: str, ntasks: int,
                        env: dict[str, str] | None = None, nodes: int = 1
                        ) -> list[tuple[list[str], dict[str, str]]]:
    """The ``(argv, env)`` of ``ntasks`` processes started the way ``srun`` would on ``nodes``
    nodes of ``ntasks // nodes`` tasks each (``SLURM_*`` variables set; every node's address
    is this machine's): Lightning's SLURM environment then provides the ranks. ``env``: added
    to every task's environment."""
    port = str(free_port())
    commands, per_node = [], ntasks // nodes
    for task in range(ntasks):
        task_env = base_env(
            SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(per_node),
            SLURM_PROCID=str(task), SLURM_LOCALID=str(task % per_node),
            SLURM_NODEID=str(task // per_node), SLURM_NNODES=str(nodes),
            SLURM_JOB_NAME="lightning-gossip-test", SLURM_JOB_ID="4242",
            SLURM_NODELIST="127.0.0.1", MASTER_PORT=port, **(env or {}),
        )
        commands.append(([sys.executable, *program(script), *args], task_env))
    return commands


def relaunched_once(command: tuple[list[str], dict[str, str]], exists: str | Path,
                    delay_s: float = 0.0) -> tuple[list[str], dict[str, str]]:
    """A ``testbed.elastic_fit`` task's ``command`` started again, as ``srun`` relaunching it
    would (its environment, its rank slot), once the file ``exists`` exists (e.g. ``OUT/
    recovered``, written by a survivor after its recovery) and ``delay_s`` seconds more: the
    same program with nobody to kill (``-1 0``)."""
    argv, env = command
    start = shlex.join([*argv[:-2], "-1", "0"])
    return (["bash", "-c", f"while [ ! -f {exists} ]; do sleep 0.2; done; sleep {delay_s:g}; "
                           f"exec {start}"], env)


def run_fake_slurm(
    script: str | Path, *args: str, ntasks: int, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Start ``ntasks`` processes the way ``srun`` would on one node (SLURM_* variables set).

    Lightning's SLURM environment then provides the ranks, as on a real cluster.
    """
    return _finish(launch_processes(fake_slurm_commands(script, *args, ntasks=ntasks), timeout))


def run_fake_slurm_each(script: str | Path, *args: str, ntasks: int, timeout: float = 240,
                        env: dict[str, str] | None = None, nodes: int = 1) -> Launched:
    """:func:`run_fake_slurm` with each task's exit code (``returncodes``: a test that kills
    a task checks the others); a timeout raises ``AssertionError`` with the stacks. ``env``:
    added to every task's environment; ``nodes``: as :func:`fake_slurm_commands`."""
    launched = launch_processes(
        fake_slurm_commands(script, *args, ntasks=ntasks, env=env, nodes=nodes), timeout)
    _finish(launched)
    return launched


def run_lightning(
    script: str | Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``script`` once; Lightning's popen launcher starts the other ranks itself."""
    env = dict(env or base_env())
    env.setdefault("MASTER_PORT", str(free_port()))
    return _finish(launch_processes([([sys.executable, *program(script), *args], env)],
                                    timeout))


def check(result: subprocess.CompletedProcess) -> str:
    """Assert the run succeeded; show the tail of its output otherwise, after the first error
    line each rank printed (a rank's own error is often far above the tail, which shows the
    others naming it and the launcher's summary)."""
    if result.returncode != 0:
        firsts: dict[str, str] = {}
        for line in result.stdout.splitlines():
            rank = line.split("]:", 1)[0] + "]" if line.startswith("[rank") else ""
            if rank not in firsts and ("Error" in line or "Exception" in line):
                firsts[rank] = line[:500]
        heads = "\n".join(f"{rank or '(no rank prefix)'} {line}"
                           for rank, line in sorted(firsts.items()))
        raise AssertionError(f"exit code {result.returncode}; each rank's first error line:\n"
                             f"{heads}\n--- the output's tail:\n{result.stdout[-8000:]}")
    return result.stdout


def read_rank_results(out_dir: Path, world_size: int) -> list[dict]:
    """Load ``rank{r}.json`` for every rank."""
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world_size)]


def parse_events(text: str) -> list[dict[str, Any]]:
    """The ``EVENT {json}`` records of ``text`` (two processes' lines may share a line)."""
    decoder, out = json.JSONDecoder(), []
    for piece in text.split("EVENT ")[1:]:
        try:
            out.append(decoder.raw_decode(piece)[0])
        except json.JSONDecodeError:
            pass
    return out
