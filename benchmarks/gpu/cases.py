"""The checks of ``benchmarks/gpu/check.py`` that need Lightning, run by each of its two
workers once the backend probe has passed (a probe launch pays for torch alone, never imports
this module).

:class:`Checks` runs them in order; every check's outcome (or the error and traceback) goes
into the worker's result, which is written to disk before and after each check, so a crash
leaves the name of the check that was running.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import meters, trainers, workloads
from benchmarks.gpu.checklist import TIMED, WORLD
from lightning_gossip import topology as topologies
from lightning_gossip.async_gossip import cuda_handoff


class Rank(Protocol):
    """What a check needs of its worker (``benchmarks.gpu.check._Rank``)."""

    spec: dict[str, Any]
    out: Path
    rank: int
    backend: str
    on_cuda: bool
    result: dict[str, Any]

    def write(self) -> None: ...

    def say(self, msg: str) -> None: ...


def flat(model: nn.Module) -> np.ndarray:
    """All parameters of ``model`` as one float64 NumPy vector."""
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]
                     ).double().numpy()


def gather(x: Any) -> list[Any]:
    """``x`` of every rank (``all_gather_object``)."""
    box: list[Any] = [None] * WORLD
    dist.all_gather_object(box, x)
    return box


class Offset(Callback):
    """Moves the replicas apart after the strategy's initial broadcast; records x0."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.x0: Any = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        g = torch.Generator().manual_seed(1000 + self.rank)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
        self.x0 = flat(module)


class SideStreamRecorder:
    """Records, per call of ``StreamHandoff.on_side_stream``, whether a CUDA stream was used."""

    def __init__(self) -> None:
        self.uses: list[str] = []
        self.original = getattr(cuda_handoff.StreamHandoff, "on_side_stream", None)
        if self.original is not None:
            original = self.original
            uses = self.uses

            def recording_on_side_stream(handoff: Any) -> Any:
                uses.append("cuda" if handoff.stream is not None else "none")
                return original(handoff)

            cuda_handoff.StreamHandoff.on_side_stream = recording_on_side_stream  # type: ignore


