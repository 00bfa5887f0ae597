"""A race to a target accuracy on the emulated cluster: the strategies against DDP's peers.

Needs root (network namespaces, veth, ``tc``: ``testbed/cluster_net.py``); exits 2 with the
reason elsewhere.

One run builds K namespaces ("nodes") joined by ``--rate`` Mbit/s links, starts one ``torchrun``
per node (``benchmarks/race/worker.py``, gloo over the node's veth) and runs every case back to
back in the same processes (with ``--pin-nodes`` each node on CPUs of its own, ``taskset``,
so that one node's work or sleep does not change another's speed). Every case trains the
same MLP (about ``--model-mb`` MB) on scikit-learn's digits from the same seed, with the same
data order, through a Lightning ``Trainer``: the same loop for every case, only the strategy
and its communication differ.
Every ``--eval-every`` samples the exact average of the replicas (an all-reduce into a separate
copy; the replicas are not changed) is validated on the held-out 20 %; the clock stops during
validation and its link bytes are subtracted. Validations are points where all ranks meet;
``adpsgd`` cases, whose ranks meet only at epoch ends, are validated at epoch ends only.

With ``--target`` (and ``--budget`` or ``--max-samples``) every case, ``ddp`` included, races
to that fixed target in the order given (``benchmarks/race/campaign.py`` rotates it between
runs). Without it ``ddp`` runs first, for ``--epochs`` epochs; the target is its final metric
0.5 points easier and every other case's budget is 3x its time (or ``--budget``). A case stops
at the first validation at or beyond the target, or when its budget is spent.

The race rules (docs/races.md, "Race rules"; ``benchmarks/rules.py``) the race
enforces itself: every case trains at ``--lr`` times the per-learner rule's factor
(``rules.case_lr``: sqrt(learners) under Adam for every method that runs one optimizer per
learner between averages), or at its tuned peak (``--case-peak``), and records it; link latency
is emulated (``--latency-ms``, default 0.5 ms one way: ``tc netem``, or where the kernel has none
``testbed/link_delay.py``; the record keeps the round trip measured on the cluster; where
neither works the race refuses unless ``--latency-ms 0`` is given, and such a record says so); the
race refuses to start above ``--max-load`` (the machine must be idle) and records the load,
the CPU time other processes took during the run (``foreign_cpu_fraction``), the commit and
the machine; a slow node gets one fixed handicap (``--slow-extra-s``) and every case records its
achieved slowdown. ``on_case`` (for the campaign) sees each case's result as soon as it is
written, so a stopped run loses at most the case in progress.

Cases: ``ddp`` (Lightning ``DDPStrategy``), ``ddp_bf16`` (plus torch's ``bf16_compress_hook``),
``postlocal4`` (torch's post-local SGD: ``post_localSGD_hook`` with an explicit per-node
``subgroup`` and a ``PeriodicModelAverager`` of period 4 after ``--warmup`` steps), ``dpsgd``,
``adpsgd``, ``adpsgd_bf16``, ``dpsgd_hier_bf16``, ``adpsgd_hier_bf16`` (the library's strategies),
``torchft_localsgd`` and ``torchft_diloco`` (torchft's LocalSGD and DiLoCo, sync every 16 steps,
one replica group per node, the lighthouse in node 0: ``benchmarks/race/torchft_cases.py``; they
need the optional ``race`` extra, ``uv pip install -c constraints.txt -e '.[race]'``, and are
skipped with a message when torchft is not importable). Lightning
registers DDP communication hooks only on CUDA (silently skipped on CPU), so the race registers
them itself on the wrapped model before the first backward, and checks in the link bytes that
they ran (``hook_check``: bf16 about half of ddp's bytes per step, post-local SGD about
1/period after its warm-up).

Per case the JSON has ``name``, ``time_to_target_s`` (null when not reached),
``metric_at_ddp_time``, ``final_metric``, ``bytes_per_step_inter_node`` (bytes a node sent on
its link per optimizer step: all nodes' bytes over all nodes' steps), ``curve`` (``[seconds,
accuracy %]``), ``seed`` and ``comm_compute``; at the top ``target``, ``workload``, ``nodes``,
``procs``, ``rate_mbit``, the machine's load, ``seed`` (``--seed``: initialisation, data order,
PowerSGD's projections, the same for every case), ``comm_compute_ratio`` (R: a bf16 replica's
one-way time on the emulated link over the lockstep compute step, measured before the cases:
``benchmarks/race/comm_compute.py``) with its terms in ``comm_compute``, ``link`` (the delay
method and the round trip measured on the built cluster) and ``pin_nodes``.

More cases (issue 47; raced when named in ``--cases``): ddp's bucket sizes (``ddp_b1``,
``ddp_b4``), the periodic averagers at periods 4, 16 and 64 (``postlocal*``,
``torchft_localsgd*``), DiLoCo's grid of periods and outer optimizers with its identity point
and a lower inner rate (``torchft_diloco{4,16,64}_o{10m0,7m9,8m5}``), Decent-DP (``decentdp``,
``decentdp_ring``: ``benchmarks/race/decentdp_case.py``, in the ``race`` extra) and the
library's ``gossip_every_n_steps`` (``*_hier_bf16_p4``, ``_p16``; skipped with a message where
the library does not take the option yet), and the period the library picks itself
(``*_hier_bf16_pauto``: ``gossip_every_n_steps="auto"``; each run records the periods it chose
with their measurements, ``auto_period``). A case with ``tune_as`` is a variant of that case.

Usage::

    sudo python -m benchmarks.race --nodes 2 --procs 2 --rate 200 --png race.png
    sudo python -m benchmarks.race --quick --cases ddp ddp_bf16 postlocal4 dpsgd
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common.mlp_size import hidden_width
from benchmarks.race import decentdp_case, rules, torchft_cases
from benchmarks.race.report import markdown_table, per_sample_table, plot
from testbed import cluster_net

ROOT = Path(__file__).resolve().parents[2]
WORKER = "benchmarks.race.worker"
PREFIX = "lgr"
"""Name prefix of the race's namespaces and links (not cluster.py's)."""

DILOCO_PEAKS = {"asr": (1.5e-3, 3e-3, 6e-3)}
"""DiLoCo grid's inner peak rates (before the rule): one below ddp's, as its paper's inner rates
are lower than a synchronous method's."""

