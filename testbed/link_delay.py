"""A one-way link delay for kernels without ``netem``: hold every packet a node sends for a fixed
time in user space (netfilter's ``NFQUEUE``), then let it go on to the link's ``tbf``.

Where the kernel has no ``sch_netem`` (``CONFIG_NET_SCH_NETEM`` is not set on the 2-core
machines of this project) but has ``NFQUEUE`` (``CONFIG_NETFILTER_XT_TARGET_NFQUEUE``) and
``iptables`` is installed, :class:`LinkDelay` emulates what ``tc qdisc add ... netem delay D``
does on a node's link:

* one ``iptables -t mangle -A POSTROUTING -o <iface> -j NFQUEUE`` rule per node namespace sends
  every packet the node puts on its link to queue 0 *of that namespace*, before the qdisc (so
  the ``tbf`` still shapes it afterwards, as under ``netem``'s child ``tbf``);
* one delay process, started in the caller's namespace (so a launch that kills every process in
  the nodes leaves it alone), opens one netlink socket per node namespace (``setns``), receives
  each packet's id only (no payload copied; GSO packets whole) and accepts it ``delay_ms`` after
  it arrived. The delay is the same for every packet, so ids fall due in order and one batch
  verdict (``NFQNL_MSG_VERDICT_BATCH``: every id up to this one) releases all that are due.

It runs at real-time priority (``SCHED_FIFO``) so that a loaded machine does not stretch the
delay; it holds no payload, and nothing but a timer and a ``select`` runs between packets.
The netlink round trip and the wake-up add about 0.1-0.3 ms per packet on the 2-core machines
here, so :class:`testbed.cluster_net.EmulatedCluster` calibrates the hold once per cluster
against a TCP ping-pong (:mod:`testbed.rtt_probe`) and records the round trip it got.
Without the process (killed, crashed) the queue has no listener and the node's link drops
everything: a race fails loudly, it never runs silently without its delay.

Run by :class:`testbed.cluster_net.EmulatedCluster` when ``netem`` is missing; by hand::

    python -m testbed.link_delay --delay-ms 0.5 --netns lgc-ab12-n0 lgc-ab12-n1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

from testbed.launch import base_env

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 1 << 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
QUEUE = 0
"""The queue number used in every node namespace (queues are per namespace)."""
QUEUE_MAXLEN = 100_000
"""Packets a queue may hold (the kernel drops beyond it): far above a link's delay x rate."""
READY = "link-delay: ready"


def attr(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes.

    >>> attr(1, b"ab").hex()
    '0600010061620000'
    """
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def message(msg: int, flags: int, seq: int, attrs: bytes, queue: int = QUEUE) -> bytes:
    """An nfnetlink message of the queue subsystem (``nfgenmsg`` with the queue number).

    >>> len(message(NFQNL_MSG_CONFIG, NLM_F_REQUEST, 1, attr(1, b"abcd")))
    28
    """
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg,
                       NLM_F_REQUEST | flags, seq, 0) + body


def packet_ids(data: bytes) -> list[int]:
    """The packet ids of every ``NFQNL_MSG_PACKET`` in a netlink read.

    >>> hdr = struct.pack(">IHB", 7, 0x0800, 4) + b"\\0"
    >>> packet_ids(message(NFQNL_MSG_PACKET, 0, 0, attr(NFQA_PACKET_HDR, hdr)))
    [7]
    """
    ids, off = [], 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a = off + 20
            while a + 4 <= off + length:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype & 0x3FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from(">I", data, a + 4)[0])
                    break
                a += (alen + 3) & ~3
        off += (length + 3) & ~3
    return ids


def _check_ack(sock: socket.socket, what: str) -> None:
    data = sock.recv(65536)
    length, kind = struct.unpack_from("=IH", data, 0)
    if kind == NLMSG_ERROR:
        err = struct.unpack_from("=i", data, 16)[0]
        if err:
            raise OSError(-err, f"{what}: {os.strerror(-err)}")


def open_queue(netns: str | None) -> socket.socket:
    """A netlink socket bound to queue :data:`QUEUE` of network namespace ``netns`` (``None``:
    this one), copying metadata only, GSO packets whole."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        if netns is not None:
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
            finally:
                os.close(fd)
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    finally:
        if netns is not None and libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back failed")
        os.close(home)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root)
    sock.setsockopt(270, 5, 1)  # SOL_NETLINK, NETLINK_NO_ENOBUFS
    sock.send(message(NFQNL_MSG_CONFIG, NLM_F_ACK, 1,
                      attr(NFQA_CFG_CMD, struct.pack(">BxH", NFQNL_CFG_CMD_BIND, 0))))
    _check_ack(sock, f"binding queue {QUEUE} in {netns}")
    cfg = (attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
           + attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN))
           + attr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_GSO))
           + attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_GSO)))
    sock.send(message(NFQNL_MSG_CONFIG, NLM_F_ACK, 2, cfg))
    _check_ack(sock, f"configuring queue {QUEUE} in {netns}")
    sock.setblocking(False)
    return sock


