"""Network namespaces as emulated cluster nodes, joined by rate-limited veth links (needs root).

:class:`EmulatedCluster` builds, for one run,

* one network namespace per node (``<prefix>-<suffix>-n<k>``) holding one end of a veth pair
  (``<prefix><suffix>n<k>``) with the address ``10.213.<x>.<k+1>/24`` and its loopback up;
* one more namespace (``<prefix>-<suffix>-br``) holding a bridge that joins the other ends
  (``<prefix><suffix>p<k>``) of all pairs;
* a ``tbf`` qdisc of the given rate on *both* ends of every pair: the node end limits what the
  node sends, the bridge end what it receives (a full-duplex NIC of that speed).

Nothing is created in the namespace this process runs in: links are created directly inside the
new namespaces, the addresses exist only there and no route leads anywhere else. Processes on the
same node talk over the node's loopback (the kernel routes a node's own address through ``lo``),
so the veth counters (``/sys/class/net/IF/statistics/tx_bytes``, read inside the namespace)
count exactly the inter-node traffic. With ``latency_ms`` > 0 every packet between two nodes is
delayed by that much each way: by a ``netem`` qdisc on what a node sends, with the ``tbf`` below
it (:func:`link_qdiscs`), or, on kernels built without ``netem`` (``CONFIG_NET_SCH_NETEM``, not
set on the 2-core machines of this project), by :mod:`testbed.link_delay` (``NFQUEUE`` on what a
node receives, released by a real-time user-space process, its hold calibrated so that the
measured round trip is the asked one). :func:`latency_problem` says before anything is built
when neither works; the cluster records the round trip it measured (:mod:`testbed.rtt_probe`).

:meth:`EmulatedCluster.close` kills every process left in the namespaces and deletes them (which
deletes the veth pairs and the bridge with them); it is idempotent and is called on ``with``
exit. :func:`remove_leftovers` removes whatever an interrupted run left behind, by prefix (an
exact one: ``--cleanup --prefix lgr`` leaves ``lgr2-...`` and ``lgrt-...`` alone). Give every
concurrent user of this module a prefix of its own that is no extension of another's: the
benchmarks use ``lgc`` (``cluster.py``, also ``--scheduler slurm``) and ``lgr`` (``race.py``), the
tests ``tcs``, ``trs``, ``tsj`` and ``tsf``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import link_delay, rtt_probe

PREFIX = "lgc"
"""Default name prefix of every namespace and interface made here."""

SUBNET = "10.213"
"""First two octets of the private /24 used inside the namespaces (third octet per run)."""

COMMAND_TIMEOUT_S = 30.0
"""Timeout of every ``ip``/``tc`` command."""


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def _run(cmd: list[str], timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """Run a short command; return its stdout; raise ``RuntimeError`` naming it on failure."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise ClusterUnavailable(f"{cmd[0]} not found ({e})") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)!r} timed out after {timeout:g}s") from None
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)!r} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def node_address(subnet_octet: int, node: int) -> str:
    """The address of node ``node`` (0-based) on the run's /24.

    >>> node_address(7, 0)
    '10.213.7.1'
    """
    return f"{SUBNET}.{subnet_octet}.{node + 1}"


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Token-bucket size for ``rate_mbit``: 10 ms of traffic, at least 64 KiB (a GSO packet).

    >>> tbf_burst_bytes(200)
    250000
    >>> tbf_burst_bytes(10)
    65536
    """
    return max(65536, int(rate_mbit * 1e6 / 8 * 0.01))


def link_qdiscs(iface: str, rate_mbit: float, latency_ms: float = 0.0) -> list[list[str]]:
    """The ``tc`` commands (after ``tc``) that shape one end of a link: a ``tbf`` of the rate,
    under a ``netem`` delay of ``latency_ms`` when it is positive.

    >>> print(" ".join(*link_qdiscs("v0", 200)))
    qdisc add dev v0 root tbf rate 200mbit burst 250000 latency 50ms
    >>> for cmd in link_qdiscs("v0", 100, 25):
    ...     print(" ".join(cmd))
    qdisc add dev v0 root handle 1: netem delay 25ms limit 100000
    qdisc add dev v0 parent 1:1 handle 10: tbf rate 100mbit burst 125000 latency 50ms
    """
    tbf = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit)),
           "latency", "50ms"]
    if latency_ms <= 0:
        return [["qdisc", "add", "dev", iface, "root", *tbf]]
    return [["qdisc", "add", "dev", iface, "root", "handle", "1:", "netem", "delay",
             f"{latency_ms:g}ms", "limit", "100000"],
            ["qdisc", "add", "dev", iface, "parent", "1:1", "handle", "10:", *tbf]]


def netem_problem(prefix: str = PREFIX) -> str | None:
    """``None`` when ``tc netem`` works inside a namespace here, else why not (needs root)."""
    probe = f"{prefix}-probe-{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", probe])
    except (RuntimeError, ClusterUnavailable) as e:
        return f"cannot create a network namespace: {e}"
    try:
        inside = ["ip", "netns", "exec", probe]
        _run([*inside, "ip", "link", "add", "lgprobe0", "type", "veth", "peer", "name",
              "lgprobe1"])
        for cmd in link_qdiscs("lgprobe0", 100, 0.5):
            _run([*inside, "tc", *cmd])
    except (RuntimeError, ClusterUnavailable) as e:
        return (f"tc netem does not work here (a kernel without CONFIG_NET_SCH_NETEM?), so "
                f"no link latency can be emulated: {e}")
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def latency_method(prefix: str = PREFIX) -> tuple[str | None, str | None]:
    """How latency is emulated here: (``"netem"`` or ``"nfqueue"``, None), or (None, why not)."""
    netem = netem_problem(prefix)
    if netem is None:
        return "netem", None
    nfq = link_delay.problem()
    if nfq is None:
        return "nfqueue", None
    return None, f"{netem}; nor by NFQUEUE: {nfq}"


def latency_problem(prefix: str = PREFIX) -> str | None:
    """``None`` when link latency can be emulated here (:func:`latency_method`), else why not."""
    return latency_method(prefix)[1]


def check_available(prefix: str = PREFIX) -> str | None:
    """``None`` when a network namespace can be made here, else the reason why not."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "no Linux network namespaces on this system"
    probe = f"{prefix}-probe-{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", probe])
    except ClusterUnavailable as e:
        return f"iproute2 is not installed: {e}"
    except RuntimeError as e:
        return f"cannot create a network namespace (needs root / CAP_SYS_ADMIN): {e}"
    try:
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "show"])
    except (RuntimeError, ClusterUnavailable) as e:
        return f"tc (iproute2) does not work inside a namespace: {e}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def list_namespaces() -> list[str]:
    """Names of the network namespaces known to ``ip netns``."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of the links in the namespace this process runs in."""
    out = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def namespace_pids(netns: str) -> list[int]:
    """Ids of the processes running inside namespace ``netns``."""
    out = _run(["ip", "netns", "pids", netns], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def kill_namespace_processes(netns: str, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process in ``netns``, SIGKILL what is left after ``grace_s``; their ids."""
    pids = namespace_pids(netns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and namespace_pids(netns):
            time.sleep(0.1)
        if not namespace_pids(netns):
            break
    return pids


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces and (this namespace's) links whose name starts with ``prefix``."""
    return ([f"netns {n}" for n in list_namespaces() if n.startswith(prefix)]
            + [f"link {n}" for n in list_links() if n.startswith(prefix)])


def made_with(prefix: str, name: str, link: bool = False) -> bool:
    """Whether a cluster of name prefix ``prefix`` made the namespace (``link``: the link)
    ``name``: ``<prefix>-...`` (a namespace: a run's nodes and bridge, the probe of
    :func:`check_available`; ``prefix`` may go on into a run's suffix, ``lgc-1a2b``), or
    ``<prefix><suffix>n<k>``/``p<k>``/``br`` (a link). A longer prefix is another run's:
    ``lgr`` does not match ``lgr2-...`` nor ``lgrt...``.

    >>> [made_with("lgr", n) for n in ("lgr-1a2b-n0", "lgr2-1a2b-n0", "lgrt-1a2b-br")]
    [True, False, False]
    >>> [made_with("lgr", n, link=True) for n in ("lgr1a2bn0", "lgr1a2bbr", "lgrt1a2bp1")]
    [True, True, False]
    """
    if link:
        return re.fullmatch(rf"{re.escape(prefix)}[0-9a-f]{{4}}(n\d+|p\d+|br)", name) is not None
    return name.startswith(prefix if prefix.endswith("-") else f"{prefix}-")


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Kill the processes in, and delete, every namespace/link a cluster of name prefix
    ``prefix`` made (:func:`made_with`: not those of a longer prefix); what went."""
    removed = []
    for ns in list_namespaces():
        if made_with(prefix, ns):
            kill_namespace_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(f"netns {ns}")
    for link in list_links():
        if made_with(prefix, link, link=True):
            _run(["ip", "link", "del", link], check=False)
            removed.append(f"link {link}")
    return removed


@dataclass
class Node:
    """One emulated node: its namespace, its veth end (and the peer end on the bridge)."""

    index: int
    netns: str
    iface: str
    peer: str
    address: str


@dataclass
class EmulatedCluster:
    """K namespaces ("nodes") joined through rate-limited veth links to a bridge.

    Args:
        nodes: number of nodes (>= 1).
        rate_mbit: link rate in Mbit/s, each direction, of every node's link.
        latency_ms: one-way delay between any two nodes (``netem`` where the kernel has it,
            else :mod:`testbed.link_delay`); 0: none.
        prefix: name prefix of everything created (``--cleanup`` removes by it).
    """

    nodes: int
    rate_mbit: float
    prefix: str = PREFIX
    latency_ms: float = 0.0
    suffix: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet_octet: int = field(default_factory=lambda: secrets.randbelow(250) + 1)
    members: list[Node] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    closed: bool = False
    latency_via: str | None = None
    delay: link_delay.LinkDelay | None = None
    latency_check: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {self.rate_mbit}")
        if len(f"{self.prefix}{self.suffix}p{self.nodes - 1}") > 15:
            raise ValueError(f"prefix {self.prefix!r} too long for interface names (15 chars)")
        self.bridge_ns = f"{self.prefix}-{self.suffix}-br"
        self.bridge = f"{self.prefix}{self.suffix}br"
        self.members = [
            Node(k, f"{self.prefix}-{self.suffix}-n{k}", f"{self.prefix}{self.suffix}n{k}",
                 f"{self.prefix}{self.suffix}p{k}", node_address(self.subnet_octet, k))
            for k in range(self.nodes)
        ]

    # -- building -------------------------------------------------------------------------------
    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])

    def _tbf(self, netns: str, iface: str, latency_ms: float = 0.0) -> None:
        for cmd in link_qdiscs(iface, self.rate_mbit, latency_ms):
            _run(["ip", "netns", "exec", netns, "tc", *cmd])

    def build(self) -> EmulatedCluster:
        """Create the namespaces, links, bridge, addresses and rate limits (all or nothing)."""
        if self.latency_ms > 0:
            self.latency_via, problem = latency_method(self.prefix)
            if problem:
                raise ClusterUnavailable(f"no link latency can be emulated here: {problem}")
        netem_ms = self.latency_ms if self.latency_via == "netem" else 0.0
        try:
            self._add_netns(self.bridge_ns)
            br = ["ip", "netns", "exec", self.bridge_ns]
            _run([*br, "ip", "link", "add", self.bridge, "type", "bridge"])
            _run([*br, "ip", "link", "set", self.bridge, "up"])
            for n in self.members:
                self._add_netns(n.netns)
                _run(["ip", "link", "add", "name", n.iface, "netns", n.netns, "type", "veth",
                      "peer", "name", n.peer, "netns", self.bridge_ns])
                _run([*br, "ip", "link", "set", n.peer, "master", self.bridge])
                _run([*br, "ip", "link", "set", n.peer, "up"])
                inside = ["ip", "netns", "exec", n.netns]
                _run([*inside, "ip", "addr", "add", f"{n.address}/24", "dev", n.iface])
                _run([*inside, "ip", "link", "set", n.iface, "up"])
                self._tbf(n.netns, n.iface, netem_ms)  # the delay: once per way
                self._tbf(self.bridge_ns, n.peer)
            self._wait_reachable()
            if self.latency_ms > 0:
                self._emulate_latency()
        except BaseException:
            self.close()
            raise
        return self

    def _rtt(self) -> dict[str, float] | None:
        """The round trip from node 1 to node 0 (``None`` with one node)."""
        if self.nodes < 2:
            return None
        return rtt_probe.rtt_ms(self.exec_prefix(0), self.exec_prefix(1), self.members[0].address)

    def _emulate_latency(self) -> None:
        """Start :mod:`testbed.link_delay` (no ``netem``), calibrate its hold so that the round
        trip grows by twice the one-way latency, and record the round trips measured."""
        check: dict[str, Any] = {"via": self.latency_via, "asked_rtt_added_ms": 2 * self.latency_ms}
        if self.latency_via == "nfqueue":
            links = [(n.netns, n.iface) for n in self.members]
            base = self._rtt()
            check["rtt_without_delay"] = base
            self.delay = link_delay.LinkDelay(self.latency_ms, links).start()
            first = self._rtt()
            if base and first:
                # the user-space round trip and wake-up add to the hold: take them off it once
                extra = (first["median_ms"] - base["median_ms"]) / 2 - self.latency_ms
                hold = max(0.0, self.latency_ms - extra)
                if abs(extra) > 0.02 * self.latency_ms + 0.01:
                    self.delay.stop()
                    self.delay = link_delay.LinkDelay(self.latency_ms, links, hold).start()
                check.update(uncalibrated_rtt=first, hold_ms=round(self.delay.hold_ms, 4))
        check["rtt"] = self._rtt()
        if check.get("rtt_without_delay") and check["rtt"]:
            check["rtt_added_ms"] = round(check["rtt"]["median_ms"]
                                          - check["rtt_without_delay"]["median_ms"], 4)
        self.latency_check = check

    def _wait_reachable(self, timeout_s: float = 20.0) -> None:
        """Wait until every node's interface is up (bridge ports leave 'learning' quickly)."""
        deadline = time.monotonic() + timeout_s
        for n in self.members:
            while True:
                state = self.read_sys(n.index, "operstate")
                if state == "up":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {n.index}: {n.iface} not up after {timeout_s}s "
                                       f"(operstate {state!r})")
                time.sleep(0.1)

    # -- using ----------------------------------------------------------------------------------
    def exec_prefix(self, node: int) -> list[str]:
        """Command prefix that runs a program inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.members[node].netns]

    def read_sys(self, node: int, name: str) -> str:
        """``/sys/class/net/<iface>/<name>`` of node ``node``, read inside its namespace."""
        n = self.members[node]
        out = _run([*self.exec_prefix(node), "cat", f"/sys/class/net/{n.iface}/{name}"])
        return out.strip()

    def counters(self, node: int) -> dict[str, int]:
        """Bytes and packets node ``node`` has sent and received on its link so far."""
        return {key: int(self.read_sys(node, f"statistics/{key}"))
                for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}

    def all_counters(self) -> list[dict[str, int]]:
        """:meth:`counters` of every node."""
        return [self.counters(k) for k in range(self.nodes)]

    def kill_processes(self) -> list[int]:
        """Kill every process still running inside any node (and the bridge); their ids."""
        killed = []
        for ns in [n.netns for n in self.members] + [self.bridge_ns]:
            if ns in self.created:
                killed += kill_namespace_processes(ns)
        return killed

    def end_launch(self, procs: list[subprocess.Popen]) -> None:
        """Kill whatever the launch ``procs`` left in the nodes, then reap the launchers (each
        started in a session of its own: its group is killed if it does not exit in time)."""
        self.kill_processes()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    def describe(self) -> dict[str, Any]:
        """What was built, for reports."""
        return {
            "nodes": self.nodes, "rate_mbit": self.rate_mbit, "qdisc": "tbf (both directions)",
            "burst_bytes": tbf_burst_bytes(self.rate_mbit),
            "latency_emulated": self.latency_ms > 0, "latency_ms": self.latency_ms,
            "latency_check": self.latency_check,
            "link_delay": self.delay.describe() if self.delay else None,
            "subnet": f"{SUBNET}.{self.subnet_octet}.0/24",
            "members": [{"node": n.index, "netns": n.netns, "iface": n.iface,
                         "address": n.address} for n in self.members],
            "bridge_netns": self.bridge_ns, "prefix": self.prefix, "suffix": self.suffix,
        }

    # -- tearing down ---------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what runs inside, delete every namespace made (links go with them). Idempotent."""
        if self.closed:
            return
        errors = []
        if self.delay is not None:
            try:
                self.delay.stop()
            except Exception as e:  # keep deleting
                errors.append(f"stopping the link delay: {e}")
        try:
            self.kill_processes()
        except Exception as e:  # keep deleting
            errors.append(f"killing processes: {e}")
        for ns in reversed(self.created):
            try:
                _run(["ip", "netns", "del", ns], check=False)
            except Exception as e:
                errors.append(f"deleting {ns}: {e}")
        left = (leftovers(f"{self.prefix}-{self.suffix}-")
                + leftovers(f"{self.prefix}{self.suffix}"))
        self.closed = True
        if left or errors:
            raise RuntimeError(f"cluster {self.suffix}: cleanup incomplete: {left + errors}")

    def __enter__(self) -> EmulatedCluster:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_counters(iface: str) -> dict[str, int]:
    """This namespace's byte/packet counters of ``iface`` (as a rank inside a node sees them)."""
    base = Path("/sys/class/net") / iface / "statistics"
    return {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets",
                                                        "rx_packets")}


def worker_env(iface: str, root: str) -> dict[str, str]:
    """The environment of ranks started inside a node: one thread each, no launcher variables
    of the caller, gloo on the node's link ``iface``, the repository ``root`` importable."""
    env = dict(os.environ)
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK",
                "GROUP_RANK", "SLURM_JOB_ID", "SLURM_NTASKS"):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PL_DISABLE_FORK="1",
        PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME=iface,
        PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


def _raise_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP unwind like Ctrl-C (``SystemExit``), so a driver's
    ``finally`` removes the cluster; a signal ignored when the run started (nohup, a background
    job) stays ignored. The previous handlers are back afterwards."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s, handler in old.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _raise_on_signal)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
