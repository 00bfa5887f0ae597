"""A real SLURM (``slurmctld`` + one ``slurmd`` per node) on the emulated cluster (needs root).

Used by ``benchmarks/perf/cluster.py --scheduler slurm`` and ``tests/test_slurm_cluster.py``.
:class:`SlurmCluster` starts, on an :class:`cluster_net.EmulatedCluster`,

* one ``munged`` for all nodes (in this namespace, on a socket of its own in the run folder;
  a path-bound Unix socket is reachable from every network namespace);
* ``slurmctld`` in node 0's network namespace, and one ``slurmd`` per node in that node's
  network namespace, each also in a UTS namespace of its own whose hostname is the node's name
  (``node0``, ``node1``, ...: slurmctld and slurmd check the hostname against the
  configuration). Node names resolve inside the namespaces through ``/etc/netns/<ns>/hosts``
  (which ``ip netns exec`` bind-mounts over ``/etc/hosts``), so Lightning's
  ``SLURMEnvironment`` finds the master from ``SLURM_NODELIST``;
* a ``slurm.conf`` (SLURM 22.05) with per-node spool, pid and log paths (``%n``),
  ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
  ``JobAcctGatherType=jobacct_gather/none``, ``MailProg=/bin/true``, no accounting
  database (so no ``sacct``: job states come from ``scontrol show job``) and a
  ``cgroup.conf`` with ``CgroupPlugin=cgroup/v1``. ``ip netns exec`` remounts ``/sys``
  without the cgroup hierarchies, so each slurmd mounts a tmpfs on ``/sys/fs/cgroup`` and
  the host's v1 controllers under it, inside its own mount namespace (nothing shows outside).

Everything runs as root, jobs too. :meth:`SlurmCluster.close` (also on ``with`` exit) kills every
process in the nodes' namespaces (daemons, job steps, tasks), stops munged, deletes the
namespaces, the ``/etc/netns`` folders and the run folder; :func:`remove_leftovers` removes what
a killed run (SIGKILL) left behind, by prefix. :func:`ensure_installed` installs ``slurm-wlm`` and
``munge`` with apt when they are missing (root only).
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import cluster_net

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
"""What a SLURM cluster here needs on ``PATH`` (or in ``/usr/sbin``)."""

APT_PACKAGES = ("slurm-wlm", "munge")
"""Debian packages that provide :data:`PROGRAMS`."""

CGROUP_CONTROLLERS = ("freezer", "memory", "cpuset", "devices", "cpu", "cpuacct")
"""cgroup v1 controllers mounted inside every slurmd's mount namespace."""

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
"""Job states after which a job runs no more (unless requeued)."""

ETC_NETNS = Path("/etc/netns")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def missing_programs() -> list[str]:
    """Programs of :data:`PROGRAMS` not installed here."""
    return [p for p in PROGRAMS if _which(p) is None]


def ensure_installed(log: Any = None) -> str | None:
    """Install ``slurm-wlm`` and ``munge`` with apt if missing; ``None`` or why not possible.

    Idempotent: nothing is run when every program is there (as ``scripts/setup.sh`` does for
    espeak-ng). Daemons are never started by the packages here (they are started per run).
    """
    if not missing_programs():
        return None
    if os.geteuid() != 0:
        return f"SLURM is not installed ({', '.join(missing_programs())} missing) and not root"
    if _which("apt-get") is None:
        return "SLURM is not installed and apt-get is not available"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"[slurm] installing {' '.join(APT_PACKAGES)} with apt", file=log or sys.stderr,
          flush=True)
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{' '.join(cmd)!r} failed: {e}"
        if p.returncode != 0:
            return f"{' '.join(cmd)!r} failed ({p.returncode}): {p.stderr.strip()[-500:]}"
    missing = missing_programs()
    return f"still missing after apt: {', '.join(missing)}" if missing else None