class Lateness:
    """How late the releases were (seconds past each batch's due time), for the record."""

    def __init__(self) -> None:
        self.batches = 0
        self.packets = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def add(self, late_s: float, packets: int) -> None:
        self.batches += 1
        self.packets += packets
        self.total_s += late_s
        self.max_s = max(self.max_s, late_s)

    def summary(self) -> dict[str, float]:
        """The figures so far.

        >>> Lateness().summary()["batches"]
        0
        """
        return {"batches": self.batches, "packets": self.packets,
                "mean_late_ms": round(1e3 * self.total_s / max(1, self.batches), 4),
                "max_late_ms": round(1e3 * self.max_s, 3)}


def serve(socks: list[socket.socket], delay_s: float, lateness: Lateness) -> None:
    """Accept every packet of every queue ``delay_s`` after it arrived; runs until killed."""
    held: list[collections.deque] = [collections.deque() for _ in socks]
    by_fd = {s.fileno(): k for k, s in enumerate(socks)}
    verdict_seq = 0
    while True:
        heads = [q[0][0] for q in held if q]
        timeout = max(0.0, min(heads) - time.monotonic()) if heads else None
        readable, _, _ = select.select(socks, [], [], timeout)
        now = time.monotonic()
        for s in readable:
            k = by_fd[s.fileno()]
            while True:
                try:
                    data = s.recv(1 << 20)
                except BlockingIOError:
                    break
                for pid in packet_ids(data):
                    held[k].append((now + delay_s, pid))
        now = time.monotonic()
        for k, q in enumerate(held):
            last, first_due, count = None, None, 0
            while q and q[0][0] <= now:
                due, last = q.popleft()
                first_due = due if first_due is None else first_due
                count += 1
            if last is not None:
                verdict_seq += 1
                socks[k].send(message(NFQNL_MSG_VERDICT_BATCH, 0, verdict_seq,
                                      attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))))
                lateness.add(now - first_due, count)


def rule(iface: str, action: str = "-A") -> list[str]:
    """The ``iptables`` command that queues what arrives on ``iface`` (``-D`` removes it).

    >>> " ".join(rule("v0"))
    'iptables -t mangle -A PREROUTING -i v0 -j NFQUEUE --queue-num 0'
    """
    return ["iptables", "-t", "mangle", action, "PREROUTING", "-i", iface, "-j", "NFQUEUE",
            "--queue-num", str(QUEUE)]


def problem() -> str | None:
    """``None`` when this machine can run :class:`LinkDelay` (root, ``iptables``), else why not."""
    if os.geteuid() != 0:
        return "the NFQUEUE link delay needs root"
    try:
        subprocess.run(["iptables", "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"iptables is not installed (apt-get install iptables): {e}"
    return None


class LinkDelay:
    """The delay process for some node namespaces, and their ``iptables`` rules.

    ``start`` launches the process, waits until every queue is bound, then adds the rules;
    ``stop`` ends it (the namespaces, with their rules, are the caller's to delete)."""

    def __init__(self, delay_ms: float, links: list[tuple[str, str]],
                 hold_ms: float | None = None) -> None:
        """``links``: (namespace, interface) of every node link to delay; ``hold_ms``: how long
        each packet is held (default ``delay_ms``; less to make up for the mechanism's own
        round trip, as :class:`testbed.cluster_net.EmulatedCluster` calibrates it)."""
        if delay_ms <= 0 or (hold_ms is not None and hold_ms < 0):
            raise ValueError(f"delay_ms must be positive and hold_ms >= 0, got {delay_ms}, "
                             f"{hold_ms}")
        self.delay_ms = delay_ms
        self.hold_ms = delay_ms if hold_ms is None else hold_ms
        self.links = links
        self.proc: subprocess.Popen | None = None
        self.lateness: dict[str, float] | None = None

    def start(self, timeout_s: float = 30.0) -> LinkDelay:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testbed.link_delay", "--delay-ms", str(self.hold_ms),
             "--netns", *[ns for ns, _ in self.links]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env())
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != READY:
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"link delay did not start within {timeout_s:g}s: "
                               f"{line.strip()} {err.strip()[-2000:]}")
        for ns, iface in self.links:
            out = subprocess.run(["ip", "netns", "exec", ns, *rule(iface)], capture_output=True,
                                 text=True, timeout=30)
            if out.returncode != 0:
                self.stop()
                raise RuntimeError(f"iptables in {ns} failed: {out.stderr.strip()}")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End the process; its lateness figures go to :attr:`lateness` (once it reported)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=10)
        with contextlib.suppress(ValueError, IndexError):
            self.lateness = json.loads(out.strip().splitlines()[-1])

    def describe(self) -> dict[str, object]:
        return {"how": "NFQUEUE on each node's ingress, released by a user-space process at "
                       "SCHED_FIFO (this kernel has no netem)",
                "delay_ms": self.delay_ms, "hold_ms": self.hold_ms, "alive": self.alive(),
                "lateness": self.lateness}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, required=True,
                   help="how long each packet is held (0: released at once)")
    p.add_argument("--netns", nargs="+", required=True, help="node namespaces to serve")
    args = p.parse_args(argv)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # never outlive the cluster that started us
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError as e:
        print(f"link-delay: no real-time priority ({e}); the delay may stretch under load",
              file=sys.stderr)
    socks = [open_queue(ns) for ns in args.netns]
    print(READY, flush=True)
    lateness = Lateness()

    def report(*_: object) -> None:
        print(json.dumps(lateness.summary()), flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    serve(socks, args.delay_ms / 1000.0, lateness)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
