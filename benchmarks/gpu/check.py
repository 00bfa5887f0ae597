"""A short, prepared check of the gossip strategies on ONE GPU (two ranks sharing it).

What one GPU can show (every item is reported separately, as passed / failed / skipped):

* ``backend``     which process-group backend two ranks on the same device could use: NCCL is
                  tried first (it usually refuses two ranks on one device, "Duplicate GPU
                  detected"), then gloo with CUDA tensors; the report says which one ran;
* ``dpsgd_exact`` D-PSGD with lr = 0 on CUDA tensors: after every step the replicas equal the
                  NumPy product of the mixing matrices with the initial replicas;
* ``adpsgd_sum``  AD-PSGD with lr = 0 on CUDA tensors: the sum of the replicas is conserved;
* ``adpsgd_stream`` the CUDA-stream code path of AD-PSGD
                  (:mod:`lightning_gossip.async_gossip.cuda_handoff`): the gossip thread ran
                  on a side stream;
* ``bf16_dpsgd`` / ``bf16_adpsgd`` a short ``precision="bf16-mixed"`` fit: finite loss and
                  parameters;
* ``time_*``      median step time of a ~10M-parameter MLP under ddp, dpsgd (overlap,
                  delay-by-one) and adpsgd (step = the wall time between two
                  ``on_train_batch_end`` calls, with a ``torch.cuda.synchronize()``).

Synthetic data only (nothing is downloaded). Two worker processes are started per backend
attempt, each one a "node" with one device (``num_nodes=2, devices=1``), both on ``cuda:0``;
every launch has a timeout, after which the workers' stacks are dumped and they are killed.
Runtime: about 1-3 minutes on a GPU machine (most of it starting Python and Lightning).

Needs: Python >= 3.10 with torch (a CUDA build for ``--device cuda``), lightning, numpy and this
repository (``bash scripts/setup.sh`` makes ``.venv`` with all of them). Usage::

    .venv/bin/python -m benchmarks.gpu.check --json gpu_check.json      # on the GPU machine
    .venv/bin/python -m benchmarks.gpu.check --device cpu --quick        # dry run, CPU only

Exit code 0 when every check that ran passed, 1 when one failed, 2 when the requirements are
missing (the message says which). See docs/gpu.md for the results table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.checklist import CHECKS, REQUIREMENTS, TIMED, WORLD

PROBE_TIMEOUT_S = 90.0


# ----------------------------------------------------------------------------------------------
# Worker side (two processes, started by the driver)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Rank:
    """One worker: its spec, folder, rank, backend, and the result it keeps writing."""

    spec: dict[str, Any]
    out: Path
    rank: int
    backend: str
    on_cuda: bool
    result: dict[str, Any]

    def write(self) -> None:
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(self.result))

    def say(self, msg: str) -> None:
        print(f"[gpu_check] rank {self.rank} {time.strftime('%H:%M:%S')} {msg}", flush=True)


def _probe(ctx: _Rank, device: Any) -> bool:
    """Can two ranks on this device talk through this backend? (an ``all_reduce``)"""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    try:
        if ctx.on_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(ctx.backend,
                                timeout=timedelta(seconds=ctx.spec["pg_timeout_s"]))
        t = torch.full((4,), float(ctx.rank + 1), device=device)
        dist.all_reduce(t)
        assert float(t[0]) == 3.0, f"all_reduce gave {float(t[0])}, expected 3.0"
        ctx.result["probe_ok"] = True
        if ctx.on_cuda:
            ctx.result["gpu"] = torch.cuda.get_device_name(device)
        ctx.say(f"backend {ctx.backend}: all_reduce works with {device.type} tensors")
    except Exception as e:  # noqa: BLE001 - reported to the driver, which tries the next one
        ctx.result["probe_ok"] = False
        ctx.result["probe_error"] = f"{type(e).__name__}: {e}"[:2000]
        ctx.write()
        ctx.say(f"backend {ctx.backend} refused: {ctx.result['probe_error'][:300]}")
        return False
    ctx.write()
    return True


def _p2p_probe(ctx: _Rank, device: Any) -> None:
    """Does ``send``/``recv`` work with these tensors? (the outcome is written first, so a
    crash leaves it said)."""
    import torch
    import torch.distributed as dist

    ctx.result["p2p"] = "crashed or hung (no result)"
    ctx.write()
    try:
        buf = torch.full((4,), float(ctx.rank), device=device)
        if ctx.rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)
            assert float(buf[0]) == 0.0, "send/recv delivered the wrong value"
        if ctx.on_cuda:
            torch.cuda.synchronize()
        ctx.result["p2p"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported; the checks show the consequences
        ctx.result["p2p"] = f"{type(e).__name__}: {e}"[:2000]
    ctx.say(f"backend {ctx.backend}: send/recv with {device.type} tensors: "
            f"{ctx.result['p2p'][:200]}")
    ctx.write()


def _worker(spec_path: Path) -> None:
    import torch
    import torch.distributed as dist

    spec = json.loads(spec_path.read_text())
    rank, backend, on_cuda = int(os.environ["RANK"]), spec["backend"], spec["device"] == "cuda"
    device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    torch.set_num_threads(max(1, spec["threads"]))
    ctx = _Rank(spec, spec_path.parent, rank, backend, on_cuda,
                {"rank": rank, "backend": backend, "checks": {}, "times_ms": {}})
    # Two phases, each result written before the next starts, so a crash in the second (gloo
    # has been seen to fault on point-to-point CUDA tensors) still leaves the first on disk.
    if not _probe(ctx, device):
        return
    if not spec.get("skip_p2p_probe"):
        _p2p_probe(ctx, device)
    if spec.get("probe_only"):
        dist.destroy_process_group()
        return
    from benchmarks.gpu import cases  # Lightning only now: a probe launch pays for torch alone.

    cases.Checks(ctx).run()
    ctx.write()
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the results are written already
        pass


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
def backend_list(text: str) -> Any:
    """``--backend``: ``auto`` or a comma-separated list of ``nccl`` / ``gloo``."""
    if text == "auto":
        return text
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in ("nccl", "gloo")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected auto or a list of nccl/gloo, got {text!r}")
    return names


def missing_requirements(device: str) -> list[str]:
    """What is missing to run the check on ``device`` (empty: nothing)."""
    missing = [m for m in REQUIREMENTS if importlib.util.find_spec(m) is None]
    if missing or device != "cuda":
        return missing
    import torch

    if not torch.cuda.is_available():
        return [f"a CUDA device (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda or 'none'}, torch.cuda.is_available() is False)"]
    return []


def launch(spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """Start the two workers with ``spec``; what each wrote, plus the launch's own outcome."""
    from benchmarks.common import harness

    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("rank*.json"):
        old.unlink()
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = harness.free_port()
    commands = []
    for r in range(WORLD):
        env = harness.worker_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                 WORLD_SIZE=str(WORLD), RANK=str(r), LOCAL_RANK="0",
                                 NODE_RANK=str(r), OMP_NUM_THREADS=str(spec["threads"]))
        commands.append(([sys.executable, "-m", "benchmarks.gpu.check", "--worker",
                          str(spec_path)], env))

    def forward(line: str) -> None:
        if line.startswith("[gpu_check]"):
            print(line.rstrip(), file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    with open(workdir / "log.txt", "w") as log:
        launched = harness.launch_processes(commands, timeout, log=log, on_line=forward)
        log.write(launched.diagnostics)
    ranks = []
    for r in range(WORLD):
        path = workdir / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": r})
    tail = "".join(launched.stdout.splitlines(keepends=True)[-60:])
    return {"ranks": ranks, "returncodes": launched.returncodes, "timed_out": launched.timed_out,
            "seconds": round(time.perf_counter() - t0, 1),
            "log_tail": tail if launched.returncode or launched.timed_out else ""}


def summarise(attempt: dict[str, Any]) -> dict[str, Any]:
    """Per check: passed / failed / skipped / not run, with the failing ranks named."""
    ranks = attempt["ranks"]
    summary: dict[str, Any] = {}
    for name in (*CHECKS, *(f"time_{c}" for c in TIMED)):
        per_rank = [r.get("checks", {}).get(name) for r in ranks]
        if any(c is None for c in per_rank):
            missing = [r for r, c in enumerate(per_rank) if c is None]
            died = [r for r in missing if ranks[r].get("running") == name]
            if died:
                how = "timed out" if attempt["timed_out"] else "died"
                summary[name] = {"status": "crashed", "detail": f"rank(s) {died} {how} in this "
                                 "check (log tail in the JSON)"}
                continue
            summary[name] = {"status": "not run", "detail": f"no result from rank(s) {missing}"
                             + (" (launch timed out)" if attempt["timed_out"] else "")}
            continue
        failed = [r for r, c in enumerate(per_rank) if not c["ok"]]
        if failed:
            errors = "; ".join(f"rank {r}: {per_rank[r]['error']}" for r in failed)
            summary[name] = {"status": "failed", "detail": errors}
        elif all("skipped" in (c.get("detail") or {}) for c in per_rank):
            summary[name] = {"status": "skipped", "detail": per_rank[0]["detail"]["skipped"]}
        else:
            summary[name] = {"status": "passed", "detail": per_rank[0]["detail"]}
    return summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the GPU check; cpu: a dry run of the same code")
    p.add_argument("--backend", type=backend_list, default="auto", metavar="LIST",
                   help="backends to try in order, e.g. gloo or nccl,gloo (default auto: "
                        "nccl,gloo on cuda, gloo on cpu); all but the last are probed first")
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke test)")
    p.add_argument("--json", metavar="FILE", help="write the full results here")
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds per launch before the workers are killed (default 240)")
    p.add_argument("--workdir", metavar="DIR", help="keep the workers' logs here")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    return p


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "device": args.device,
        "threads": 1 if args.quick else 4,
        "pg_timeout_s": 60 if args.quick else 120,
        "steps": 3,
        "small_dims": [16, 32, 4] if args.quick else [64, 256, 256, 10],
        # ~10.0M parameters: 1024*1664 + 3*1664^2 + 1664*10 (+ biases)
        "big_dims": [32, 64, 64, 10] if args.quick else [1024, 1664, 1664, 1664, 1664, 10],
        "batch": 16 if args.quick else 256,
        "warmup": 1 if args.quick else 5,
        "timed_steps": 3 if args.quick else 30,
    }