class Checks:
    """The checks of one worker, in order (:meth:`run`)."""

    def __init__(self, ctx: Rank) -> None:
        self.ctx, self.spec = ctx, ctx.spec
        self.side_stream = SideStreamRecorder()
        self.small, self.steps = self.spec["small_dims"], self.spec["steps"]

    # -- plumbing ---------------------------------------------------------------------------
    def loader(self, dims: list[int], steps: int, batch: int) -> DataLoader:
        """Enough batches for every rank to take ``steps`` (AD-PSGD shares one cursor)."""
        g = torch.Generator().manual_seed(1000 + self.ctx.rank)
        n = (steps + 2) * WORLD * batch
        x = torch.randn(n, dims[0], generator=g)
        y = torch.randint(0, dims[-1], (n,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=batch, drop_last=True)

    def fit(self, model: workloads.Classifier, strategy: Any, steps: int, batch: int,
            dims: list[int], precision: str = "32-true",
            callbacks: list[Any] | None = None) -> None:
        """``steps`` steps on ``WORLD`` one-device "nodes" sharing the device."""
        options = trainers.trainer_kwargs(
            self.ctx.out, accelerator="cuda" if self.ctx.on_cuda else "cpu", max_steps=steps,
            max_epochs=-1, precision=precision, callbacks=callbacks or [])
        trainer = L.Trainer(devices=1, num_nodes=WORLD, strategy=strategy, **options)
        trainer.fit(model, self.loader(dims, steps, batch))

    def strategy(self, kind: str, **options: Any) -> Any:
        """``ddp``, or a gossip strategy on a ring with the checks' gossip keywords."""
        if kind == "ddp":
            return trainers.make_strategy("ddp", backend=self.ctx.backend)
        ring = {"topology": "ring"} if kind == "dpsgd" else {"pairing": "ring"}
        return trainers.make_strategy(kind, backend=self.ctx.backend, **ring, **options,
                                      consensus_every_n_steps=None, final_average=False)

    def check(self, name: str, body: Callable[[], dict[str, Any]]) -> None:
        """Run ``body``; its detail or its error (and traceback) go into the result."""
        ctx, checks = self.ctx, self.ctx.result["checks"]
        ctx.say(f"{name} ...")
        ctx.result["running"] = name  # left behind if the process dies in this check
        ctx.write()
        t0 = time.perf_counter()
        try:
            checks[name] = {"ok": True, "detail": body()}
        except Exception as e:  # noqa: BLE001 - reported per rank
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                            "traceback": traceback.format_exc()[-4000:]}
        checks[name]["seconds"] = round(time.perf_counter() - t0, 2)
        ctx.say(f"{name}: {'ok' if checks[name]['ok'] else 'FAILED'}")
        ctx.result.pop("running")
        ctx.write()

    def run(self) -> None:
        """Every check, then the timed cases."""
        self.check("dpsgd_exact", self.dpsgd_exact)
        self.check("adpsgd_sum", self.adpsgd_sum)
        self.check("adpsgd_stream", self.adpsgd_stream)
        self.check("bf16_dpsgd", lambda: self.bf16("dpsgd"))
        self.check("bf16_adpsgd", lambda: self.bf16("adpsgd"))
        big = self.spec["big_dims"]
        self.ctx.result["params"] = workloads.mlp_params(big)
        for case in TIMED:
            self.check(f"time_{case}", lambda case=case: self.time_case(case))

    # -- the checks -------------------------------------------------------------------------
    def dpsgd_exact(self) -> dict[str, Any]:
        """lr = 0: the replicas equal the product of the mixing matrices with x0."""
        torch.manual_seed(100)
        model, offset = workloads.Classifier(self.small, lr=0.0, momentum=0.0,
                                             record_losses=True), Offset(self.ctx.rank)
        strategy = self.strategy("dpsgd", overlap=True)
        self.fit(model, strategy, self.steps, 8, self.small, callbacks=[offset])
        devices = sorted({str(p.device) for p in model.parameters()})
        x0s, finals = np.stack(gather(offset.x0)), np.stack(gather(flat(model)))
        topo = topologies.build("ring", WORLD, 0)
        expected = x0s.copy()
        for t in range(self.steps):
            expected = topo.mixing_matrix(t) @ expected
        err = float(np.abs(finals - expected).max())
        assert np.abs(x0s[0] - x0s[1]).max() > 0.01, "the replicas did not start apart"
        assert err <= 1e-5, f"max |X - prod W_t X0| = {err:.3g} > 1e-5"
        return {"max_abs_error": err, "param_devices": devices, "steps": self.steps}

    def adpsgd_sum(self) -> dict[str, Any]:
        """lr = 0: the sum of the replicas is conserved."""
        torch.manual_seed(200)
        model, offset = workloads.Classifier(self.small, lr=0.0, momentum=0.0,
                                             record_losses=True), Offset(self.ctx.rank)
        strategy = self.strategy("adpsgd")
        before = len(self.side_stream.uses)
        self.fit(model, strategy, self.steps, 8, self.small, callbacks=[offset])
        self.ctx.result["side_stream_uses"] = self.side_stream.uses[before:]
        devices = sorted({str(p.device) for p in model.parameters()})
        x0s, finals = np.stack(gather(offset.x0)), np.stack(gather(flat(model)))
        err = float(np.abs(finals.sum(0) - x0s.sum(0)).max())
        moved = float(np.abs(finals - x0s).max())
        assert err <= 5e-6 * WORLD, f"sum of the replicas moved by {err:.3g} (lr = 0)"
        return {"max_abs_sum_error": err, "max_abs_change": moved, "param_devices": devices}

    def adpsgd_stream(self) -> dict[str, Any]:
        """The gossip thread of ``adpsgd_sum`` ran on a CUDA side stream."""
        uses = self.ctx.result.get("side_stream_uses")
        if self.side_stream.original is None:
            raise RuntimeError("StreamHandoff.on_side_stream is gone: update this check")
        if uses is None:
            raise RuntimeError("adpsgd_sum did not run")
        if not self.ctx.on_cuda:
            return {"skipped": "cpu run: no CUDA stream", "uses": uses}
        assert uses and all(u == "cuda" for u in uses), (
            f"the gossip thread did not run on a CUDA side stream (uses: {uses})")
        return {"uses": uses}

    def bf16(self, kind: str) -> dict[str, Any]:
        """A short ``bf16-mixed`` fit: finite losses and parameters."""
        torch.manual_seed(300)
        model = workloads.Classifier(self.small, lr=0.05, momentum=0.0, record_losses=True)
        self.fit(model, self.strategy(kind), self.steps, 8, self.small, precision="bf16-mixed")
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        assert model.losses and all(math.isfinite(x) for x in model.losses), model.losses
        assert finite, "non-finite parameters after the bf16-mixed fit"
        return {"losses": model.losses[-3:],
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}

    def time_case(self, case: str) -> dict[str, Any]:
        """Median step time of the big MLP under ``case``."""
        big, warm, timed = self.spec["big_dims"], self.spec["warmup"], self.spec["timed_steps"]
        torch.manual_seed(0)
        model = workloads.Classifier(big, lr=1e-3, momentum=0.0, record_losses=True)
        timer = meters.StepTimer(sync_cuda=self.ctx.on_cuda)
        if case in ("ddp", "adpsgd"):
            strategy = self.strategy(case)
        else:
            strategy = self.strategy("dpsgd", delay_by_one=case == "dpsgd_delay1")
        self.fit(model, strategy, warm + timed, self.spec["batch"], big, callbacks=[timer])
        dts = meters.intervals(timer.ends, max(warm - 1, 0))
        assert dts, "no step timed"
        ms = float(np.median(dts) * 1e3)
        self.ctx.result["times_ms"][case] = ms
        return {"median_ms": ms, "steps": len(dts)}
