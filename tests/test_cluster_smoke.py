"""Smoke test of the emulated cluster (``benchmarks/perf/cluster.py``): namespaces, links,
counters.

Needs root and iproute2 (network namespaces, veth, bridge, ``tc``); skips with the reason
elsewhere. Checks that a 2-node x 1-process cluster trains ``dpsgd`` and ``ddp``, that the link
counters moved as many bytes per step as the model's size implies, and that every namespace and
link the run made is gone afterwards. Timings are never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import cluster_net
from testbed.launch import ROOT, base_env

pytestmark = pytest.mark.multiprocess

#: this module's own name prefix: no benchmark's default (``lgc``, ``lgr``) nor another test's
#: (``trs``, ``tsj``, ``tsf``) is an extension of it or it of them, so no ``--cleanup`` of theirs
#: (nor this module's of its own) touches another run's namespaces
PREFIX = "tcs"


@pytest.fixture(scope="module")
def netns_available() -> None:
    reason = cluster_net.check_available(PREFIX)
    if reason:
        pytest.skip(f"emulated cluster unavailable here: {reason}")


def _gone(described: dict) -> list[str]:
    """Namespaces/links of the cluster ``described`` that still exist (should be none)."""
    prefix, suffix = described["prefix"], described["suffix"]
    return cluster_net.leftovers(f"{prefix}-{suffix}-") + cluster_net.leftovers(f"{prefix}{suffix}")


def test_links_carry_counted_bytes_and_cleanup(netns_available: None) -> None:
    """Bytes sent between two nodes show in the counters; close() removes everything."""
    cluster = cluster_net.EmulatedCluster(2, 100, prefix=PREFIX)
    with cluster:
        dst = cluster.members[1].address
        server = subprocess.Popen(
            [*cluster.exec_prefix(1), sys.executable, "-c",
             "import socket\n"
             f"s = socket.create_server(({dst!r}, 5001))\n"
             "c, _ = s.accept()\n"
             "n = 0\n"
             "while (d := c.recv(1 << 20)):\n"
             "    n += len(d)\n"
             "print(n)\n"],
            stdout=subprocess.PIPE, text=True)
        before = cluster.all_counters()
        payload = 2_000_000
        subprocess.run(
            [*cluster.exec_prefix(0), sys.executable, "-c",
             "import socket, time\n"
             "for _ in range(100):\n"
             "    try:\n"
             f"        s = socket.create_connection(({dst!r}, 5001)); break\n"
             "    except OSError:\n"
             "        time.sleep(0.1)\n"
             f"s.sendall(b'x' * {payload}); s.close()\n"],
            check=True, timeout=60)
        received = int(server.communicate(timeout=60)[0])
        after = cluster.all_counters()
        described = cluster.describe()
        # Nothing of the run is visible in this namespace: no link, no address.
        root_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True,
                                    timeout=30).stdout
        assert described["subnet"].rsplit(".", 1)[0] + "." not in root_addrs
        assert cluster_net.leftovers(f"{PREFIX}{cluster.suffix}") == []
    assert received == payload
    sent = after[0]["tx_bytes"] - before[0]["tx_bytes"]
    got = after[1]["rx_bytes"] - before[1]["rx_bytes"]
    assert payload <= sent <= 1.1 * payload
    assert payload <= got <= 1.1 * payload
    assert _gone(described) == []


def test_cleanup_on_exception(netns_available: None) -> None:
    """An exception inside ``with`` still removes the namespaces and links."""
    cluster = cluster_net.EmulatedCluster(2, 50, prefix=PREFIX)
    with pytest.raises(KeyError), cluster:
        assert len(cluster_net.leftovers(f"{PREFIX}-{cluster.suffix}-")) == 3
        raise KeyError("boom")
    assert _gone(cluster.describe()) == []


def test_cluster_dpsgd_and_ddp(netns_available: None, tmp_path: Path) -> None:
    """2 nodes x 1 process: both cases train; bytes per step match the model; nothing left."""
    out = tmp_path / "cluster.json"
    cmd = [sys.executable, "-m", "benchmarks.perf.cluster", "--nodes", "2", "--procs", "1",
           "--rate", "100", "--model-mb", "0.5", "--epochs", "1", "--max-steps", "6",
           "--cases", "dpsgd", "ddp", "--prefix", PREFIX, "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=480)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    report = json.loads(out.read_text())
    model_bytes = report["model_bytes"]
    cases = {c["case"]: c for c in report["cases"]}
    assert set(cases) == {"dpsgd", "ddp"}
    for name, case in cases.items():
        assert case["status"] == "ok", (name, case)
        assert case["steps_per_rank"] == [6, 6], (name, case["steps_per_rank"])
        # With 2 ranks every step crosses the link: dpsgd sends its replica to its one
        # neighbour, ddp's all-reduce sends about one model; headers add a few per cent.
        for k, sent in enumerate(case["tx_bytes_per_step_per_node"]):
            assert 0.9 * model_bytes <= sent <= 3.0 * model_bytes, (name, k, sent, model_bytes)
        for k, got in enumerate(case["rx_bytes_per_step_per_node"]):
            assert 0.9 * model_bytes <= got <= 3.0 * model_bytes, (name, k, got, model_bytes)
        assert 0.0 <= case["accuracy"] <= 1.0
        assert case["samples_per_s"] > 0 and case["epoch_s"] > 0
    assert _gone(report["cluster"]) == []


def test_cleanup_flag_removes_leftovers(netns_available: None) -> None:
    """``--cleanup`` removes namespaces left by a killed run (simulated: never closed)."""
    cluster = cluster_net.EmulatedCluster(1, 50, prefix=PREFIX).build()
    described = cluster.describe()
    try:
        out = subprocess.run([sys.executable, "-m", "benchmarks.perf.cluster",
                              "--cleanup", "--prefix", f"{PREFIX}-{cluster.suffix}"],
                             cwd=ROOT, env=base_env(), text=True, capture_output=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert described["bridge_netns"] in out.stdout
        assert _gone(described) == []
    finally:
        cluster.close()


def test_cleanup_leaves_a_longer_prefix_alone(netns_available: None) -> None:
    """``remove_leftovers(p)`` removes the clusters of prefix ``p``, not those of a prefix
    that extends it (another run's: ``lgr`` against ``lgr2``)."""
    mine = cluster_net.EmulatedCluster(1, 50, prefix=f"{PREFIX}a").build()
    other = cluster_net.EmulatedCluster(1, 50, prefix=f"{PREFIX}ab").build()
    try:
        removed = cluster_net.remove_leftovers(f"{PREFIX}a")
        assert sorted(removed) == sorted(f"netns {n}" for n in mine.created), removed
        assert _gone(mine.describe()) == []
        assert len(cluster_net.leftovers(f"{PREFIX}ab-{other.suffix}-")) == 2  # its node and bridge
    finally:
        other.close()
        mine.close()
    assert _gone(other.describe()) == []


def test_missing_options_are_reported_not_faked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A case whose option the strategies lack is "not available", never run without it."""
    from benchmarks.perf import cluster

    monkeypatch.setitem(cluster.CASES, "dpsgd_bogus", ("dpsgd", {"no_such_option": True}))
    reason = cluster.unavailable_reason("dpsgd_bogus")
    assert reason is not None and "not available in this version" in reason
    assert "'no_such_option'" in reason and "DPSGDStrategy" in reason
    assert cluster.unavailable_reason("ddp") is None
    assert cluster.unavailable_reason("adpsgd") is None


def test_link_latency_is_emulated_and_measured(netns_available: None) -> None:
    """A 5 ms one-way latency adds 10 ms to a round trip between two nodes (``netem``, or the
    calibrated ``NFQUEUE`` delay where the kernel has none), the cluster records what it
    measured, and its delay process ends with it."""
    problem = cluster_net.latency_problem(PREFIX)
    if problem:
        pytest.skip(f"no link latency can be emulated here: {problem}")
    cluster = cluster_net.EmulatedCluster(2, 100, prefix=PREFIX, latency_ms=5.0)
    with cluster:
        during = cluster.describe()
    check = cluster.describe()["latency_check"]
    assert check["via"] in ("netem", "nfqueue")
    added = (check["rtt"]["median_ms"] - check["rtt_without_delay"]["median_ms"]
             if check["via"] == "nfqueue" else check["rtt"]["median_ms"])
    assert 9.5 <= added <= 11.5, check
    if check["via"] == "nfqueue":
        assert during["link_delay"]["alive"] is True
        after = cluster.describe()["link_delay"]
        assert after["alive"] is False
        assert after["lateness"]["packets"] >= 2 * check["rtt"]["rounds"], after
    assert _gone(cluster.describe()) == []