CASES: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "ddp_bf16": {"kind": "ddp_bf16"},
    "ddp_powersgd2": {"kind": "ddp_powersgd", "rank": 2, "tune_as": "ddp_powersgd4"},
    "ddp_powersgd4": {"kind": "ddp_powersgd", "rank": 4},
    # ddp's bucket size, a tuned option (the default 25 MB holds the 9.8 MB model in one bucket
    # after DDP's 1 MB first one)
    "ddp_b1": {"kind": "ddp", "bucket_cap_mb": 1.0, "tune_as": "ddp"},
    "ddp_b4": {"kind": "ddp", "bucket_cap_mb": 4.0, "tune_as": "ddp"},
    # the periodic averagers at the periods {4, 16, 64}; the names without a period are 16
    "postlocal16": {"kind": "postlocal", "period": 16},
    **{f"postlocal{p}": {"kind": "postlocal", "period": p, "tune_as": "postlocal16"}
       for p in (4, 64)},
    "torchft_localsgd": {"kind": "torchft_localsgd", "period": 16},
    **{f"torchft_localsgd{p}": {"kind": "torchft_localsgd", "period": p,
                                "tune_as": "torchft_localsgd"} for p in (4, 64)},
    "torchft_diloco": {"kind": "torchft_diloco", "period": 16},
    # DiLoCo's grid: periods x outer SGD (lr, momentum; Nesterov where the momentum is not 0):
    # the identity point (1.0, 0: LocalSGD), the paper's (0.7, 0.9), a milder (0.8, 0.5); its
    # inner rates reach one below ddp's (DILOCO_PEAKS)
    **{f"torchft_diloco{p}_o{round(lr * 10)}m{round(m * 10)}": {
        "kind": "torchft_diloco", "period": p, "outer_lr": lr, "outer_momentum": m,
        "peaks": DILOCO_PEAKS,
        **({} if (p, lr) == (16, 0.7) else {"tune_as": "torchft_diloco16_o7m9"})}
       for p in (4, 16, 64) for lr, m in ((1.0, 0.0), (0.7, 0.9), (0.8, 0.5))},
    # Decent-DP (benchmarks/race/decentdp_case.py): its recommended multi-node topology, and its
    # one-peer ring
    "decentdp": {"kind": "decentdp", "topology": "alternating-exp-ring"},
    "decentdp_ring": {"kind": "decentdp", "topology": "ring", "tune_as": "decentdp"},
    "dpsgd": {"kind": "gossip", "strategy": "dpsgd", "kwargs": {}},
    "adpsgd": {"kind": "gossip", "strategy": "adpsgd", "kwargs": {}},
    "adpsgd_bf16": {"kind": "gossip", "strategy": "adpsgd", "kwargs": {"wire_dtype": "bf16"}},
    "dpsgd_hier_bf16": {"kind": "gossip", "strategy": "dpsgd",
                        "kwargs": {"hierarchical": True, "wire_dtype": "bf16"}},
    "adpsgd_hier_bf16": {"kind": "gossip", "strategy": "adpsgd",
                         "kwargs": {"hierarchical": True, "wire_dtype": "bf16"}},
    # the communication budget (issue 47): local steps between exchanges; period 1 is the
    # cases above (the option is passed only where it is not 1: worker.library_kwargs)
    **{f"{s}_hier_bf16_p{p}": {"kind": "gossip", "strategy": s, "kwargs": {
        "hierarchical": True, "wire_dtype": "bf16", "gossip_every_n_steps": p},
        "tune_as": f"{s}_hier_bf16"}
       for s in ("dpsgd", "adpsgd") for p in (4, 16)},
    # gossip_every_n_steps="auto" (issue 47, deliverable 2): the strategy picks the period from
    # its first steps' compute and exchange times (the worker records each run's decisions).
    # Its family's base gives its peak; for the narrowing it is a family of its own, so that
    # every run races it next to its family's fastest fixed period (the goal compares them)
    **{f"{s}_hier_bf16_pauto": {"kind": "gossip", "strategy": s, "kwargs": {
        "hierarchical": True, "wire_dtype": "bf16", "gossip_every_n_steps": "auto"},
        "tune_as": f"{s}_hier_bf16", "narrow_as": f"{s}_hier_bf16_pauto"}
       for s in ("dpsgd", "adpsgd")},
    # Remedies (issue 29, deliverable 4; the library options of the remedies work, which these
    # cases need): the node all-reduce overlapped with backward, and an outer optimizer (DiLoCo's
    # outer settings, as the torchft_diloco peer's) on a global average every 16 steps, with
    # the plain average every 16 steps as its control. More go here, as gossip cases with the
    # option in "kwargs" (the per-learner rule applies by "kind" and "hierarchical").
    **{f"{s}_hier_bf16_{tag}": {"kind": "gossip", "strategy": s,
                                "kwargs": {"hierarchical": True, "wire_dtype": "bf16", **kw}}
       for s in ("dpsgd", "adpsgd") for tag, kw in (
           ("overlap", {"node_allreduce": "overlapped"}),
           ("avg16", {"global_average_every_n_steps": 16}),
           ("outer16", {"global_average_every_n_steps": 16, "outer_lr": 0.7,
                        "outer_momentum": 0.9, "outer_nesterov": True}))},
    # the slow node leaves an epoch's last batches to the fast one (the slow-node race's
    # remedy for the fast node's wait at the epoch ends)
    "adpsgd_hier_bf16_balanced": {"kind": "gossip", "strategy": "adpsgd", "kwargs": {
        "hierarchical": True, "wire_dtype": "bf16", "shared_cursor": "balanced"}},
}
"""Case name -> what the worker runs. ``tune_as``: the case is a variant (an option other than
the peak rate) of that case, its family's base: it takes the base's tuned peak
(``campaign.tune``), and a race may keep only the fastest variant of each family after its
first run (``campaign --narrow-after``); ``narrow_as``: the family it is narrowed in, where
that is not its ``tune_as`` base (the ``"auto"`` cases: their own)."""


