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

    .venv/bin/python benchmarks/gpu_check.py --json gpu_check.json      # on the GPU machine
    .venv/bin/python benchmarks/gpu_check.py --device cpu --quick        # dry run, CPU only

Exit code 0 when every check that ran passed, 1 when one failed, 2 when the requirements are
missing (the message says which). See docs/gpu.md for the results table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REQUIREMENTS = ("torch", "lightning", "numpy")
CHECKS = ("dpsgd_exact", "adpsgd_sum", "adpsgd_stream", "bf16_dpsgd", "bf16_adpsgd")
TIMED = ("ddp", "dpsgd_overlap", "dpsgd_delay1", "adpsgd")
WORLD = 2
PROBE_TIMEOUT_S = 90.0


# ----------------------------------------------------------------------------------------------
# Worker side (two processes, started by the driver)
# ----------------------------------------------------------------------------------------------
def _worker(spec_path: Path) -> None:  # noqa: C901 - one linear script of checks
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    spec = json.loads(spec_path.read_text())
    out = spec_path.parent
    rank = int(os.environ["RANK"])
    backend, on_cuda = spec["backend"], spec["device"] == "cuda"
    device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    torch.set_num_threads(max(1, spec["threads"]))
    result: dict[str, Any] = {"rank": rank, "backend": backend, "checks": {}, "times_ms": {}}

    def write() -> None:
        (out / f"rank{rank}.json").write_text(json.dumps(result))

    def say(msg: str) -> None:
        print(f"[gpu_check] rank {rank} {time.strftime('%H:%M:%S')} {msg}", flush=True)

    # -- can two ranks on this device talk through this backend? -------------------------------
    # Two phases, each result written before the next starts, so a crash in the second (gloo
    # has been seen to fault on point-to-point CUDA tensors) still leaves the first on disk.
    try:
        if on_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=spec["pg_timeout_s"]))
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t)
        assert float(t[0]) == 3.0, f"all_reduce gave {float(t[0])}, expected 3.0"
        result["probe_ok"] = True
        if on_cuda:
            result["gpu"] = torch.cuda.get_device_name(device)
        say(f"backend {backend}: all_reduce works with {device.type} tensors")
    except Exception as e:  # noqa: BLE001 - reported to the driver, which tries the next one
        result["probe_ok"] = False
        result["probe_error"] = f"{type(e).__name__}: {e}"[:2000]
        write()
        say(f"backend {backend} refused: {result['probe_error'][:300]}")
        return
    write()
    if not spec.get("skip_p2p_probe"):
        result["p2p"] = "crashed or hung (no result)"
        write()
        try:
            buf = torch.full((4,), float(rank), device=device)
            if rank == 0:
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
                assert float(buf[0]) == 0.0, "send/recv delivered the wrong value"
            if on_cuda:
                torch.cuda.synchronize()
            result["p2p"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported; the checks show the consequences
            result["p2p"] = f"{type(e).__name__}: {e}"[:2000]
        say(f"backend {backend}: send/recv with {device.type} tensors: {result['p2p'][:200]}")
        write()
    if spec.get("probe_only"):
        dist.destroy_process_group()
        return

    # Lightning only now: a probe launch pays for torch alone.
    import lightning as L
    import numpy as np
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_gossip
    from lightning_gossip import topology as T
    from lightning_gossip.async_gossip import cuda_handoff

    # -- instrumentation of the CUDA-stream path ------------------------------------------------
    side_stream_uses: list[str] = []
    original_on_side_stream = getattr(cuda_handoff.StreamHandoff, "on_side_stream", None)

    def recording_on_side_stream(self: Any) -> Any:
        side_stream_uses.append("cuda" if self.stream is not None else "none")
        return original_on_side_stream(self)  # type: ignore[misc]

    if original_on_side_stream is not None:
        cuda_handoff.StreamHandoff.on_side_stream = recording_on_side_stream  # type: ignore

    # -- models and fits ------------------------------------------------------------------------
    class MLP(L.LightningModule):
        def __init__(self, dims: list[int], lr: float, compute_ms: float = 0.0) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for a, b in zip(dims[:-1], dims[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.net = nn.Sequential(*layers[:-1])
            self.lr = lr
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            if on_cuda:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    class Offset(Callback):
        """Moves the replicas apart after the strategy's initial broadcast; records x0."""

        def __init__(self) -> None:
            self.x0: Any = None

        def on_train_start(self, trainer: Any, module: Any) -> None:
            g = torch.Generator().manual_seed(1000 + rank)
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(0.5 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
            self.x0 = flat(module)

    def loader(dims: list[int], steps: int, batch: int) -> DataLoader:
        # enough batches for every rank to take ``steps`` (AD-PSGD shares one cursor)
        g = torch.Generator().manual_seed(1000 + rank)
        n = (steps + 2) * WORLD * batch
        x = torch.randn(n, dims[0], generator=g)
        y = torch.randint(0, dims[-1], (n,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=batch, drop_last=True)

    def flat(model: nn.Module) -> np.ndarray:
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]
                         ).double().numpy()

    def fit(model: MLP, strategy: Any, steps: int, batch: int, dims: list[int],
            precision: str = "32-true", callbacks: list[Any] | None = None) -> None:
        trainer = L.Trainer(
            accelerator="cuda" if on_cuda else "cpu", devices=1, num_nodes=WORLD,
            strategy=strategy, max_steps=steps, max_epochs=-1, precision=precision,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=callbacks or [], default_root_dir=str(out / "lightning"),
        )
        trainer.fit(model, loader(dims, steps, batch))

    def gather(x: Any) -> list[Any]:
        box: list[Any] = [None] * WORLD
        dist.all_gather_object(box, x)
        return box

    gossip_kw = dict(consensus_every_n_steps=None, final_average=False,
                     process_group_backend=backend)
    small, steps = spec["small_dims"], spec["steps"]

    def check(name: str, body: Any) -> None:
        say(f"{name} ...")
        result["running"] = name  # left behind if the process dies in this check
        write()
        t0 = time.perf_counter()
        try:
            detail = body()
            result["checks"][name] = {"ok": True, "detail": detail}
        except Exception as e:  # noqa: BLE001 - reported per rank
            result["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                                      "traceback": traceback.format_exc()[-4000:]}
        result["checks"][name]["seconds"] = round(time.perf_counter() - t0, 2)
        say(f"{name}: {'ok' if result['checks'][name]['ok'] else 'FAILED'}")
        result.pop("running")
        write()

    def dpsgd_exact() -> dict[str, Any]:
        torch.manual_seed(100)
        model, offset = MLP(small, lr=0.0), Offset()  # replicas start apart
        strategy = lightning_gossip.DPSGDStrategy(topology="ring", overlap=True, **gossip_kw)
        fit(model, strategy, steps, 8, small, callbacks=[offset])
        x0 = offset.x0
        devices = sorted({str(p.device) for p in model.parameters()})
        x0s, finals = np.stack(gather(x0)), np.stack(gather(flat(model)))
        topo = T.build("ring", WORLD, 0)
        expected = x0s.copy()
        for t in range(steps):
            expected = topo.mixing_matrix(t) @ expected
        err = float(np.abs(finals - expected).max())
        assert np.abs(x0s[0] - x0s[1]).max() > 0.01, "the replicas did not start apart"
        assert err <= 1e-5, f"max |X - prod W_t X0| = {err:.3g} > 1e-5"
        return {"max_abs_error": err, "param_devices": devices, "steps": steps}

    def adpsgd_sum() -> dict[str, Any]:
        torch.manual_seed(200)
        model, offset = MLP(small, lr=0.0), Offset()
        strategy = lightning_gossip.ADPSGDStrategy(pairing="ring", **gossip_kw)
        before = len(side_stream_uses)
        fit(model, strategy, steps, 8, small, callbacks=[offset])
        x0 = offset.x0
        result["side_stream_uses"] = side_stream_uses[before:]
        devices = sorted({str(p.device) for p in model.parameters()})
        x0s, finals = np.stack(gather(x0)), np.stack(gather(flat(model)))
        err = float(np.abs(finals.sum(0) - x0s.sum(0)).max())
        moved = float(np.abs(finals - x0s).max())
        assert err <= 5e-6 * WORLD, f"sum of the replicas moved by {err:.3g} (lr = 0)"
        return {"max_abs_sum_error": err, "max_abs_change": moved, "param_devices": devices}

    def adpsgd_stream() -> dict[str, Any]:
        uses = result.get("side_stream_uses")
        if original_on_side_stream is None:
            raise RuntimeError("StreamHandoff.on_side_stream is gone: update this check")
        if uses is None:
            raise RuntimeError("adpsgd_sum did not run")
        if not on_cuda:
            return {"skipped": "cpu run: no CUDA stream", "uses": uses}
        assert uses and all(u == "cuda" for u in uses), (
            f"the gossip thread did not run on a CUDA side stream (uses: {uses})")
        return {"uses": uses}

    def bf16(kind: str) -> dict[str, Any]:
        torch.manual_seed(300)
        model = MLP(small, lr=0.05)
        if kind == "dpsgd":
            strategy: Any = lightning_gossip.DPSGDStrategy(topology="ring", **gossip_kw)
        else:
            strategy = lightning_gossip.ADPSGDStrategy(pairing="ring", **gossip_kw)
        fit(model, strategy, steps, 8, small, precision="bf16-mixed")
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        assert model.losses and all(math.isfinite(x) for x in model.losses), model.losses
        assert finite, "non-finite parameters after the bf16-mixed fit"
        return {"losses": model.losses[-3:],
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}

    check("dpsgd_exact", dpsgd_exact)
    check("adpsgd_sum", adpsgd_sum)
    check("adpsgd_stream", adpsgd_stream)
    check("bf16_dpsgd", lambda: bf16("dpsgd"))
    check("bf16_adpsgd", lambda: bf16("adpsgd"))

    # -- step time of a ~10M-parameter model ----------------------------------------------------
    big, warm, timed = spec["big_dims"], spec["warmup"], spec["timed_steps"]
    result["params"] = sum(a * b + b for a, b in zip(big[:-1], big[1:]))
    for case in TIMED:
        def body(case: str = case) -> dict[str, Any]:
            torch.manual_seed(0)
            model = MLP(big, lr=1e-3)
            timer = StepTimer()
            if case == "ddp":
                strategy: Any = DDPStrategy(process_group_backend=backend)
            elif case == "adpsgd":
                strategy = lightning_gossip.ADPSGDStrategy(pairing="ring", **gossip_kw)
            else:
                strategy = lightning_gossip.DPSGDStrategy(
                    topology="ring", delay_by_one=case == "dpsgd_delay1", **gossip_kw)
            fit(model, strategy, warm + timed, spec["batch"], big, callbacks=[timer])
            dts = [b - a for a, b in zip(timer.ends[:-1], timer.ends[1:])][max(warm - 1, 0):]
            assert dts, "no step timed"
            ms = float(np.median(dts) * 1e3)
            result["times_ms"][case] = ms
            return {"median_ms": ms, "steps": len(dts)}

        check(f"time_{case}", body)
    write()
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
    from tests import launch as tl

    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("rank*.json"):
        old.unlink()
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = tl.free_port()
    commands = []
    for r in range(WORLD):
        env = tl.base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                          RANK=str(r), LOCAL_RANK="0", NODE_RANK=str(r),
                          OMP_NUM_THREADS=str(spec["threads"]), PYTHONWARNINGS="ignore")
        commands.append(([sys.executable, str(Path(__file__).resolve()), "--worker",
                          str(spec_path)], env))

    def forward(line: str) -> None:
        if line.startswith("[gpu_check]"):
            print(line.rstrip(), file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    with open(workdir / "log.txt", "w") as log:
        launched = tl.launch_processes(commands, timeout, log=log, on_line=forward)
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


def main(argv: list[str] | None = None) -> int:
    """Run the check; print a table, optionally write JSON; the exit code says how it went."""
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
    args = p.parse_args(argv)
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
    spec = {
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
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tmp = tempfile.TemporaryDirectory(prefix="gpu_check_") if not args.workdir else None
    root = Path(args.workdir) if args.workdir else Path(tmp.name)  # type: ignore[union-attr]
    attempts = []
    chosen = None
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
            chosen = attempt
            break
        reasons = "; ".join(f"rank {r['rank']}: {r.get('probe_error', 'no probe result')}"
                            for r in attempt["ranks"] if not r.get("probe_ok"))
        print(f"gpu_check: backend {backend} did not work: {reasons[:500]}", file=sys.stderr)

    rows: list[list[str]] = []
    summary: dict[str, Any] = {}
    if chosen is not None:
        summary = summarise(chosen)
    for name in (*CHECKS, *(f"time_{c}" for c in TIMED)):
        s = summary.get(name, {"status": "not run", "detail": "no backend worked"})
        detail = s["detail"]
        if isinstance(detail, dict):
            detail = ", ".join(f"{k}={v}" for k, v in detail.items())
        rows.append([name, s["status"], str(detail)[:70]])
    times = {c: chosen["ranks"][0].get("times_ms", {}).get(c) for c in TIMED} if chosen else {}
    ddp = times.get("ddp")
    ratios = {c: (t / ddp if t and ddp else None) for c, t in times.items()}
    payload = {
        "started_utc": started,
        "device": args.device,
        "quick": args.quick,
        "gpu": chosen["ranks"][0].get("gpu") if chosen else None,
        "backend": chosen["backend"] if chosen else None,
        "launches": [{"backend": a["backend"], "probe_only": a["probe_only"],
                      "seconds": a["seconds"], "returncodes": a["returncodes"],
                      "timed_out": a["timed_out"],
                      "probe_errors": [r.get("probe_error") for r in a["ranks"]]}
                     for a in attempts],
        "p2p": (chosen.get("p2p") or [r.get("p2p") for r in chosen["ranks"]]) if chosen
        else None,
        "params": chosen["ranks"][0].get("params") if chosen else None,
        "checks": summary,
        "step_ms": times,
        "ratio_to_ddp": ratios,
        "spec": spec,
        "attempts": attempts,
    }
    width = max(len(r[0]) for r in rows)
    print(f"\ngpu_check on {args.device} ({payload['gpu'] or 'no GPU'}), backend "
          f"{payload['backend'] or 'none'}, model {payload['params'] or '?'} parameters")
    for a in attempts:
        errors = [e for e in (r.get("probe_error") for r in a["ranks"]) if e]
        print(f"  launch {a['backend']}{' probe' if a['probe_only'] else ''}: "
              f"{a['seconds']} s" + (", timed out" if a["timed_out"] else "")
              + (f", refused: {errors[0][:80]}" if errors else ""))
    if payload["p2p"]:
        print(f"  send/recv with {args.device} tensors (rank 0, rank 1): {payload['p2p']}")
    for name, status, detail in rows:
        print(f"  {name:<{width}}  {status:<8}  {detail}")
    if times:
        print("  step time (median ms, ratio to ddp): " + ", ".join(
            f"{c} {t:.1f} ({ratios[c]:.2f}x)" if t and ratios[c] else f"{c} n/a"
            for c, t in times.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"results written to {args.json}")
    if tmp is not None:
        tmp.cleanup()
    if chosen is None:
        return 1
    return 1 if any(s["status"] in ("failed", "not run", "crashed")
                    for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
