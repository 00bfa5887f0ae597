"""A race to a target accuracy on the emulated cluster: the strategies against DDP's peers.

Needs root (network namespaces, veth, ``tc``: ``benchmarks/cluster_net.py``); exits 2 with the
reason elsewhere.

One run builds K namespaces ("nodes") joined by ``--rate`` Mbit/s links, starts one ``torchrun``
per node (``benchmarks/race_worker.py``, gloo over the node's veth) and runs every case back to
back in the same processes. Every case trains the same MLP (about ``--model-mb`` MB) on
scikit-learn's digits from the same seed, with the same data order, through a Lightning
``Trainer``: the same loop for every case, only the strategy and its communication differ.
Every ``--eval-every`` samples the exact average of the replicas (an all-reduce into a separate
copy; the replicas are not changed) is validated on the held-out 20 %; the clock stops during
validation and its link bytes are subtracted. Validations are points where all ranks meet;
``adpsgd`` cases, whose ranks meet only at epoch ends, are validated at epoch ends only.

``ddp`` runs first, for ``--epochs`` epochs; the target is its final accuracy minus 0.5 points
(or ``--target``) and every other case's budget is 3x its time (or ``--budget``). A case stops
at the first validation at or above the target, or when its budget is spent.

Cases: ``ddp`` (Lightning ``DDPStrategy``), ``ddp_bf16`` (plus torch's ``bf16_compress_hook``),
``postlocal4`` (torch's post-local SGD: ``post_localSGD_hook`` with an explicit per-node
``subgroup`` and a ``PeriodicModelAverager`` of period 4 after ``--warmup`` steps), ``dpsgd``,
``adpsgd``, ``dpsgd_hier_bf16``, ``adpsgd_hier_bf16`` (the library's strategies). Lightning
registers DDP communication hooks only on CUDA (silently skipped on CPU), so the race registers
them itself on the wrapped model before the first backward, and checks in the link bytes that
they ran (``hook_check``: bf16 about half of ddp's bytes per step, post-local SGD about
1/period after its warm-up).

Per case the JSON has ``name``, ``time_to_target_s`` (null when not reached),
``metric_at_ddp_time``, ``final_metric``, ``bytes_per_step_inter_node`` (mean over nodes of the
bytes a node sent on its link per optimizer step), ``curve`` (``[seconds, accuracy %]``); at the
top ``target``, ``workload``, ``nodes``, ``procs``, ``rate_mbit`` and the machine's load.

Usage::

    sudo python benchmarks/race.py --nodes 2 --procs 2 --rate 200 --png race.png
    sudo python benchmarks/race.py --quick --cases ddp ddp_bf16 postlocal4 dpsgd
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster_net as N  # noqa: E402
from cluster_worker import hidden_width, param_count  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "race_worker.py"
PREFIX = "lgr"
"""Name prefix of the race's namespaces and links (not cluster.py's)."""

CASES: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "ddp_bf16": {"kind": "ddp_bf16"},
    "postlocal4": {"kind": "postlocal", "period": 4},
    "dpsgd": {"kind": "gossip", "strategy": "dpsgd", "kwargs": {}},
    "adpsgd": {"kind": "gossip", "strategy": "adpsgd", "kwargs": {}},
    "dpsgd_hier_bf16": {"kind": "gossip", "strategy": "dpsgd",
                        "kwargs": {"hierarchical": True, "wire_dtype": "bf16"}},
    "adpsgd_hier_bf16": {"kind": "gossip", "strategy": "adpsgd",
                         "kwargs": {"hierarchical": True, "wire_dtype": "bf16"}},
}
"""Case name -> what the worker runs."""

HOOK_RATIO_TOLERANCE = 0.25
"""``hook_check`` passes when bytes/step over ddp's is within this (relative) of the expected."""