def check_available(prefix: str = cluster_net.PREFIX, install: bool = True) -> str | None:
    """``None`` when a SLURM cluster can be brought up here, else the reason why not."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network, UTS and mount namespaces, daemons running as root)"
    reason = cluster_net.check_available(prefix)
    if reason:
        return reason
    if _which("unshare") is None:
        return "unshare (util-linux) is not installed"
    return ensure_installed() if install else (
        f"missing: {', '.join(missing_programs())}" if missing_programs() else None)


def host_cgroup_mounts() -> list[tuple[str, str]]:
    """``(folder name, mount options)`` of this host's cgroup v1 hierarchies to mount.

    Mirrors the host's grouping of :data:`CGROUP_CONTROLLERS` (e.g. ``cpu`` and ``cpuacct``
    separate or together): a controller can be in one hierarchy only. Where the host has none
    of them as v1 (a pure cgroup v2 host), the usual grouping is tried.
    """
    found: list[tuple[str, str]] = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) < 4 or parts[2] != "cgroup":
            continue
        ctrls = [o for o in parts[3].split(",") if o in CGROUP_CONTROLLERS]
        if ctrls:
            found.append((Path(parts[1]).name, ",".join(ctrls)))
    if not found:
        found = [(c, c) for c in ("freezer", "memory", "cpuset", "devices")] + [
            ("cpu,cpuacct", "cpu,cpuacct")]
    return found


def node_shell(hostname: str, cgroups: list[tuple[str, str]] | None) -> str:
    """Shell run by ``unshare --uts`` in a node's namespace before ``exec "$@"``.

    Sets the hostname and, for a slurmd, mounts the cgroup v1 hierarchies (see the module
    docstring); the mounts live only in this process tree's mount namespace.
    """
    lines = ["set -e", f"hostname {shlex.quote(hostname)}"]
    if cgroups is not None:
        lines.append("mount -t tmpfs -o mode=755 lg-cgroup /sys/fs/cgroup")
        for name, opts in cgroups:
            d = shlex.quote(f"/sys/fs/cgroup/{name}")
            lines.append(f"mkdir -p {d} && mount -t cgroup -o {shlex.quote(opts)} cgroup {d}")
    lines.append('exec "$@"')
    return "\n".join(lines)


def first_job_id(now: float | None = None) -> int:
    """The first job id of a cluster started at ``now`` (default: now): the seconds since the
    epoch modulo 50,000,000, plus 1,000,000. Every cluster starts from a fresh state, so without
    it every run's first job would be job 1, and the templates' ``runs/<name>-$SLURM_JOB_ID``
    folder of an earlier run would be resumed from; these ids repeat after about 19 months.

    >>> first_job_id(1_800_000_000.0)
    1000000
    """
    return int(time.time() if now is None else now) % 50_000_000 + 1_000_000


def slurm_conf(name: str, run: Path, munge_socket: Path, nodes: list[tuple[str, str]],
               cpus: int) -> str:
    """The ``slurm.conf`` of a cluster ``name`` of ``nodes`` ``(name, address)`` (see above)."""
    host, addr = nodes[0]
    node_lines = [f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN" for n, a in nodes]
    return "\n".join([
        f"ClusterName={name}", f"FirstJobId={first_job_id()}",
        f"SlurmctldHost={host}({addr})",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={run}/state",
        f"SlurmdSpoolDir={run}/spool/%n",
        f"SlurmdPidFile={run}/run/slurmd-%n.pid",
        f"SlurmdLogFile={run}/log/slurmd-%n.log",
        f"SlurmctldPidFile={run}/run/slurmctld.pid",
        f"SlurmctldLogFile={run}/log/slurmctld.log",
        "SlurmctldPort=6817", "SlurmdPort=6818",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "MailProg=/bin/true",
        "MpiDefault=none", "SwitchType=switch/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides", "ReturnToService=2",
        "SlurmctldTimeout=30", "SlurmdTimeout=60", "InactiveLimit=0", "KillWait=5",
        "MinJobAge=3600", "SchedulerType=sched/backfill",
        *node_lines,
        "PartitionName=emulated Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def parse_job(text: str) -> dict[str, str]:
    """``Key=Value`` fields of ``scontrol show job -o`` output (values without spaces).

    >>> parse_job("JobId=3 JobName=x JobState=COMPLETED Reason=None ExitCode=0:0")["JobState"]
    'COMPLETED'
    """
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))


@dataclass
class SlurmCluster:
    """SLURM daemons on an :class:`cluster_net.EmulatedCluster` of ``nodes`` nodes.

    Args:
        nodes: number of nodes (slurmd's).
        rate_mbit: link rate of every node, Mbit/s each direction.
        cpus: CPUs every node announces (``CPUs=`` in ``slurm.conf``; not checked against the
            hardware, ``config_overrides``): at least the tasks a job puts on a node.
        prefix: name prefix of the namespaces, links, ``/etc/netns`` folders and run folder.
        keep: keep the run folder (configuration, daemon logs) after :meth:`close`.
    """

    nodes: int
    rate_mbit: float
    cpus: int = 2
    prefix: str = cluster_net.PREFIX
    keep: bool = False
    net: cluster_net.EmulatedCluster = field(init=False)
    run: Path = field(init=False)
    daemons: list[subprocess.Popen] = field(default_factory=list)
    munged: subprocess.Popen | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.net = cluster_net.EmulatedCluster(self.nodes, self.rate_mbit, prefix=self.prefix)
        self.run = Path(f"/tmp/{self.prefix}-slurm-{self.net.suffix}")
        self.names = [f"node{k}" for k in range(self.nodes)]
        self.conf = self.run / "etc" / "slurm.conf"
        self.munge_socket = self.run / "munge" / "munge.socket"

    # -- bringing up ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        """Build the network, start munged, slurmctld and the slurmd's; wait until all idle."""
        try:
            self.net.build()
            for sub in ("etc", "munge", "state", "run", "log",
                        *[f"spool/{n}" for n in self.names]):
                (self.run / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.run, 0o755)
            self._write_hosts()
            self._start_munge()
            nodes = [(n, m.address) for n, m in zip(self.names, self.net.members)]
            self.conf.write_text(slurm_conf(f"lg{self.net.suffix}", self.run,
                                            self.munge_socket, nodes, self.cpus))
            (self.conf.parent / "cgroup.conf").write_text(
                "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
            self._daemon(0, "slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], None)
            cgroups = host_cgroup_mounts()
            for k in range(self.nodes):
                self._daemon(k, f"slurmd-{self.names[k]}",
                             ["slurmd", "-D", "-f", str(self.conf), "-N", self.names[k]],
                             cgroups)
            self.wait_idle(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _write_hosts(self) -> None:
        hosts = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        hosts += [f"{m.address} {n}" for n, m in zip(self.names, self.net.members)]
        for m in self.net.members:
            d = ETC_NETNS / m.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(hosts) + "\n")

    def _start_munge(self) -> None:
        d = self.munge_socket.parent
        os.chmod(d, 0o700)
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        cmd = [_which("munged") or "munged", "-F", "--force", f"--socket={self.munge_socket}",
               f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
               f"--log-file={self.run / 'log' / 'munged.log'}", f"--seed-file={d / 'seed'}"]
        self.munged = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True)
        (self.run / "run" / "munged.pid").write_text(str(self.munged.pid))
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.log_tail('munged.log')}")
            time.sleep(0.1)

    def _daemon(self, node: int, name: str, cmd: list[str],
                cgroups: list[tuple[str, str]] | None) -> None:
        """Start ``cmd`` in node ``node``'s network namespace, UTS namespace = its name."""
        full = [*self.net.exec_prefix(node), "unshare", "--uts", "--", "sh", "-c",
                node_shell(self.names[node], cgroups), name, _which(cmd[0]) or cmd[0], *cmd[1:]]
        with open(self.run / "log" / f"{name}.out", "w") as out:
            self.daemons.append(subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL,
                                                 start_new_session=True))

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until ``sinfo`` shows every node idle; raise with the daemons' logs if not."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            dead = [p.args[-1] for p in self.daemons if p.poll() is not None]
            if dead:
                break
            p = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
            if len(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle within {timeout_s:g} s (sinfo: {states}); "
                           f"daemon logs:\n{self.daemon_logs()}")

    # -- using ----------------------------------------------------------------------------------
    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for SLURM commands and the jobs they submit (``SLURM_CONF`` set).

        Launcher variables of the caller (``SLURM_*``, ``MASTER_*``, ``RANK`` ...) are dropped.
        """
        env = dict(os.environ if base is None else base)
        for key in list(env):
            if key.startswith("SLURM_") or key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK",
                                                   "NODE_RANK", "WORLD_SIZE", "RANK"):
                del env[key]
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client(self, cmd: list[str], check: bool = True, env: dict[str, str] | None = None,
               cwd: str | Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a SLURM client command (``sbatch``, ``scontrol`` ...) inside node 0."""
        p = subprocess.run([*self.net.exec_prefix(0), *cmd], capture_output=True, text=True,
                           env=env or self.client_env(), cwd=cwd, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
        return p

    def submit(self, script: str | Path, args: list[str] = (), cwd: str | Path | None = None,
               env: dict[str, str] | None = None) -> str:
        """``sbatch [args] script`` from ``cwd`` (default: this one); the job id."""
        p = self.client(["sbatch", "--parsable", *args, str(script)], env=env, cwd=cwd)
        return p.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` of ``job_id`` as fields (empty when unknown)."""
        p = self.client(["scontrol", "show", "job", "-o", job_id], check=False)
        return parse_job(p.stdout) if p.returncode == 0 else {}

    def wait(self, job_id: str, timeout_s: float, poll_s: float = 1.0) -> dict[str, str]:
        """Wait until job ``job_id`` is in a terminal state; its fields (``JobState=TIMEOUT``
        here is SLURM's time limit; on *our* timeout the job is cancelled and ``wait_timeout``
        is set)."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id) or info
            if info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(poll_s)
        self.client(["scancel", job_id], check=False)
        time.sleep(2)
        info = self.job(job_id) or info
        info["wait_timeout"] = f"not finished within {timeout_s:g} s: cancelled"
        return info

    def daemon_logs(self, chars: int = 2000) -> str:
        """The end of every daemon's log (slurmctld, slurmd's, munged)."""
        return "\n".join(f"--- {f.name}\n{self.log_tail(f.name, chars)}"
                         for f in sorted((self.run / "log").iterdir()))

    def log_tail(self, name: str, chars: int = 2000) -> str:
        """The end of the run folder's ``log/<name>``."""
        try:
            return (self.run / "log" / name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- tearing down ---------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process in the nodes, stop munged, remove everything made. Idempotent."""
        if self.closed:
            return
        self.closed = True
        errors: list[str] = []
        try:
            self.net.kill_processes()  # slurmctld, slurmd's, job steps, tasks
        except Exception as e:
            errors.append(f"killing processes: {e}")
        for p in self.daemons:
            _reap(p)
        if self.munged is not None:
            _stop(self.munged.pid)
            _reap(self.munged)
        try:
            self.net.close()
        except Exception as e:
            errors.append(str(e))
        for m in self.net.members:
            shutil.rmtree(ETC_NETNS / m.netns, ignore_errors=True)
        if not self.keep:
            shutil.rmtree(self.run, ignore_errors=True)
        if errors:
            raise RuntimeError(f"SLURM cluster {self.net.suffix}: cleanup incomplete: {errors}")

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM ``pid``, SIGKILL it if still there after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
                return
            time.sleep(0.1)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _reap(p: subprocess.Popen) -> None:
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)


def remove_leftovers(prefix: str = cluster_net.PREFIX) -> list[str]:
    """Remove what killed runs left: processes in and namespaces named ``prefix...`` (see
    :func:`cluster_net.remove_leftovers`), their munged, ``/etc/netns`` and run folders."""
    removed = cluster_net.remove_leftovers(prefix)
    for run in sorted(Path("/tmp").glob(f"{prefix}-slurm-*")):
        pidfile = run / "run" / "munged.pid"
        try:
            pid = int(pidfile.read_text())
            if "munged" in Path(f"/proc/{pid}/cmdline").read_text():
                _stop(pid)
                removed.append(f"munged {pid}")
        except (OSError, ValueError):
            pass
        shutil.rmtree(run, ignore_errors=True)
        removed.append(f"folder {run}")
    if ETC_NETNS.is_dir():
        for d in sorted(ETC_NETNS.glob(f"{prefix}-*")):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"folder {d}")
    return removed


# -- the command line of ``benchmarks/perf/cluster.py --scheduler slurm`` ----------------------
def _progress(msg: str) -> None:
    print(f"[slurm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _job_output(info: dict[str, str]) -> str:
    """The job's output file(s) (``StdOut``, and ``StdErr`` when it is another file)."""
    paths = [info.get("StdOut", "")]
    if info.get("StdErr") and info.get("StdErr") != paths[0]:
        paths.append(info["StdErr"])
    parts = []
    for path in paths:
        try:
            parts.append(f"--- {path}\n{Path(path).read_text(errors='replace')}")
        except OSError as e:
            parts.append(f"--- {path}: cannot read ({e})")
    return "\n".join(parts)


def run_sbatch(args: Any) -> int:
    """``cluster.py --scheduler slurm --sbatch FILE``: bring SLURM up, run the job, tear down.

    Prints the job's state (``scontrol show job``), the bytes every node sent on its link
    during the job, and the job's output. Returns 0 only when the job COMPLETED, 1 when it did
    not (or did not finish within ``args.job_timeout``; it is then cancelled), 2 where SLURM
    cannot run here.
    """
    reason = check_available(args.prefix)
    if reason:
        print(f"cluster: skipped: {reason}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    cluster = SlurmCluster(args.nodes, args.rate, cpus=args.procs, prefix=args.prefix,
                           keep=args.keep_logs)
    # SIGTERM/SIGHUP too reach the finally that removes everything
    with cluster_net.signals_unwind():
        try:
            job_id, info, wall, sent = _run_job(cluster, args, t0)
        except BaseException as e:
            _progress(f"stopped ({type(e).__name__}: {e}); removing the cluster")
            raise
        finally:
            try:
                cluster.close()
            finally:
                if args.keep_logs:
                    _progress(f"configuration and daemon logs kept in {cluster.run}")
    fields = ("JobId", "JobName", "JobState", "Reason", "ExitCode", "RunTime", "NodeList",
              "NumNodes", "NumTasks", "Restarts")
    print("scontrol show job: " + " ".join(f"{k}={info.get(k, '?')}" for k in fields))
    print(f"job wall time (submit to end, polled every 1 s): {wall:.1f} s; bytes sent per "
          f"node on its link: {sent}")
    if "wait_timeout" in info:
        print(f"job {job_id}: {info['wait_timeout']}")
    print(_job_output(info))
    ok = info.get("JobState") == "COMPLETED" and "wait_timeout" not in info
    return 0 if ok else 1


def _run_job(cluster: SlurmCluster, args: Any,
             t0: float) -> tuple[str, dict[str, str], float, list[int]]:
    """Start SLURM, submit the batch script and wait for it: (the job id, its ``scontrol``
    fields, the wall time from submission to its end, the bytes each node sent on its link)."""
    cluster.start()
    _progress(f"SLURM up in {time.monotonic() - t0:.1f} s: {args.nodes} nodes x "
              f"{args.procs} CPUs, {args.rate:g} Mbit/s links")
    env = cluster.client_env()
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    before = cluster.net.all_counters()
    t_job = time.monotonic()
    job_id = cluster.submit(Path(args.sbatch).resolve(), shlex.split(args.sbatch_args),
                            cwd=os.getcwd(), env=env)
    _progress(f"submitted job {job_id}: sbatch {args.sbatch_args} {args.sbatch}")
    info = cluster.wait(job_id, args.job_timeout)
    wall = time.monotonic() - t_job
    sent = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(cluster.net.all_counters(), before)]
    if info.get("JobState") != "COMPLETED":
        print(f"daemon logs (the job did not complete):\n{cluster.daemon_logs(1500)}")
    return job_id, info, wall, sent