def _try_backends(args: argparse.Namespace, spec: dict[str, Any], backends: list[str],
                  root: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every launch (probes included), and the one that ran the checks (``None``: no backend
    worked)."""
    attempts = []
    for i, backend in enumerate(backends):
        # With a fallback left, or on a GPU, probe first in a launch of its own (short timeout:
        # a refusing NCCL may hang; a faulting point-to-point send must not cost the checks).
        probe_first = i + 1 < len(backends) or args.device == "cuda"
        timeout = min(args.timeout, PROBE_TIMEOUT_S) if probe_first else args.timeout
        print(f"gpu_check: launching 2 ranks on {args.device} with backend {backend}"
              f"{' (probe)' if probe_first else ''}, timeout {timeout:.0f}s",
              file=sys.stderr, flush=True)
        attempt = launch({**spec, "backend": backend, "probe_only": probe_first},
                         root / backend, timeout)
        attempt["backend"], attempt["probe_only"] = backend, probe_first
        attempts.append(attempt)
        if all(r.get("probe_ok") for r in attempt["ranks"]):
            if probe_first:
                p2p = [r.get("p2p") for r in attempt["ranks"]]
                print(f"gpu_check: backend {backend} works (send/recv: {p2p}); launching the "
                      f"checks, timeout {args.timeout:.0f}s", file=sys.stderr, flush=True)
                attempt = launch({**spec, "backend": backend, "skip_p2p_probe": True},
                                 root / f"{backend}_run", args.timeout)
                attempt["p2p"] = p2p
                attempt["backend"], attempt["probe_only"] = backend, False
                attempts.append(attempt)
            return attempts, attempt
        reasons = "; ".join(f"rank {r['rank']}: {r.get('probe_error', 'no probe result')}"
                            for r in attempt["ranks"] if not r.get("probe_ok"))
        print(f"gpu_check: backend {backend} did not work: {reasons[:500]}", file=sys.stderr)
    return attempts, None


def _payload(args: argparse.Namespace, spec: dict[str, Any], started: str,
             attempts: list[dict[str, Any]], chosen: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON report."""
    summary = summarise(chosen) if chosen is not None else {}
    times = {c: chosen["ranks"][0].get("times_ms", {}).get(c) for c in TIMED} if chosen else {}
    ddp = times.get("ddp")
    first = chosen["ranks"][0] if chosen else {}
    return {
        "started_utc": started,
        "device": args.device,
        "quick": args.quick,
        "gpu": first.get("gpu") if chosen else None,
        "backend": chosen["backend"] if chosen else None,
        "launches": [{"backend": a["backend"], "probe_only": a["probe_only"],
                      "seconds": a["seconds"], "returncodes": a["returncodes"],
                      "timed_out": a["timed_out"],
                      "probe_errors": [r.get("probe_error") for r in a["ranks"]]}
                     for a in attempts],
        "p2p": (chosen.get("p2p") or [r.get("p2p") for r in chosen["ranks"]]) if chosen
        else None,
        "params": first.get("params") if chosen else None,
        "checks": summary,
        "step_ms": times,
        "ratio_to_ddp": {c: (t / ddp if t and ddp else None) for c, t in times.items()},
        "spec": spec,
        "attempts": attempts,
    }


def _print_report(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    rows: list[list[str]] = []
    for name in (*CHECKS, *(f"time_{c}" for c in TIMED)):
        s = payload["checks"].get(name, {"status": "not run", "detail": "no backend worked"})
        detail = s["detail"]
        if isinstance(detail, dict):
            detail = ", ".join(f"{k}={v}" for k, v in detail.items())
        rows.append([name, s["status"], str(detail)[:70]])
    width = max(len(r[0]) for r in rows)
    print(f"\ngpu_check on {args.device} ({payload['gpu'] or 'no GPU'}), backend "
          f"{payload['backend'] or 'none'}, model {payload['params'] or '?'} parameters")
    for a in payload["attempts"]:
        errors = [e for e in (r.get("probe_error") for r in a["ranks"]) if e]
        print(f"  launch {a['backend']}{' probe' if a['probe_only'] else ''}: "
              f"{a['seconds']} s" + (", timed out" if a["timed_out"] else "")
              + (f", refused: {errors[0][:80]}" if errors else ""))
    if payload["p2p"]:
        print(f"  send/recv with {args.device} tensors (rank 0, rank 1): {payload['p2p']}")
    for name, status, detail in rows:
        print(f"  {name:<{width}}  {status:<8}  {detail}")
    times, ratios = payload["step_ms"], payload["ratio_to_ddp"]
    if times:
        print("  step time (median ms, ratio to ddp): " + ", ".join(
            f"{c} {t:.1f} ({ratios[c]:.2f}x)" if t and ratios[c] else f"{c} n/a"
            for c, t in times.items()))


def main(argv: list[str] | None = None) -> int:
    """Run the check; print a table, optionally write JSON; the exit code says how it went."""
    args = _parser().parse_args(argv)
    if args.worker:
        _worker(Path(args.worker))
        return 0
    missing = missing_requirements(args.device)
    if missing:
        print("gpu_check: missing " + ", ".join(missing) + ". It needs Python with torch "
              "(CUDA build), lightning and numpy, and this repository importable: run "
              "`bash scripts/setup.sh` and use .venv/bin/python (see docs/gpu.md); "
              "`--device cpu` runs the dry path without a GPU.", file=sys.stderr)
        return 2
    if args.backend == "auto":
        backends = ["nccl", "gloo"] if args.device == "cuda" else ["gloo"]
    else:
        backends = args.backend
    spec = _spec(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tmp = tempfile.TemporaryDirectory(prefix="gpu_check_") if not args.workdir else None
    root = Path(args.workdir) if args.workdir else Path(tmp.name)  # type: ignore[union-attr]
    attempts, chosen = _try_backends(args, spec, backends, root)
    payload = _payload(args, spec, started, attempts, chosen)
    _print_report(args, payload)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"results written to {args.json}")
    if tmp is not None:
        tmp.cleanup()
    if chosen is None:
        return 1
    return 1 if any(s["status"] in ("failed", "not run", "crashed")
                    for s in payload["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
