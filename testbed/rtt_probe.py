"""Round-trip time between two emulated nodes: a TCP ping-pong of one byte (``TCP_NODELAY``).

:func:`rtt_ms` runs the server inside one node's namespace and the client inside another's and
returns the client's figures, so a record can say what link latency its cluster really had
(``tc netem`` or :mod:`testbed.link_delay`), not only what was asked for::

    python -m testbed.rtt_probe server 10.213.7.1      # inside node 0
    python -m testbed.rtt_probe client 10.213.7.1      # inside node 1: prints JSON
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time

from testbed.launch import base_env

PORT = 9123
ROUNDS = 200


def summary(rtts_ms: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile and maximum of round trips in ms.

    >>> summary([1.0, 2.0, 3.0, 4.0, 5.0])
    {'median_ms': 3.0, 'p10_ms': 1.0, 'p90_ms': 5.0, 'max_ms': 5.0, 'rounds': 5}
    """
    s = sorted(rtts_ms)
    return {"median_ms": round(statistics.median(s), 4), "p10_ms": round(s[len(s) // 10], 4),
            "p90_ms": round(s[min(len(s) - 1, len(s) * 9 // 10)], 4),
            "max_ms": round(s[-1], 4), "rounds": len(s)}


def serve(address: str) -> None:
    with socket.create_server((address, PORT), reuse_port=False) as srv:
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while conn.recv(1) == b"x":
                conn.sendall(b"y")


def client(address: str, rounds: int = ROUNDS) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((address, PORT), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    with conn:
        for _ in range(rounds):
            t = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"y":
                raise RuntimeError("rtt probe: the server went away")
            rtts.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.002)
        conn.sendall(b"q")
    return summary(rtts)


def rtt_ms(server_prefix: list[str], client_prefix: list[str], address: str,
           timeout_s: float = 60.0) -> dict[str, float]:
    """Run the probe: the server under ``server_prefix`` (for example ``ip netns exec NS``)
    listening on ``address``, the client under ``client_prefix``; the client's summary."""
    env = base_env()
    cmd = [sys.executable, "-m", "testbed.rtt_probe"]
    srv = subprocess.Popen([*server_prefix, *cmd, "server", address], env=env)
    try:
        out = subprocess.run([*client_prefix, *cmd, "client", address], capture_output=True,
                             text=True, timeout=timeout_s, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"rtt probe failed: {out.stderr.strip()[-1000:]}")
        return json.loads(out.stdout)
    finally:
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()


def main(argv: list[str] | None = None) -> int:
    role, address = (argv or sys.argv[1:])[:2]
    if role == "server":
        serve(address)
    else:
        print(json.dumps(client(address)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