def family(name: str) -> str:
    """The family of case ``name``: its ``tune_as`` base, or itself.

    >>> family("postlocal64"), family("postlocal16"), family("dpsgd_hier_bf16_p4")
    ('postlocal16', 'postlocal16', 'dpsgd_hier_bf16')
    """
    return CASES[name].get("tune_as", name)


def narrowing_family(name: str) -> str:
    """The family case ``name`` is narrowed in (``campaign --narrow-after`` keeps each such
    family's fastest case): its ``narrow_as``, else its :func:`family`.

    >>> narrowing_family("dpsgd_hier_bf16_p4"), narrowing_family("dpsgd_hier_bf16_pauto")
    ('dpsgd_hier_bf16', 'dpsgd_hier_bf16_pauto')
    >>> family("dpsgd_hier_bf16_pauto")
    'dpsgd_hier_bf16'
    """
    return CASES[name].get("narrow_as", family(name))


def auto_case(name: str) -> bool:
    """Whether case ``name`` lets the library pick its gossip period
    (``gossip_every_n_steps="auto"``).

    >>> auto_case("adpsgd_hier_bf16_pauto"), auto_case("adpsgd_hier_bf16_p4")
    (True, False)
    """
    return (CASES[name].get("kwargs") or {}).get("gossip_every_n_steps") == "auto"

REMEDIES = tuple(c for c in CASES if c.endswith(rules.REMEDY_SUFFIXES))
"""The remedies' cases: raced only when asked for (``--cases``)."""

DEFAULT_CASES = ("ddp", "ddp_bf16", "ddp_powersgd2", "ddp_powersgd4", "postlocal4", "postlocal16",
                 "torchft_localsgd", "torchft_diloco", "dpsgd", "adpsgd", "adpsgd_bf16",
                 "dpsgd_hier_bf16", "adpsgd_hier_bf16")
"""The cases of a race without ``--cases`` (the grids of issue 47 are raced when named)."""

PEERS = tuple(c for c in CASES if c != "ddp" and CASES[c]["kind"] != "gossip")
"""The cases a Lightning user would try instead of the library (besides plain ddp)."""

WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"batch_size": 16, "lr": 0.05, "eval_every": 256, "epochs": 6, "warmup": 20},
    "asr": {"batch_size": 4, "lr": 3e-3, "eval_every": 320, "epochs": 1.2, "warmup": 20},
}
"""Per workload: per-rank batch, learning rate, validation interval, ddp's epochs, warm-up."""

ASR_CORPUS = ROOT / "data" / "asr-race"
"""Where the asr workload's corpus is generated (cached; ``recipes.asr.synth``)."""

HOOK_RATIO_TOLERANCE = 0.25
"""``hook_check`` passes when bytes/step over ddp's is within this (relative) of the expected."""