def _progress(msg: str) -> None:
    print(f"[race {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _worker_env(iface: str) -> dict[str, str]:
    """The ranks' environment (as cluster.py's): one thread, gloo on the node's link."""
    return N.worker_env(iface, str(ROOT))


def machine() -> dict[str, Any]:
    """Load average and cores now (wall times are inflated on a loaded machine)."""
    return {"loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def launch(cluster: N.EmulatedCluster, spec: dict[str, Any], workdir: Path,
           timeout_s: float) -> tuple[list[dict[str, Any]], str]:
    """Run the spec's cases in one torchrun per node; (the cases' results, status detail)."""
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    logs = [workdir / f"node{k}.log" for k in range(cluster.nodes)]
    procs: list[subprocess.Popen] = []
    names = [c["name"] for c in spec["cases"]]
    detail = "ok"
    try:
        for k, member in enumerate(cluster.members):
            cmd = [*cluster.exec_prefix(k), sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={cluster.nodes}", f"--node-rank={k}",
                   f"--nproc-per-node={spec['procs']}",
                   f"--master-addr={cluster.members[0].address}", "--master-port=29400",
                   str(WORKER), str(spec_path)]
            with open(logs[k], "w") as log:
                procs.append(subprocess.Popen(cmd, env=_worker_env(member.iface), cwd=ROOT,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            while seen < len(names) and (workdir / names[seen] / "result.json").exists():
                _progress(f"  {names[seen]} done")
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


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Seconds of the first validation at or above ``target`` (None when never reached).

    >>> time_to([[0, 10.0], [5, 50.0], [9, 80.0]], 45)
    5
    """
    return next((s for s, m in curve if m >= target), None)


def hook_check(res: dict[str, Any], ddp: dict[str, Any] | None) -> dict[str, Any] | None:
    """Bytes per step against ddp's, for the cases whose DDP hook the race registered."""
    if res["kind"] not in ("ddp_bf16", "postlocal") or ddp is None:
        return None
    base = ddp["bytes_per_step_inter_node"]
    if res["kind"] == "ddp_bf16":
        expected, measured = 0.5, res["bytes_per_step_inter_node"]
        what = "bytes/step over ddp's (bf16 hook halves the all-reduce)"
    else:
        expected, measured = 1.0 / float(res["period"]), res["bytes_per_step_after_warmup"]
        what = "bytes/step after warm-up over ddp's (one global average every period steps)"
    if not base or measured is None:
        return {"what": what, "expected_ratio": expected, "measured_ratio": None, "ok": False}
    ratio = measured / base
    return {"what": what, "expected_ratio": expected, "measured_ratio": round(ratio, 4),
            "ok": abs(ratio - expected) <= HOOK_RATIO_TOLERANCE * expected}


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``time_to_target_s``, ``metric_at_ddp_time`` and ``hook_check`` to every case."""
    ddp = next((r for r in results if r["name"] == "ddp"), None)
    for r in results:
        r["time_to_target_s"] = time_to(r["curve"], r["target"]) if r["target"] else None
        # the curve's own (rounded) seconds: ddp's last point is at ddp's time exactly
        r["metric_at_ddp_time"] = metric_at(r["curve"], ddp["curve"][-1][0]) if ddp else None
        check = hook_check(r, ddp)
        if check is not None:
            r["hook_check"] = check
    return results


def plot(payload: dict[str, Any], path: Path) -> None:
    """Validation accuracy against wall time, one line per case, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in payload["cases"]:
        if r.get("curve"):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker=".", label=r["name"])
    if payload["target"] is not None:
        ax.axhline(payload["target"], color="k", linestyle="--",
                   label=f"target {payload['target']:.1f}%")
    ax.set_xlabel("training wall time, s (validation excluded)")
    ax.set_ylabel("validation accuracy of the replica average, %")
    load = payload["machine_before"]["loadavg_1_5_15"][0]
    ax.set_title(f"race: {payload['workload']}, {payload['nodes']}x{payload['procs']} at "
                 f"{payload['rate_mbit']:g} Mbit/s (load {load:.0f} on "
                 f"{payload['machine_before']['cpus']} cores)", fontsize=10)
    lo = min((m for r in payload["cases"] for _, m in r.get("curve", [])[1:]), default=0)
    ax.set_ylim(max(0.0, lo - 5), 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def markdown_table(payload: dict[str, Any]) -> str:
    """One row per case: time to target, accuracy at ddp's time, final, bytes, hook check."""
    lines = ["| case | time to target, s | acc. at ddp's time, % | final acc., % | steps | "
             "MB/step/node | hook check |", "|---|---|---|---|---|---|---|"]

    def fmt(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    for r in payload["cases"]:
        check = r.get("hook_check")
        hook = "-" if check is None else (f"{check['measured_ratio']} of ddp (expected "
                                          f"{check['expected_ratio']:g}): "
                                          f"{'ok' if check['ok'] else 'FAILED'}")
        mb = r["bytes_per_step_inter_node"]
        lines.append(f"| {r['name']} | {fmt(r['time_to_target_s'])} | "
                     f"{fmt(r['metric_at_ddp_time'])} | {fmt(r['final_metric'])} | "
                     f"{r['steps']} | {fmt(None if mb is None else mb / 1e6, '.3f')} | {hook} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the race."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default="digits", choices=["digits"],
                   help="what is trained (asr: not yet)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (namespaces)")
    p.add_argument("--procs", type=int, default=2, help="processes (ranks) per node")
    p.add_argument("--rate", type=float, default=200.0, help="link rate, Mbit/s, each way")
    p.add_argument("--model-mb", type=float, default=4.0, help="MLP fp32 size, MB")
    p.add_argument("--epochs", type=int, default=6, help="ddp's epochs (sets target/budget)")
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                   metavar="CASE", help=f"cases (ddp always first); any of {', '.join(CASES)}")
    p.add_argument("--target", type=float, default=None,
                   help="target accuracy, %% (default: ddp's final minus 0.5 points)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per case (default: 3x ddp's time)")
    p.add_argument("--eval-every", type=int, default=256, help="validate every N samples")
    p.add_argument("--warmup", type=int, default=20,
                   help="post-local SGD warm-up, optimizer steps of global all-reduce")
    p.add_argument("--max-steps", type=int, default=0, help="cap per case (0: none)")
    p.add_argument("--quick", action="store_true",
                   help="tiny run: 0.25 MB model, 1 ddp epoch, at most 30 steps per case")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole race")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--png", type=Path, default=None, help="write the figure here")
    p.add_argument("--prefix", default=PREFIX, help="name prefix of namespaces and links")
    p.add_argument("--keep-logs", action="store_true", help="keep the ranks' logs")
    args = p.parse_args(argv)
    if args.quick:
        args.model_mb, args.epochs = 0.25, 1
        args.max_steps = args.max_steps or 30
    if "ddp" not in args.cases and (args.target is None or args.budget is None):
        p.error("without the ddp case, --target and --budget are needed")
    args.cases = ["ddp"] * ("ddp" in args.cases) + [c for c in args.cases if c != "ddp"]
    args.width = hidden_width(args.model_mb)
    return args


def _raise_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(f"signal {signal.Signals(signum).name}")


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every rank reads: cases, sizes, target/budget (None: set by ddp), slack."""
    return {
        "cases": [{"name": c, **CASES[c]} for c in args.cases], "nodes": args.nodes,
        "procs": args.procs, "width": args.width, "epochs": args.epochs,
        "batch_size": args.batch_size, "lr": args.lr, "eval_every": args.eval_every,
        "warmup": args.warmup, "max_steps": args.max_steps, "target": args.target,
        "budget_s": args.budget, "slack": 0.5, "budget_factor": 3.0,
        "pg_timeout_s": 300.0,
    }


def run_race(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Build the cluster, run the cases, remove everything; (the payload, launch detail)."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in old:
        if old[s] is not signal.SIG_IGN:
            signal.signal(s, _raise_on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="lg-race-"))
    cluster = N.EmulatedCluster(args.nodes, args.rate, prefix=args.prefix)
    before = machine()
    t0 = time.time()
    try:
        cluster.build()
        results, detail = launch(cluster, build_spec(args), workdir, args.timeout)
    finally:
        try:
            cluster.close()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if args.keep_logs:
                _progress(f"logs kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    results = summarise(results)
    params = param_count(args.width)
    payload = {
        "benchmark": "race", "workload": args.workload, "nodes": args.nodes,
        "procs": args.procs, "rate_mbit": args.rate,
        "target": results[0]["target"] if results else args.target,
        "budget_s": results[-1]["budget_s"] if results else args.budget,
        "params": params, "model_bytes": params * 4, "status": detail,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine_before": before, "machine_after": machine(), "wall_s": time.time() - t0,
        "cluster": cluster.describe(), "cases": results,
    }
    return payload, detail


def main(argv: list[str] | None = None) -> int:
    """Run the race; 0 on success, 1 if it failed, 2 where it cannot run here."""
    args = parse_args(argv)
    reason = N.check_available(args.prefix)
    if reason:
        print(f"race: skipped: {reason}", file=sys.stderr)
        return 2
    _progress(f"{args.nodes}x{args.procs} at {args.rate:g} Mbit/s, {args.workload}, MLP "
              f"{args.model_mb:g} MB, cases {args.cases}; load {os.getloadavg()}")
    payload, detail = run_race(args)
    payload["markdown"] = markdown_table(payload)
    print(payload["markdown"])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        _progress(f"wrote {args.json}")
    if args.png is not None:
        plot(payload, args.png)
        _progress(f"wrote {args.png}")
    return 0 if detail == "ok" else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("race: interrupted; everything it made was removed", file=sys.stderr)
        raise SystemExit(130) from None
