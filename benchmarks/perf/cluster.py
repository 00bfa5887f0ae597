"""An emulated multi-node cluster on one machine: K network namespaces behind slow links.

Needs root (network namespaces, veth, a bridge, ``tc``); skips with a message otherwise.

What one run does:

1. builds K network namespaces ("nodes") joined through veth links to a bridge that lives in a
   namespace of its own, every node's link limited to ``--rate`` Mbit/s in each direction with
   ``tc tbf`` (see ``testbed/cluster_net.py``); addresses (10.213.x.0/24) exist only inside
   those namespaces;
2. for every case, starts ``torchrun --nnodes K --node-rank k --nproc-per-node P`` inside every
   node's namespace (``ip netns exec``), gloo over the node's veth (``GLOO_SOCKET_IFNAME``), and
   trains the same MLP (about ``--model-mb`` MB) on scikit-learn's digits for ``--epochs``
   epochs (``benchmarks/perf/cluster_worker.py``); the ranks of one node talk over its loopback, so
   only inter-node traffic crosses (and is limited on) the links;
3. reports per case: time per epoch, samples/s, the bytes every node really sent on its link
   per optimizer step (interface counters, read inside the namespace), per rank (= per node /
   P), and held-out accuracy of the exact average of the replicas;
4. removes every namespace and link it made, also on failure, exception, Ctrl-C or SIGTERM.
   ``--cleanup`` removes what a killed run (SIGKILL) may have left, by name prefix.

Cases (``--cases``): ``ddp`` (Lightning DDPStrategy), ``dpsgd``, ``adpsgd`` (flat: every rank a
learner), and the multi-node options of the strategies: ``*_hier`` (``hierarchical=True``:
all-reduce inside a node, gossip between nodes), ``*_hier_bf16`` (plus ``wire_dtype="bf16"``),
``*_hier_ga`` (plus ``global_average_every_n_steps``; not in the default list). A case whose
option the installed strategies do not have (checked on their signatures) is reported as "not
available in this version" and not run. All cases run back to back in the same processes (start-up
is paid once). A case that fails or makes no progress for ``--case-timeout`` seconds is killed
with every process of every node and reported; the remaining cases are relaunched and the run
goes on.

Not emulated: latency, jitter and loss (``netem`` is not in this kernel), a switch's shared
capacity (the bridge is not limited, only every node's own link), and separate machines: all
ranks share this machine's CPU cores, so compute slows down as ranks are added.

Usage::

    sudo python -m benchmarks.perf.cluster                      # 2 nodes x 2 procs, 200 Mbit/s
    sudo python -m benchmarks.perf.cluster --nodes 3 --procs 1 --rate 100 --cases ddp dpsgd
    sudo python -m benchmarks.perf.cluster --cleanup             # remove leftovers of a killed run

With ``--scheduler slurm --sbatch FILE`` the nodes run a real SLURM instead (munged, slurmctld,
one slurmd per node: ``testbed/slurm_cluster.py``); the batch script is submitted with
``sbatch`` from the current folder, and its state and output are printed (exit status 0 only when
the job COMPLETED)::

    sudo python -m benchmarks.perf.cluster --scheduler slurm --sbatch \\
        recipes/imagenet/slurm/digits_cpu.sbatch --sbatch-args="--export=ALL,STRATEGY=adpsgd"
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.mlp_size import hidden_width, param_count
from testbed import cluster_net, slurm_cluster

ROOT = Path(__file__).resolve().parents[2]
WORKER = "benchmarks.perf.cluster_worker"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "cluster.json"

EXIT_GRACE_S = 60.0
"""Seconds the ranks get to exit after the last case of a launch is done."""

GLOBAL_AVERAGE_EVERY = 10
"""``global_average_every_n_steps`` of the ``*_hier_ga`` cases."""

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "dpsgd": ("dpsgd", {}),
    "adpsgd": ("adpsgd", {}),
    "dpsgd_hier": ("dpsgd", {"hierarchical": True}),
    "adpsgd_hier": ("adpsgd", {"hierarchical": True}),
    "dpsgd_hier_bf16": ("dpsgd", {"hierarchical": True, "wire_dtype": "bf16"}),
    "adpsgd_hier_bf16": ("adpsgd", {"hierarchical": True, "wire_dtype": "bf16"}),
    "dpsgd_hier_ga": ("dpsgd", {"hierarchical": True,
                                "global_average_every_n_steps": GLOBAL_AVERAGE_EVERY}),
    "adpsgd_hier_ga": ("adpsgd", {"hierarchical": True,
                                  "global_average_every_n_steps": GLOBAL_AVERAGE_EVERY}),
    # remedies tried for hierarchical adpsgd's time per epoch
    "adpsgd_hier_delay": ("adpsgd", {"hierarchical": True, "delay_by_one": True}),
    "adpsgd_hier_nowait": ("adpsgd", {"hierarchical": True, "max_staleness": None}),
}
"""Case name -> (strategy, extra keyword arguments)."""

DEFAULT_CASES = ["ddp", "dpsgd", "adpsgd", "dpsgd_hier", "adpsgd_hier", "dpsgd_hier_bf16",
                 "adpsgd_hier_bf16"]


def unavailable_reason(case: str) -> str | None:
    """``None`` when the installed strategies accept the case's options, else why not."""
    kind, kwargs = CASES[case]
    if kind == "ddp" or not kwargs:
        return None
    import lightning_gossip

    cls = {"dpsgd": lightning_gossip.DPSGDStrategy, "adpsgd": lightning_gossip.ADPSGDStrategy}[kind]
    params = inspect.signature(cls.__init__).parameters
    missing = [k for k in kwargs if k not in params]
    if missing:
        return (f"not available in this version ({cls.__name__} has no "
                f"{', '.join(repr(m) for m in missing)} parameter)")
    return None


