"""Faults on real processes: every rank ends, the culprit is named, nothing is left behind.

Each case is one launch of ``tests/scripts/fault_cases.py`` (see its docstring for the ``EVENT``
lines it prints). Times are printed (run with ``-s``) for ``docs/faults.md``, never asserted.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.launch import ROOT, base_env, free_port, launch_processes, torchrun_command

pytestmark = pytest.mark.multiprocess

SCRIPT = ROOT / "tests/scripts/fault_cases.py"


def parse_events(text: str) -> list[dict]:
    """Every ``EVENT {json}`` in ``text`` (lines of two ranks may share a line)."""
    decoder, out = json.JSONDecoder(), []
    for piece in text.split("EVENT ")[1:]:
        try:
            out.append(decoder.raw_decode(piece)[0])
        except json.JSONDecodeError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def run_case(tmp_path: Path, name: str, spec: dict, launcher: str, nprocs: int,
             timeout: float = 420, frozen: int | None = None) -> tuple[dict, list[int], str]:
    """Launch one case; return ``(events by (kind, rank), surviving rank pids, output)``.

    Ranks still alive 15 s after the launcher ended (besides ``frozen``) count as survivors
    (then killed).
    """
    out = tmp_path / name
    out.mkdir()
    path = out / "spec.json"
    path.write_text(json.dumps({**spec, "out": str(out), "devices": nprocs}))
    port = free_port()
    if launcher == "lightning":
        cmd = [sys.executable, str(SCRIPT), str(path)]
        env = base_env(MASTER_PORT=str(port))
    else:
        cmd = torchrun_command(SCRIPT, str(path), nprocs=nprocs, port=port)
        env = base_env()
    launched = launch_processes([(cmd, env)], timeout)
    text = launched.stdout
    (out / "output.txt").write_text(text)
    assert not launched.timed_out, text[-12000:]
    events: dict = {}
    for e in parse_events(text):
        events.setdefault((e["event"], e["rank"]), e)
    pids = {r: int((out / f"pid{r}").read_text()) for r in range(nprocs)
            if (out / f"pid{r}").exists()}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(
            _alive(p) for r, p in pids.items() if r != frozen):
        time.sleep(0.2)
    survivors = [r for r, p in pids.items() if r != frozen and _alive(p)]
    for p in pids.values():
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return events, survivors, text


def _exit_times(events: dict, fault_time: float, ranks) -> str:
    return ", ".join(f"rank {r} +{events[('exit', r)]['time'] - fault_time:.1f} s"
                     if ("exit", r) in events else f"rank {r} no exit event" for r in ranks)


EXIT_CASES = [
    # (name, strategy, launcher, fault kind, faulty rank)
    ("adpsgd-lightning-rank0-raises", "adpsgd", "lightning", "raise", 0),
    ("dpsgd-torchrun-rank1-raises", "dpsgd", "torchrun", "raise", 1),
    ("adpsgd-lightning-rank1-sigterm", "adpsgd", "lightning", "sigterm", 1),
    ("dpsgd-lightning-rank1-sigterm", "dpsgd", "lightning", "sigterm", 1),
    ("adpsgd-torchrun-ctrl-c", "adpsgd", "torchrun", "sigint_launcher", 0),
]


@pytest.mark.parametrize("name,strategy,launcher,kind,rank", EXIT_CASES,
                         ids=[c[0] for c in EXIT_CASES])
def test_clean_exit(tmp_path, name, strategy, launcher, kind, rank):
    """An exception, SIGTERM or Ctrl-C on one rank ends every rank, none left behind."""
    spec = {"strategy": strategy, "epochs": 1000, "samples": 64,
            "fault": {"kind": kind, "rank": rank, "step": 3}}
    events, survivors, text = run_case(tmp_path, name, spec, launcher, nprocs=2)
    assert ("fault", rank) in events, text[-8000:]
    assert not survivors, f"ranks {survivors} outlived the launcher:\n{text[-8000:]}"
    assert not any(k == "done" for k, _ in events), text[-8000:]
    other = 1 - rank
    if kind == "raise" and ("error", other) in events:
        # the other rank's error names the rank that failed
        assert f"{rank}" in events[("error", other)]["message"], events[("error", other)]
    print(f"\n{name}: after the fault " + _exit_times(events, events[("fault", rank)]["time"],
                                                     range(2)))


@pytest.mark.parametrize("strategy,launcher", [("adpsgd", "torchrun"), ("dpsgd", "lightning")])
def test_frozen_rank_is_named(tmp_path, strategy, launcher):
    """A rank frozen with SIGSTOP is named by every rank that waits on it, after about
    ``heartbeat_timeout``, far below ``timeout``."""
    hb = 5.0
    spec = {"strategy": strategy, "epochs": 1000, "samples": 64, "heartbeat_timeout": hb,
            "timeout": 600, "fault": {"kind": "freeze", "rank": 2, "step": 3}}
    events, survivors, text = run_case(tmp_path, f"freeze-{strategy}-{launcher}", spec,
                                       launcher, nprocs=3, frozen=2)
    assert not survivors, text[-8000:]
    fault = events[("fault", 2)]["time"]
    named = []
    for r in (0, 1):
        if ("error", r) not in events:
            continue  # killed by its launcher once another rank failed
        message = events[("error", r)]["message"]
        if "rank(s) 2" in message:
            named.append((r, events[("error", r)]["time"] - fault))
    assert named, text[-8000:]
    print(f"\nfrozen rank 2 ({strategy}, {launcher}) named with heartbeat_timeout {hb} s by: "
          + ", ".join(f"rank {r} after {s:.1f} s" for r, s in named))


def test_configuration_mismatch_fails_on_every_rank(tmp_path):
    spec = {"strategy": "dpsgd", "epochs": 1, "samples": 16, "mismatch_rank": 1}
    events, survivors, text = run_case(tmp_path, "mismatch", spec, "torchrun", nprocs=2)
    assert not survivors
    for r in (0, 1):
        message = events[("error", r)]["message"]
        assert "gossip configuration differs between ranks" in message, message
        assert "seed: 0 on rank(s) 0; 1 on rank(s) 1" in message, message


def test_max_time_with_a_slow_rank_keeps_asynchrony(tmp_path):
    """adpsgd + ``max_time`` + unequal batch counts + a slow rank: ends (no hang), and the fast
    rank takes more steps than the slow one (no per-batch collective forces lockstep)."""
    spec = {"strategy": "adpsgd", "epochs": 1000, "samples": 4003, "max_time": "00:00:00:20",
            "slow_rank": 1, "slow_s": 0.1}
    events, survivors, text = run_case(tmp_path, "max-time", spec, "lightning", nprocs=2)
    assert not survivors, text[-8000:]
    done = {r: events[("done", r)] for r in (0, 1) if ("done", r) in events}
    assert set(done) == {0, 1}, text[-8000:]
    assert done[0]["steps"] > done[1]["steps"], done
    print(f"\nmax_time 20 s: steps fast {done[0]['steps']} slow {done[1]['steps']}; "
          f"ended {done[0]['time'] - events[('start', 0)]['time']:.1f} s after start")


@pytest.mark.xfail(strict=False, reason=(
    "unconfirmed: with torchrun's static rendezvous the restarted round failed in gloo's "
    "connectFullMesh (stale addresses); the c10d-rendezvous variant had not finished when this "
    "was committed (docs/faults.md)"))
def test_killed_rank_restarts_from_last_checkpoint(tmp_path):
    """torchrun --max-restarts 2: a rank killed (SIGKILL) at a random step; every rank restarts
    from ``last.ckpt`` and the run ends with the planned epochs and the accuracy of an
    uninterrupted run (within noise)."""
    import random

    rng = random.Random(12)
    epochs, samples = 6, 256  # 32 steps per epoch on each of 2 ranks
    fault = {"kind": "sigkill", "rank": rng.randrange(2), "step": rng.randrange(40, 150),
             "restart": 0}
    results = {}
    for name, extra in (("uninterrupted", {}), ("killed", {"fault": fault})):
        spec = {"strategy": "dpsgd", "epochs": epochs, "samples": samples,
                "checkpoint_dir": str(tmp_path / name / "ckpt"), **extra}
        out = tmp_path / name
        out.mkdir()
        path = out / "spec.json"
        path.write_text(json.dumps({**spec, "out": str(out), "devices": 2}))
        # a c10d rendezvous: a fresh store per restart round (with the static one the restarted
        # ranks read the dead ranks' addresses: gloo "connection refused")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               "--max-restarts=2", str(SCRIPT), str(path)]
        launched = launch_processes([(cmd, base_env())], 600)
        text = launched.stdout
        assert not launched.timed_out and launched.returncode == 0, text[-8000:]
        done = [e for e in parse_events(text) if e["event"] == "done"]
        assert len(done) == 2, text[-8000:]
        results[name] = done
    for d in results["killed"]:
        # normally round 1; a second round when gloo's connect timed out under load
        assert d["restart"] >= 1 and d["epochs"] == epochs and d["start_epoch"] >= 1, d
    base = results["uninterrupted"][0]["val_acc"]
    killed = results["killed"][0]["val_acc"]
    assert abs(base - killed) <= 0.05, (base, killed)
    print(f"\nrestart: rank {fault['rank']} killed at step {fault['step']}; resumed from epoch "
          f"{results['killed'][0]['start_epoch']}; held-out accuracy {killed:.3f} "
          f"(uninterrupted {base:.3f})")