def _progress(msg: str) -> None:
    print(f"[race {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _worker_env(iface: str) -> dict[str, str]:
    """The ranks' environment (as cluster.py's): one thread, gloo on the node's link."""
    return cluster_net.worker_env(iface, str(ROOT))


def machine() -> dict[str, Any]:
    """Load average, cores, host, kernel and CPU model now (wall times are inflated on a loaded
    machine, and differ between machines)."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return {"loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "host": os.uname().nodename, "kernel": os.uname().release, "cpu_model": model}


def commit() -> dict[str, Any]:
    """The code's commit, the tracked paths that differ from it (``changes``) and whether any
    of them is code (``dirty``: outside ``benchmarks/results/``, where the race writes its own
    record; a race is redone from its commit)."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
        return out.stdout if out.returncode == 0 else ""

    status = git("status", "--porcelain", "--untracked-files=no")
    changes = [line[3:].split(" -> ")[-1] for line in status.splitlines() if line.strip()]
    return {"sha": git("rev-parse", "HEAD").strip() or None,
            "dirty": rules.code_changed(changes), "changes": changes}


def cpu_snapshot() -> tuple[int, float]:
    """(busy jiffies of the whole machine, this process's and its reaped children's CPU s)."""
    busy, _ = rules.busy_jiffies(Path("/proc/stat").read_text().splitlines()[0])
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


def node_cpus(nodes: int, cpus: list[int]) -> list[list[int]]:
    """``--pin-nodes``: the CPUs each node's processes may run on. With at least as many CPUs
    as nodes the nodes get disjoint shares (the first ones one CPU more where the count does not
    divide), so one node's work cannot slow another's; with fewer, node ``k`` runs on CPU
    ``cpus[k % len(cpus)]`` and shares it with the other nodes there.

    >>> node_cpus(2, [0, 1])
    [[0], [1]]
    >>> node_cpus(2, [0, 1, 2, 3, 4])
    [[0, 1, 2], [3, 4]]
    >>> node_cpus(4, [0, 1])
    [[0], [1], [0], [1]]
    """
    if not cpus or nodes < 1:
        raise ValueError(f"node_cpus needs nodes >= 1 and some CPUs, got {nodes} and {cpus}")
    if nodes > len(cpus):
        return [[cpus[k % len(cpus)]] for k in range(nodes)]
    share, extra = divmod(len(cpus), nodes)
    starts = [k * share + min(k, extra) for k in range(nodes + 1)]
    return [cpus[starts[k]:starts[k + 1]] for k in range(nodes)]


def pin_prefix(cpus: list[int] | None) -> list[str]:
    """Command prefix that keeps a program (and its children) on ``cpus`` (None: anywhere)."""
    return [] if cpus is None else ["taskset", "-c", ",".join(str(c) for c in cpus)]


def launch(cluster: cluster_net.EmulatedCluster, spec: dict[str, Any], workdir: Path,
           timeout_s: float, on_case: Callable[[dict[str, Any]], None] | None = None
           ) -> tuple[list[dict[str, Any]], str]:
    """Run the spec's cases in one torchrun per node (on its CPUs, ``spec['node_cpus']``,
    where set); (the cases' results, status detail). ``on_case`` gets each case's result as
    soon as the ranks wrote it."""
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    logs = [workdir / f"node{k}.log" for k in range(cluster.nodes)]
    procs: list[subprocess.Popen] = []
    names = [c["name"] for c in spec["cases"]]
    detail = "ok"
    pinned = spec.get("node_cpus")
    try:
        for k, member in enumerate(cluster.members):
            cmd = [*cluster.exec_prefix(k), *pin_prefix(pinned[k] if pinned else None),
                   sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={cluster.nodes}", f"--node-rank={k}",
                   f"--nproc-per-node={spec['procs']}",
                   f"--master-addr={cluster.members[0].address}", "--master-port=29400",
                   "-m", WORKER, str(spec_path)]
            with open(logs[k], "w") as log:
                procs.append(subprocess.Popen(cmd, env=_worker_env(member.iface), cwd=ROOT,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            while seen < len(names) and (workdir / names[seen] / "result.json").exists():
                _progress(f"  {names[seen]} done")
                if on_case is not None:
                    on_case(json.loads((workdir / names[seen] / "result.json").read_text()))
                seen += 1
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                if any(codes) or seen < len(names):
                    detail = f"ranks exited with {codes} after {seen} of {len(names)} cases"
                break
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                detail = f"failed or timed out (exit codes {codes}); killed"
                break
            time.sleep(0.5)
    finally:
        cluster.end_launch(procs)
    if detail != "ok":
        for k, path in enumerate(logs):
            _progress(f"node{k} log tail:\n{path.read_text(errors='replace')[-2500:]}")
    results = [json.loads((workdir / n / "result.json").read_text()) for n in names
               if (workdir / n / "result.json").exists()]
    return results, detail


def metric_at(curve: list[list[float]], seconds: float) -> float | None:
    """The last validation at or before ``seconds`` (None before the first).

    >>> metric_at([[0, 10.0], [5, 50.0], [9, 80.0]], 6)
    50.0
    """
    before = [m for s, m in curve if s <= seconds + 1e-9]
    return before[-1] if before else None


def time_to(curve: list[list[float]], target: float, higher_is_better: bool = True
            ) -> float | None:
    """Seconds of the first validation at or beyond ``target`` (None when never reached).

    >>> time_to([[0, 10.0], [5, 50.0], [9, 80.0]], 45)
    5
    >>> time_to([[0, 100.0], [5, 60.0], [9, 30.0]], 40, higher_is_better=False)
    9
    """
    sign = 1.0 if higher_is_better else -1.0
    return next((s for s, m in curve if sign * (m - target) >= 0), None)


def samples_to(res: dict[str, Any], higher_is_better: bool = True) -> int | None:
    """Samples (all ranks) at the first validation at or beyond the case's target.

    >>> samples_to({"target": 40.0, "curve": [[0, 100.0], [5, 60.0], [9, 30.0]],
    ...             "curve_samples": [0, 160, 320]}, higher_is_better=False)
    320
    """
    if res.get("target") is None or not res.get("curve_samples"):
        return None
    sign = 1.0 if higher_is_better else -1.0
    return next((n for (_, m), n in zip(res["curve"], res["curve_samples"])
                 if sign * (m - res["target"]) >= 0), None)


def ratios(results: list[dict[str, Any]]) -> None:
    """Add ``time_ratio_vs_ddp`` and ``time_ratio_vs_best_peer`` (time to target over theirs)."""
    times = {r["name"]: r["time_to_target_s"] for r in results}
    ddp = times.get("ddp")
    peers = [times[p] for p in PEERS if times.get(p) is not None]
    best = min(peers) if peers else None
    for r in results:
        t = r["time_to_target_s"]
        r["time_ratio_vs_ddp"] = None if t is None or not ddp else round(t / ddp, 3)
        r["time_ratio_vs_best_peer"] = None if t is None or not best else round(t / best, 3)


def postlocal_ratio(steps: int, warmup: int, period: int) -> float:
    """Global averages per step after the warm-up, as ``PeriodicModelAverager`` makes them.

    It averages at its calls ``k >= warmup`` with ``(k - warmup) % period == 0`` (``k`` from
    0, one call per step): ``ceil((steps - warmup) / period)`` of the ``steps - warmup``.

    >>> postlocal_ratio(30, 8, 16), postlocal_ratio(116, 20, 16)
    (0.09090909090909091, 0.0625)
    """
    after = steps - warmup
    return -(-after // period) / after if after > 0 else 0.0


def hook_check(res: dict[str, Any], ddp: dict[str, Any] | None,
               warmup: int = 0) -> dict[str, Any] | None:
    """Bytes per step against ddp's, for the cases whose DDP hook the race registered.

    bf16 and torchft: over the whole run; PowerSGD and post-local SGD: after their ``warmup``
    steps of plain all-reduce. The expected ratio comes from the worker
    (``hooks.expected_ratio``, ``torchft_cases.expected_ratio`` of its steps); post-local
    SGD's is that of the averages really made in the run's steps. A hook that did
    not run would send ddp's bytes (ratio 1).
    """
    expected = res.get("expected_hook_ratio")
    if expected is None or ddp is None:
        return None
    if res["kind"] == "postlocal":
        expected = postlocal_ratio(res["steps"], warmup, int(res["period"]))
    base = ddp["bytes_per_step_inter_node"]
    if res["kind"] == "ddp_bf16":
        measured = res["bytes_per_step_inter_node"]
        what = "bytes/step over ddp's (bf16 hook halves the all-reduce)"
    elif res["kind"] in decentdp_case.KINDS:
        measured = res["bytes_per_step_inter_node"]
        what = ("bytes/step over ddp's (Decent-DP: its topology's fp32 averages; "
                "decentdp_case.expected_ratio)")
    elif res["kind"] in torchft_cases.KINDS:
        measured = res["bytes_per_step_inter_node"]
        what = ("bytes/step over ddp's (torchft: every local rank averages the model with its "
                "peers on the other nodes every period steps; torchft_cases.expected_ratio)")
    else:
        measured = res["bytes_per_step_after_warmup"]
        what = ("bytes/step after warm-up over ddp's (" + (
            "one global average every period steps)" if res["kind"] == "postlocal"
            else "PowerSGD: rank x (rows + cols) per compressed matrix)"))
    if not base or measured is None:
        return {"what": what, "expected_ratio": expected, "measured_ratio": None, "ok": False}
    ratio = measured / base
    if res["kind"] == "ddp_powersgd":
        # PowerSGD at rank 2-4 sends a few % of ddp's numbers; gloo's per-message overhead
        # (3 all-reduces per bucket) is then a large part of the bytes: it ran if the bytes
        # are far below ddp's and not below what its numbers need
        ok = (1 - HOOK_RATIO_TOLERANCE) * expected <= ratio <= 0.25
    else:
        ok = abs(ratio - expected) <= HOOK_RATIO_TOLERANCE * expected
    return {"what": what, "expected_ratio": round(expected, 4),
            "measured_ratio": round(ratio, 4), "ok": ok}


def summarise(results: list[dict[str, Any]], higher_is_better: bool = True,
              warmup: int = 0) -> list[dict[str, Any]]:
    """Add ``time_to_target_s``, ratios, ``metric_at_ddp_time``, ``hook_check`` to every case."""
    ddp = next((r for r in results if r["name"] == "ddp"), None)
    for r in results:
        r["time_to_target_s"] = (time_to(r["curve"], r["target"], higher_is_better)
                                 if r["target"] is not None else None)
        r["samples_to_target"] = samples_to(r, higher_is_better)
        # the curve's own (rounded) seconds: ddp's last point is at ddp's time exactly
        r["metric_at_ddp_time"] = metric_at(r["curve"], ddp["curve"][-1][0]) if ddp else None
        check = hook_check(r, ddp, warmup)
        if check is not None:
            r["hook_check"] = check
    ratios(results)
    return results


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """What is trained and how (defaults per workload: ``WORKLOAD_DEFAULTS``)."""
    p.add_argument("--workload", default="digits", choices=list(WORKLOAD_DEFAULTS),
                   help="digits: an MLP on scikit-learn's digits (accuracy); asr: the ASR "
                        "recipe's BLSTM-CTC on the synthetic corpus (dev WER)")
    p.add_argument("--model-mb", type=float, default=4.0, help="digits: MLP fp32 size, MB")
    p.add_argument("--asr-layers", type=int, default=2, help="asr: BLSTM layers")
    p.add_argument("--asr-hidden", type=int, default=256, help="asr: units per direction")
    p.add_argument("--asr-frame-stacking", type=int, default=4, help="asr: frames stacked")
    p.add_argument("--asr-train", type=int, default=1600, help="asr: training utterances")
    p.add_argument("--asr-dev", type=int, default=128, help="asr: held-out (dev) utterances")
    p.add_argument("--asr-corpus", type=Path, default=ASR_CORPUS, help="asr: corpus dir")
    p.add_argument("--anneal-after", type=float, default=None, metavar="PASSES",
                   help="asr: after this many passes over the training set the learning rate "
                        "decays by --anneal-per-pass per pass (smoothly, per validation chunk); "
                        "the same schedule in samples for every case (default: none)")
    p.add_argument("--anneal-per-pass", type=float, default=0.5, help="see --anneal-after")
    p.add_argument("--epochs", type=float, default=None,
                   help="ddp's epochs (passes over the training set; a fraction is fine), "
                        "sets target/budget (digits 6, asr 1.2)")
    p.add_argument("--batch-size", type=int, default=None, help="per-rank batch (16 / 4)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak rate before the per-learner rule (--lr-rule): digits SGD "
                        "momentum 0.9 (0.05); asr AdamW (3e-3)")
    p.add_argument("--lr-rule", default="all", choices=["all", "none"],
                   help="all: every case whose learners run an optimizer each between "
                        "averages gets --lr x sqrt(learners) (Adam), the same rule for every "
                        "method (rules.case_lr); none: --lr for every case")
    p.add_argument("--case-peak", nargs="+", default=[], metavar="CASE=PEAK",
                   help="a case's tuned peak rate (before the rule), e.g. ddp=6e-3")
    p.add_argument("--eval-every", type=int, default=None,
                   help="validate every N samples of all ranks (256 / 320)")
    p.add_argument("--warmup", type=int, default=None,
                   help="PowerSGD/post-local SGD warm-up, steps of plain all-reduce (20)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the race."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_workload_args(p)
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (namespaces)")
    p.add_argument("--procs", type=int, default=2, help="processes (ranks) per node")
    p.add_argument("--rate", type=float, default=200.0, help="link rate, Mbit/s, each way")
    p.add_argument("--latency-ms", type=float, default=rules.DATA_CENTRE["latency_ms"],
                   help="one-way link delay (tc netem or testbed/link_delay.py); 0: none (the "
                        "record says so, and no claim is made from it)")
    p.add_argument("--slow-node", type=int, default=None, metavar="K",
                   help="node K slower: its ranks sleep --slow-extra-s after every step")
    p.add_argument("--slow-extra-s", type=float, default=None, metavar="S",
                   help="with --slow-node: the fixed handicap, seconds of sleep per step, the "
                        "same for every case (default: the slow node's local step, calibrated "
                        "once before the first case, about 2x slower)")
    p.add_argument("--pin-nodes", action="store_true",
                   help="run each node on CPUs of its own (taskset; nodes share CPUs only when "
                        "there are more nodes than CPUs), so that one node's compute, or its "
                        "sleep, does not change another node's speed")
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                   choices=list(CASES), metavar="CASE",
                   help=f"cases (default: {' '.join(DEFAULT_CASES)}); any of "
                        f"{', '.join(CASES)}")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of every case (initialisation, data order, PowerSGD's "
                        "projections); the campaign gives run k rules.run_seed(k)")
    p.add_argument("--no-comm-compute", dest="comm_compute", action="store_false",
                   help="skip the measurement of R (a bf16 replica's time on the link over "
                        "the compute step) before the cases")
    p.add_argument("--target", type=float, default=None,
                   help="target metric, %% (default: ddp's final, 0.5 points easier)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per case (default: --budget-factor x ddp's time)")
    p.add_argument("--budget-factor", type=float, default=3.0, help="see --budget")
    p.add_argument("--max-steps", type=int, default=0, help="cap per case (0: none)")
    p.add_argument("--max-samples", type=int, default=0,
                   help="cap per case in samples of all ranks (0: none); a budget that does "
                        "not depend on the machine's speed")
    p.add_argument("--max-load", type=float, default=rules.DEFAULT_MAX_LOAD,
                   help="refuse to start above this 1-minute load average")
    p.add_argument("--allow-load", action="store_true",
                   help="start above --max-load anyway (warned; the record says loaded)")
    p.add_argument("--quick", action="store_true",
                   help="tiny run: digits 0.25 MB model / asr 1x64, 1 ddp epoch, <= 30 steps")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole race")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--png", type=Path, default=None,
                   help="write the figure here (default: --json's path with .png, else "
                        "race_<workload>_<nodes>x<procs>_<rate>mbit.png in the temp dir)")
    p.add_argument("--prefix", default=PREFIX, help="name prefix of namespaces and links")
    p.add_argument("--keep-logs", action="store_true", help="keep the ranks' logs")
    args = p.parse_args(argv)
    for key, value in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.model_mb, args.epochs = 0.25, 1
        args.asr_layers, args.asr_hidden, args.asr_train, args.asr_dev = 1, 64, 256, 32
        args.max_steps = args.max_steps or 30
    fixed = args.target is not None and (args.budget is not None or args.max_samples > 0)
    if "ddp" not in args.cases and not fixed:
        p.error("without the ddp case, --target and --budget (or --max-samples) are needed")
    if args.slow_extra_s is not None and args.slow_node is None:
        p.error("--slow-extra-s needs --slow-node")
    try:
        args.case_peaks = {c: float(v) for c, v in (x.split("=", 1) for x in args.case_peak)}
    except ValueError:
        p.error(f"--case-peak takes CASE=PEAK pairs, got {args.case_peak}")
    if set(args.case_peaks) - set(CASES):
        p.error(f"--case-peak: unknown cases {sorted(set(args.case_peaks) - set(CASES))}")
    if args.pin_nodes and shutil.which("taskset") is None:
        p.error("--pin-nodes needs taskset (util-linux), which is not installed")
    if args.slow_node is not None and not 0 <= args.slow_node < args.nodes:
        p.error(f"--slow-node must be a node index, 0..{args.nodes - 1}")
    if not fixed:  # ddp sets the target: it runs first
        args.cases = ["ddp"] * ("ddp" in args.cases) + [c for c in args.cases if c != "ddp"]
    args.width = hidden_width(args.model_mb)
    if args.png is None:
        tag = f"race_{args.workload}_{args.nodes}x{args.procs}_{args.rate:g}mbit"
        args.png = (args.json.with_suffix(".png") if args.json is not None
                    else Path(tempfile.gettempdir()) / f"{tag}.png")
    return args


def case_lrs(args: argparse.Namespace) -> dict[str, float]:
    """Every case's peak rate: its tuned peak (``--case-peak``, else ``--lr``) times the
    per-learner rule's factor (``--lr-rule all``), the same procedure for every case."""
    optimizer = rules.OPTIMIZER[args.workload]
    out = {}
    for c in args.cases:
        peak = args.case_peaks.get(c, args.lr)
        out[c] = (rules.case_lr(CASES[c], peak, args.nodes, args.procs, optimizer)
                  if args.lr_rule == "all" else float(peak))
    return out


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every rank reads: cases (with their rates), sizes, target/budget (None: set by
    ddp), slack, handicap."""
    lrs = case_lrs(args)
    caps = getattr(args, "case_max_samples", None) or {}  # the campaign's tuning caps
    return {
        "cases": [{"name": c, "index": i, "lr": lrs[c], **CASES[c],
                   **({"max_samples": caps[c]} if caps.get(c) else {})}
                  for i, c in enumerate(args.cases)],
        "nodes": args.nodes,
        "procs": args.procs, "width": args.width, "epochs": args.epochs,
        "workload": args.workload, "slow_node": args.slow_node,
        "asr": {"corpus": str(args.asr_corpus), "layers": args.asr_layers,
                "hidden": args.asr_hidden, "frame_stacking": args.asr_frame_stacking,
                "spec_augment": False, "warmup_steps": 20,
                "anneal_after_passes": args.anneal_after,
                "anneal_per_pass": args.anneal_per_pass},
        "batch_size": args.batch_size, "lr": args.lr, "eval_every": args.eval_every,
        "seed": int(getattr(args, "seed", 0)),
        "measure_comm_compute": bool(getattr(args, "comm_compute", True)),
        "slow_extra_s": args.slow_extra_s, "max_samples": args.max_samples,
        "slow_calibration": getattr(args, "slow_calibration", None),
        "warmup": args.warmup, "max_steps": args.max_steps, "target": args.target,
        "budget_s": args.budget, "slack": 0.5, "budget_factor": args.budget_factor,
        "pg_timeout_s": 300.0,
        "node_cpus": (node_cpus(args.nodes, sorted(os.sched_getaffinity(0)))
                      if args.pin_nodes else None),
    }


def model_description(args: argparse.Namespace) -> str:
    """What is trained, in words."""
    if args.workload == "asr":
        return (f"recipes.asr SpeechRecognizer: BLSTM {args.asr_layers}x{args.asr_hidden} per "
                f"direction, frame stacking {args.asr_frame_stacking}, CTC, AdamW (the race's "
                f"per-learner lr rule), no SpecAugment; synthetic corpus {args.asr_train} train / "
                f"{args.asr_dev} dev utterances")
    return f"MLP 64-{args.width}-{args.width}-10, SGD momentum 0.9; scikit-learn digits"


def prepare_corpus(args: argparse.Namespace) -> None:
    """asr: generate (or reuse, cached by its settings) the synthetic corpus."""
    if args.workload != "asr":
        return
    from recipes.asr.synth import CorpusConfig, generate_corpus

    if args.quick and args.asr_corpus == ASR_CORPUS:
        args.asr_corpus = ASR_CORPUS.with_name("asr-race-quick")
    config = CorpusConfig(seed=0, num_train=args.asr_train, num_dev=args.asr_dev, num_test=8)
    _progress(f"corpus {args.asr_corpus} ({args.asr_train} train / {args.asr_dev} dev)")
    generate_corpus(args.asr_corpus, config, jobs=2, progress=False)


def start_lighthouse(cluster: cluster_net.EmulatedCluster,
                     workdir: Path) -> torchft_cases.Lighthouse:
    """torchft's lighthouse in node 0's namespace (IPv6 checked first); the caller stops it."""
    problem = torchft_cases.ipv6_problem(cluster.exec_prefix(0))
    if problem:
        raise RuntimeError(f"torchft cases: {problem}")
    lighthouse = torchft_cases.Lighthouse(cluster.exec_prefix(0), cluster.members[0].address,
                                          cluster.nodes, workdir / "lighthouse.log")
    _progress(f"torchft lighthouse at {lighthouse.url} (node 0)")
    return lighthouse.start()


def library_option_problem(case: dict[str, Any]) -> str | None:
    """Why the installed library cannot run a library ``case`` (an option its strategy does
    not take, such as ``gossip_every_n_steps`` before the ``budget`` work), else None."""
    if case["kind"] != "gossip":
        return None
    import inspect

    import lightning_gossip
    from benchmarks.race.worker import library_kwargs

    cls = {"dpsgd": lightning_gossip.DPSGDStrategy,
           "adpsgd": lightning_gossip.ADPSGDStrategy}[case["strategy"]]
    taken = inspect.signature(cls.__init__).parameters
    missing = sorted(k for k in library_kwargs(case) if k not in taken)
    return f"{cls.__name__} takes no {', '.join(missing)}" if missing else None


def skip_unavailable(args: argparse.Namespace) -> str | None:
    """Drop from ``args.cases`` the cases this installation cannot run (torchft or Decent-DP not
    importable, a library option not there yet); the reasons, or None."""
    reasons = []
    for kinds, unavailable in ((torchft_cases.KINDS, torchft_cases.unavailable),
                               (decentdp_case.KINDS, decentdp_case.unavailable)):
        wanted = [c for c in args.cases if CASES[c]["kind"] in kinds]
        reason = unavailable() if wanted else None
        if reason:
            args.cases = [c for c in args.cases if c not in wanted]
            reasons.append(f"{' '.join(wanted)}: {reason}")
    for c in list(args.cases):
        problem = library_option_problem(CASES[c])
        if problem:
            args.cases.remove(c)
            reasons.append(f"{c}: {problem}")
    return "; ".join(reasons) or None


skip_torchft = skip_unavailable
"""(The name it had while torchft was the only optional peer.)"""


def preflight(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(why the race cannot run here, None if it can; a warning to record, or None).

    Refuses without network namespaces, without a way to emulate a latency asked for, and
    above ``--max-load`` unless ``--allow-load`` (then a warning)."""
    reason = cluster_net.check_available(args.prefix)
    if reason:
        return reason, None
    if args.latency_ms > 0:
        problem = cluster_net.latency_problem(args.prefix)
        if problem:
            return (f"{problem}; --latency-ms 0 runs without latency (the record says so and "
                    f"no claim is made from it)"), None
    problem = rules.load_problem(os.getloadavg()[0], args.max_load)
    if problem and not args.allow_load:
        return f"{problem}; wait, or --allow-load (recorded as loaded)", None
    return None, problem


def link_summary(cluster: dict[str, Any]) -> dict[str, Any]:
    """The emulated link as a record keeps it: rate, asked one-way delay, the delay method
    (``netem`` or ``nfqueue``: ``testbed/link_delay.py``) and the round trip measured on the
    built cluster (a TCP ping-pong between two nodes, ``testbed/rtt_probe.py``).

    >>> link_summary({"rate_mbit": 200.0, "latency_ms": 0.5, "latency_check": {
    ...     "via": "nfqueue", "rtt": {"median_ms": 1.04}, "rtt_without_delay":
    ...     {"median_ms": 0.09}, "rtt_added_ms": 0.95}})["rtt_ms"]
    1.04
    """
    check = cluster.get("latency_check") or {}
    return {"rate_mbit": cluster.get("rate_mbit"), "latency_ms": cluster.get("latency_ms"),
            "delay_method": check.get("via"), "rtt_ms": (check.get("rtt") or {}).get("median_ms"),
            "rtt": check.get("rtt"),
            "rtt_without_delay_ms": (check.get("rtt_without_delay") or {}).get("median_ms"),
            "rtt_added_ms": check.get("rtt_added_ms"),
            "asked_rtt_added_ms": check.get("asked_rtt_added_ms")}


def run_race(args: argparse.Namespace,
             on_case: Callable[[dict[str, Any]], None] | None = None
             ) -> tuple[dict[str, Any], str]:
    """Build the cluster, run the cases, remove everything; (the payload, launch detail).
    ``on_case`` gets each case's raw result as soon as it is written."""
    workdir = Path(tempfile.mkdtemp(prefix="lg-race-"))
    cluster = cluster_net.EmulatedCluster(args.nodes, args.rate, prefix=args.prefix,
                                latency_ms=args.latency_ms)
    before = machine()
    t0 = time.time()
    cpu0 = cpu_snapshot()
    lighthouse = None
    with cluster_net.signals_unwind():
        try:
            cluster.build()
            spec = build_spec(args)
            if any(CASES[c]["kind"] in torchft_cases.KINDS for c in args.cases):
                lighthouse = start_lighthouse(cluster, workdir)
                spec["torchft"] = {"lighthouse": lighthouse.url,
                                   "addresses": [m.address for m in cluster.members]}
            results, detail = launch(cluster, spec, workdir, args.timeout, on_case)
        finally:
            try:
                if lighthouse is not None:
                    lighthouse.stop()
                cluster.close()
            finally:
                if args.keep_logs:
                    _progress(f"logs kept in {workdir}")
                else:
                    shutil.rmtree(workdir, ignore_errors=True)
    cpu1, elapsed = cpu_snapshot(), time.time() - t0
    results = summarise(results, higher_is_better=args.workload != "asr", warmup=args.warmup)
    params = results[0]["params"] if results else None
    hz = os.sysconf("SC_CLK_TCK")
    payload = {
        "benchmark": "race", "workload": args.workload, "nodes": args.nodes,
        "procs": args.procs, "rate_mbit": args.rate, "latency_ms": args.latency_ms,
        "slow_node": args.slow_node,
        "slow_extra_s": next((r["slow_extra_s"] for r in results), args.slow_extra_s),
        "lr_rule": args.lr_rule, "commit": commit(),
        "foreign_cpu_fraction": rules.foreign_cpu_fraction(
            (cpu1[0] - cpu0[0]) / hz, cpu1[1] - cpu0[1], elapsed, os.cpu_count() or 1),
        "node_cpus": spec["node_cpus"], "pin_nodes": bool(args.pin_nodes),
        "seed": spec["seed"],
        "comm_compute": next((r.get("comm_compute") for r in results), None),
        "comm_compute_ratio": next(((r.get("comm_compute") or {}).get("comm_compute_ratio")
                                    for r in results), None),
        "link": link_summary(cluster.describe()),
        "metric": "dev WER, % (lower is better)" if args.workload == "asr"
        else "validation accuracy, % (higher is better)",
        "target": results[0]["target"] if results else args.target,
        "budget_s": results[-1]["budget_s"] if results else args.budget,
        "params": params, "model_bytes": None if params is None else params * 4,
        "model": model_description(args), "status": detail,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine_before": before, "machine_after": machine(), "wall_s": time.time() - t0,
        "cluster": cluster.describe(), "cases": results,
    }
    return payload, detail


def main(argv: list[str] | None = None) -> int:
    """Run the race; 0 on success, 1 if it failed, 2 where it cannot run here."""
    args = parse_args(argv)
    skipped = skip_unavailable(args)
    if skipped:
        print(f"race: skipping cases: {skipped}", file=sys.stderr)
        if not args.cases:
            return 2
    reason, warning = preflight(args)
    if reason:
        print(f"race: not run: {reason}", file=sys.stderr)
        return 2
    if warning:
        print(f"race: WARNING: {warning}", file=sys.stderr)
    prepare_corpus(args)
    _progress(f"{args.nodes}x{args.procs} at {args.rate:g} Mbit/s, {model_description(args)}, "
              f"cases {args.cases}; load {os.getloadavg()}")
    payload, detail = run_race(args)
    payload["loaded"] = warning
    payload["markdown"] = markdown_table(payload)
    payload["markdown_per_sample"] = per_sample_table(payload)
    print(payload["markdown"] + "\n\n" + payload["markdown_per_sample"])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        _progress(f"wrote {args.json}")
    plot(payload, args.png)
    _progress(f"wrote {args.png}")
    return 0 if detail == "ok" else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("race: interrupted; everything it made was removed", file=sys.stderr)
        raise SystemExit(130) from None