def _worker_env(iface: str) -> dict[str, str]:
    return cluster_net.worker_env(iface, str(ROOT))


def _progress(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _launch(cluster: cluster_net.EmulatedCluster, cases: list[str], args: argparse.Namespace,
            launch_dir: Path, port: int) -> tuple[list[str], dict[str, Any]]:
    """Start one torchrun per node running ``cases`` in order; wait with bounded progress.

    Returns the cases that completed (every rank wrote its result) and a record of the launch:
    ``status`` ("ok", or "failed"/"timeout" for the first case that did not complete, which is
    then killed with every process of every node), ``detail``, log tails, bytes sent.
    """
    launch_dir.mkdir(parents=True, exist_ok=True)
    spec = {"cases": [{"name": c, "strategy": CASES[c][0], "kwargs": CASES[c][1]} for c in cases],
            "nodes": args.nodes, "procs": args.procs, "width": args.width,
            "epochs": args.epochs, "max_steps": args.max_steps, "batch_size": args.batch_size,
            "lr": args.lr, "pg_timeout_s": max(30.0, args.case_timeout * 0.75)}
    spec_path = launch_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    world = args.nodes * args.procs
    before = cluster.all_counters()
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    logs = [launch_dir / f"node{k}.log" for k in range(args.nodes)]
    done: list[str] = []
    status, detail = "ok", ""

    def complete(case: str) -> bool:
        return all((launch_dir / case / f"rank{r}.json").exists() for r in range(world))

    try:
        for k, member in enumerate(cluster.members):
            cmd = [*cluster.exec_prefix(k), sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={args.nodes}", f"--node-rank={k}",
                   f"--nproc-per-node={args.procs}", f"--master-addr={cluster.members[0].address}",
                   f"--master-port={port}", "-m", WORKER, str(spec_path)]
            with open(logs[k], "w") as log:
                procs.append(subprocess.Popen(cmd, env=_worker_env(member.iface), cwd=ROOT,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        # The first case's allowance includes the start-up of every rank.
        deadline = t0 + args.case_timeout + args.startup_timeout
        failed_at: float | None = None
        while True:
            while len(done) < len(cases) and complete(cases[len(done)]):
                done.append(cases[len(done)])
                _progress(f"  {done[-1]} done")
                # the next case, or (after the last one) the ranks' exit
                deadline = time.monotonic() + (args.case_timeout if len(done) < len(cases)
                                               else EXIT_GRACE_S)
            codes = [p.poll() for p in procs]
            current = cases[len(done)] if len(done) < len(cases) else None
            if all(c is not None for c in codes):
                bad = [k for k, c in enumerate(codes) if c != 0]
                if current is not None or bad:
                    status = "failed"
                    detail = (f"node(s) {bad} exited with {[codes[k] for k in bad]}" if bad
                              else "exited without writing every rank's result")
                break
            now = time.monotonic()
            if any(c not in (None, 0) for c in codes) and failed_at is None:
                failed_at = now  # the others may be waiting on it: a short grace
            if failed_at is not None and now - failed_at > 30:
                status = "failed"
                detail = (f"node(s) {[k for k, c in enumerate(codes) if c not in (None, 0)]} "
                          "failed; the others did not exit within 30 s (killed)")
                break
            if now > deadline and current is None:
                detail = "every case done, but the processes did not exit in time (killed)"
                break
            if now > deadline:
                status = "timeout"
                detail = (f"no progress within {args.case_timeout:g} s; killed every process "
                          f"of node(s) {[k for k, c in enumerate(codes) if c is None]}")
                break
            time.sleep(0.2)
    finally:
        cluster.end_launch(procs)  # whatever is left: every process in every node's namespace
    after = cluster.all_counters()
    record: dict[str, Any] = {
        "cases": cases, "completed": list(done), "status": status, "detail": detail,
        "wall_s": time.monotonic() - t0,
        "tx_bytes_per_node": [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)],
    }
    if status != "ok":
        record["failed_case"] = cases[len(done)] if len(done) < len(cases) else None
        record["log_tail"] = {f"node{k}": _tail(p) for k, p in enumerate(logs)}
    return done, record


def run_cases(cluster: cluster_net.EmulatedCluster, cases: list[str], args: argparse.Namespace,
              workdir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``cases`` back to back (one launch; relaunched after a failed or hung case).

    Returns one result per case and the record of every launch.
    """
    results: list[dict[str, Any]] = []
    launches: list[dict[str, Any]] = []
    remaining = list(cases)
    world = args.nodes * args.procs
    while remaining:
        n = len(launches)
        launch_dir = workdir / f"launch{n}"
        _progress(f"launch {n}: {remaining}")
        done, record = _launch(cluster, remaining, args, launch_dir, 29500 + n)
        launches.append(record)
        for case in done:
            ranks = [json.loads((launch_dir / case / f"rank{r}.json").read_text())
                     for r in range(world)]
            res = {"case": case, "strategy": CASES[case][0], "kwargs": CASES[case][1],
                   "status": "ok", "detail": "", "launch": n, **summarise(ranks, args)}
            results.append(res)
            _progress(f"  {case}: {res['epoch_s']:.2f} s/epoch, "
                      f"{sum(res['tx_bytes_per_step_per_node']) / args.nodes / 1e6:.2f} "
                      f"MB/step/node, accuracy {100 * res['accuracy']:.1f}%")
        remaining = remaining[len(done):]
        if record["status"] != "ok" and remaining:
            bad = remaining.pop(0)
            results.append({"case": bad, "strategy": CASES[bad][0], "kwargs": CASES[bad][1],
                            "status": record["status"], "detail": record["detail"],
                            "launch": n, "log_tail": record["log_tail"]})
            _progress(f"  {bad}: {record['status']}: {record['detail']}")
            for k, tail in record["log_tail"].items():
                _progress(f"  {k} log tail:\n{tail[-1500:]}")
    return results, launches


def summarise(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per-case figures from the ranks' reports (see the module docstring)."""
    nodes, procs = args.nodes, args.procs
    steps = [r["steps"] for r in ranks]
    train_s = max(r["train_s"] for r in ranks)
    epochs_done = min(len(r["epoch_s"]) for r in ranks) or 1
    samples = sum(r["samples"] for r in ranks)
    per_node_step, per_node_rx_step = [], []
    for k in range(nodes):
        mine = [r for r in ranks if r["node"] == k]
        lead = next(r for r in mine if r["local_rank"] == 0)
        node_steps = sum(r["steps"] for r in mine) / len(mine)
        start, end = lead["counters_start"], lead["counters_end"]
        per_node_step.append((end["tx_bytes"] - start["tx_bytes"]) / max(node_steps, 1))
        per_node_rx_step.append((end["rx_bytes"] - start["rx_bytes"]) / max(node_steps, 1))
    steady = []
    for r in ranks:
        later = r["epoch_s"][1:] or r["epoch_s"]
        steady.append(sorted(later)[len(later) // 2] if later else float("nan"))
    rank0 = next(r for r in ranks if r["rank"] == 0)
    return {
        "steps_per_rank": steps,
        "train_wall_s": train_s,
        "epochs": epochs_done,
        "epoch_s": train_s / epochs_done,
        "epoch_s_steady_median": sum(steady) / len(steady),
        "samples_per_s": samples / train_s,
        "tx_bytes_per_step_per_node": per_node_step,
        "rx_bytes_per_step_per_node": per_node_rx_step,
        "tx_bytes_per_step_per_rank": [b / procs for b in per_node_step],
        "accuracy": rank0["accuracy"],
        "replica_accuracy_mean": sum(r["local_accuracy"] for r in ranks) / len(ranks),
        "params": rank0["params"],
    }


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The per-case table (time, throughput, inter-node bytes per step, accuracy)."""
    ddp = next((r for r in results if r["case"] == "ddp" and r["status"] == "ok"), None)
    headers = ["case", "s/epoch", "x ddp", "samples/s", "MB/step/node", "MB/step/rank",
               "acc %", "replicas' acc %"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in results:
        if r["status"] != "ok":
            what = ("not available in this version" if r["status"] == "unavailable"
                    else f"{r['status']}: {r['detail']}")
            lines.append(f"| {r['case']} | {what} |" + " |" * (len(headers) - 2))
            continue
        node_mb = sum(r["tx_bytes_per_step_per_node"]) / len(r["tx_bytes_per_step_per_node"])
        rank_mb = sum(r["tx_bytes_per_step_per_rank"]) / len(r["tx_bytes_per_step_per_rank"])
        ratio = f"{r['epoch_s'] / ddp['epoch_s']:.2f}" if ddp else "-"
        lines.append(
            f"| {r['case']} | {r['epoch_s']:.2f} | {ratio} | {r['samples_per_s']:.0f} | "
            f"{node_mb / 1e6:.2f} | {rank_mb / 1e6:.2f} | {100 * r['accuracy']:.1f} | "
            f"{100 * r['replica_accuracy_mean']:.1f} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Load, cores, kernel, versions."""
    info: dict[str, Any] = {"loadavg_1_5_15": list(os.getloadavg()), "cpus": os.cpu_count(),
                            "kernel": platform.release(), "python": platform.python_version()}
    try:
        git = ["git", "-C", str(ROOT)]
        info["git_head"] = subprocess.run([*git, "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True,
                                          timeout=10).stdout.strip()
        info["git_dirty_library"] = bool(subprocess.run(
            [*git, "status", "--porcelain", "lightning_gossip"], capture_output=True, text=True,
            timeout=10).stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        info["git_head"] = None
    for dist in ("torch", "lightning"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    try:
        info["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True,
                                        timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["uptime"] = None
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the emulated-cluster benchmark."""
    p = argparse.ArgumentParser(
        description="Emulated multi-node cluster (network namespaces, rate-limited veth links, "
        "torchrun per node): time, throughput, inter-node bytes and accuracy per strategy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (namespaces)")
    p.add_argument("--procs", type=int, default=2, help="processes (ranks) per node")
    p.add_argument("--rate", type=float, default=200.0,
                   help="link rate of every node, Mbit/s, each direction (tc tbf)")
    p.add_argument("--model-mb", type=float, default=4.0,
                   help="size of the MLP's fp32 parameters, MB (2 hidden layers)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per case")
    p.add_argument("--max-steps", type=int, default=-1,
                   help="stop a case after this many optimizer steps (-1: no limit)")
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES),
                   metavar="CASE", help=f"cases, run back to back in this order; any of "
                   f"{', '.join(CASES)}")
    p.add_argument("--case-timeout", type=float, default=600.0,
                   help="seconds before a case is killed (with all its processes)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="extra seconds allowed to the first case of a launch (process start-up)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument("--keep-logs", action="store_true", help="keep the per-case folders")
    p.add_argument("--prefix", default=cluster_net.PREFIX,
                   help="name prefix of namespaces and links")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces/links named PREFIX... (and SLURM daemons, their "
                   "folders) left by a killed run, then exit")
    p.add_argument("--scheduler", choices=("torchrun", "slurm"), default="torchrun",
                   help="torchrun: the benchmark cases; slurm: a real SLURM on the nodes (one "
                   "slurmd each, --procs CPUs each) running the --sbatch script")
    p.add_argument("--sbatch", metavar="FILE", help="batch script to submit (--scheduler slurm)")
    p.add_argument("--sbatch-args", default="", metavar="ARGS",
                   help="options for sbatch, one string (--sbatch-args='--export=ALL,X=1')")
    p.add_argument("--job-timeout", type=float, default=1800.0,
                   help="seconds to wait for the SLURM job before cancelling it")
    args = p.parse_args(argv)
    if args.scheduler == "slurm" and not args.cleanup and not args.sbatch:
        p.error("--scheduler slurm needs --sbatch FILE")
    for name in ("nodes", "procs", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate <= 0 or args.model_mb <= 0 or args.case_timeout <= 0:
        p.error("--rate, --model-mb and --case-timeout must be positive")
    args.width = hidden_width(args.model_mb)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if a case failed, 2 where it cannot run here."""
    args = parse_args(argv)
    if args.cleanup:
        removed = slurm_cluster.remove_leftovers(args.prefix)
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    if args.scheduler == "slurm":
        return slurm_cluster.run_sbatch(args)
    reason = cluster_net.check_available(args.prefix)
    if reason:
        print(f"cluster: skipped: {reason}", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    runnable = []
    for case in args.cases:
        why = unavailable_reason(case)
        if why:
            results.append({"case": case, "status": "unavailable", "detail": why})
            _progress(f"{case}: {why}")
        else:
            runnable.append(case)
    params = param_count(args.width)
    info_before = machine()
    _progress(f"{args.nodes} nodes x {args.procs} procs, {args.rate:g} Mbit/s links, MLP "
              f"{params / 1e6:.2f}M params ({params * 4 / 1e6:.1f} MB), {args.epochs} epoch(s), "
              f"cases {runnable}; {info_before['uptime']}")
    workdir = Path(tempfile.mkdtemp(prefix="lg-cluster-"))
    cluster = cluster_net.EmulatedCluster(args.nodes, args.rate, prefix=args.prefix)
    t_start = time.time()
    launches: list[dict[str, Any]] = []
    # SIGTERM/SIGHUP too reach the finally that removes everything
    with cluster_net.signals_unwind():
        try:
            cluster.build()
            ran, launches = run_cases(cluster, runnable, args, workdir)
            results += ran
        except BaseException as e:
            _progress(f"interrupted ({type(e).__name__}: {e}); removing the cluster")
            raise
        finally:
            try:
                cluster.close()
            finally:
                if not args.keep_logs:
                    shutil.rmtree(workdir, ignore_errors=True)
                else:
                    _progress(f"logs kept in {workdir}")
    order = {c: i for i, c in enumerate(args.cases)}
    results.sort(key=lambda r: order[r["case"]])
    info_after = machine()
    table = markdown_table(results)
    header = (f"Emulated cluster: {args.nodes} nodes x {args.procs} processes, {args.rate:g} "
              f"Mbit/s tbf links (no latency emulated), MLP {params / 1e6:.2f}M parameters "
              f"({params * 4 / 1e6:.1f} MB fp32) on digits, per-rank batch {args.batch_size}, "
              f"{args.epochs} epoch(s); load before: {info_before['uptime']}; after: "
              f"{info_after['uptime']}.")
    print(header + "\n\n" + table)
    payload = {
        "benchmark": "cluster", "config": {k: (str(v) if isinstance(v, Path) else v)
                                           for k, v in vars(args).items()},
        "params": params, "model_bytes": params * 4, "cluster": cluster.describe(),
        "machine_before": info_before, "machine_after": info_after,
        "wall_s": time.time() - t_start, "cases": results, "launches": launches,
        "markdown": header + "\n\n" + table,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    _progress(f"wrote {args.json}")
    return 0 if all(r["status"] in ("ok", "unavailable") for r in results) else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("cluster: interrupted; everything it made was removed", file=sys.stderr)
        raise SystemExit(130) from None
