"""One rank of a race (started by ``benchmarks/race/driver.py`` through torchrun, inside a node).

Usage (inside a node's namespace, by torchrun)::

    python -m benchmarks.race.worker SPEC.json

Every case of the spec runs, in order, in the same processes, through a Lightning ``Trainer``
(the same loop, data order, model and seed for every case; only the strategy and its
communication differ). Workloads: ``digits`` (an MLP on scikit-learn's digits, accuracy) and
``asr`` (the ASR recipe's BLSTM-CTC on the synthetic corpus, WER:
``benchmarks/race/asr_workload.py``).
Cases:

* ``ddp``: Lightning's ``DDPStrategy``, plain; it runs ``epochs`` epochs and sets the target
  (its final metric minus ``slack`` points) and the budget (``budget_factor`` x its time) for
  the cases after it, unless the spec gives them;
* ``ddp_bf16``, ``ddp_powersgd<R>``, ``postlocal<P>``: ``DDPStrategy`` plus a torch DDP
  communication hook (and for post-local SGD a ``PeriodicModelAverager`` after every optimizer
  step), registered here on the wrapped ``DistributedDataParallel`` in ``on_fit_start`` (before
  the first backward), because Lightning registers them only on CUDA
  (``benchmarks/race/hooks.py``);
* ``torchft_localsgd``, ``torchft_diloco``: DDP inside the node (``DDPStrategy`` on the node's
  process group) and torchft's ``LocalSGD``/``DiLoCo`` across nodes, one replica group per node,
  hooked on Lightning's optimizer in ``on_fit_start`` (``benchmarks/race/torchft_cases.py``);
* ``decentdp_*``: Decent-DP's ``DecentralizedDataParallel`` as Lightning's model wrapper
  (``benchmarks/race/decentdp_case.py``);
* the library's strategies (``dpsgd``, ``adpsgd`` and their ``hierarchical``/``wire_dtype``/
  ``gossip_every_n_steps`` options), with ``final_average=False`` and no periodic consensus;
  with ``gossip_every_n_steps="auto"`` every run records each rank's decisions (the period, the
  compute and exchange times and R it was picked from: ``auto_period``).

Seeds: every case of a launch trains from the spec's ``seed`` (initialisation, data order,
PowerSGD's random projections); the campaign gives run ``k`` seed ``rules.run_seed(k)`` and
the tuning ``rules.TUNING_SEED``, and every case records it (``seed``).

R: once per launch, before the cases, the ranks measure the ratio that decides a race
(``benchmarks/race/comm_compute.py``): a bf16 replica's one-way time on the emulated link over
the lockstep compute step; every case of the launch records it (``comm_compute``).

Validation, every ``eval_steps`` optimizer steps of each rank (``eval_every`` samples of all
ranks; ``curve_samples`` records the samples all ranks really processed), on the held-out 20 %
of digits (``asr``: the corpus's dev split), of the EXACT average of the replicas: the flattened
parameters are all-reduced on a process group of the race's own into a separate evaluation copy;
the replicas themselves are not changed. The clock stops during evaluation, and the link bytes
sent during evaluation are subtracted, so the curve's seconds and the bytes per step are those
of training. The stop decision (target reached, budget spent, or any rank at its step cap) is
taken on all-reduced values, so every rank stops at the same validation. Validations are points
where all ranks meet. adpsgd's ranks take different numbers of steps (its shared cursor) and
meet only at epoch ends; a collective anywhere else can deadlock with its gossip, so adpsgd
cases are validated at epoch ends only (a coarser curve; a case can stop only there). In ``asr``
an epoch is a chunk of ``eval_every`` utterances, and every case is validated at epoch ends.

A slow node (``slow_node``: its index): its ranks sleep after every training batch for the
race's FIXED handicap, ``slow_extra_s`` seconds, the same number for every case (the race rules:
given by the driver, calibrated once on an idle machine; when the spec leaves it None, it is
calibrated here once before the first case: the slow node's median local step, forward,
backward and optimizer step of the same model with no communication, all ranks at once). Before
every case the slow node's local step is measured again (off the clock) and the case records
its achieved slowdown, ``(local step + extra) / local step`` (``rules.slowdown``): the
driver rejects a run whose cases saw slowdowns more than 10 % apart. Rank 0 writes
``<case>/result.json``.

Each case trains at its own peak rate (``case['lr']``, set by the driver by the same procedure
for every case: ``rules.case_lr``) and records ``init_params_sha256``, a hash of the
initial parameters, so a reader can check that every case started from the same model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from benchmarks.common.workloads import Classifier, digits_80_20
from benchmarks.race import asr_workload, comm_compute, decentdp_case, hooks, rules, torchft_cases
from testbed.cluster_net import read_counters


class RaceClassifier(Classifier):
    """``workloads.Classifier`` of 64 -> width -> width -> 10 (as ``cluster_worker``) that runs
    the race's validation at every epoch end."""

    def __init__(self, width: int, lr: float) -> None:
        super().__init__([64, width, width, 10], lr)

    def on_train_epoch_end(self) -> None:
        """After every callback's epoch end (adpsgd's ranks have met): the race's validation."""
        meter = next((c for c in self.trainer.callbacks if isinstance(c, RaceMeter)), None)
        if meter is not None:
            meter.epoch_end(self.trainer, self)


class RaceMeter(Callback):
    """Clock (paused during evaluation), curve, stop decision and link bytes of one case."""

    def __init__(self, ctx: dict[str, Any], case: dict[str, Any], target: float | None,
                 budget_s: float | None, max_steps: int | None) -> None:
        self.ctx, self.case = ctx, case
        self.target, self.budget_s, self.max_steps = target, budget_s, max_steps
        self.curve: list[list[float]] = []  # [seconds, metric, samples of all ranks]
        self.steps = 0
        self.samples = 0  # this rank's training samples so far
        self.train_s = 0.0
        self.t_resume = 0.0
        self.excluded = 0  # tx bytes of evaluation windows (local rank 0)
        self.marks: dict[str, tuple[int, int, int]] = {}  # name -> (step, tx_bytes, excluded)
        self.eval_model: nn.Module | None = None
        # adpsgd: its ranks take different numbers of steps and meet only at epoch ends, where
        # a collective is safe (one elsewhere can deadlock with its gossip): validate there
        self.at_epoch_end = case.get("strategy") == "adpsgd" or ctx["workload"] == "asr"
        self.averager: Any = None
        self.torchft: Any = None  # torchft_cases.TorchFTSync of a torchft case
        self.torchft_commits: int | None = None
        self.sleep_s = float(ctx.get("sleep_s", 0.0))  # a slow node's ranks: the handicap
        self.slept_s = 0.0  # slept in all (the slow node's ranks)
        self.init_sha: str | None = None  # hash of the initial parameters (same for every case)

    def _tx(self) -> int:
        return read_counters(self.ctx["iface"])["tx_bytes"] if self.ctx["local_rank"] == 0 else 0

    def _mark(self, name: str) -> None:
        self.marks[name] = (self.steps, self._tx(), self.excluded)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.averager = hooks.install(self.case, trainer, self.ctx["warmup"],
                                      self.ctx["node_group"], int(self.ctx.get("seed", 0)))
        if self.case["kind"] in torchft_cases.KINDS:
            self.torchft = torchft_cases.TorchFTSync(self.case, int(self.case["index"]),
                                                     pl_module, trainer.optimizers[0], self.ctx)

    def close_torchft(self) -> None:
        """Stop a torchft case's manager and store (collective on the node's group)."""
        if self.torchft is not None:
            self.torchft_commits = self.torchft.commits()
            self.torchft.close()
            self.torchft = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.torchft is not None:
            self.torchft.closed = True  # no collective here: the other ranks may be gone
            self.torchft.manager.shutdown(wait=False)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.eval_model = copy.deepcopy(net_of(pl_module))
        self.init_sha = params_sha256(net_of(pl_module))
        dist.barrier(group=self.ctx["group"])
        self._mark("start")
        if self.ctx["warmup"] == 0:  # (--warmup 0: no warm-up, the bytes after it = all)
            self._mark("warmup")
        self.evaluate(trainer, pl_module)  # the untrained model, at 0 s
        self.t_resume = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
            self.slept_s += self.sleep_s
        if self.averager is not None:
            self.averager.average_parameters(pl_module.parameters())
        self.steps += 1
        self.samples += batch_len(batch)
        if self.steps == self.ctx["warmup"]:
            self._mark("warmup")
        if self.at_epoch_end:
            return
        last = self.max_steps is not None and self.steps >= self.max_steps
        if self.steps % self.ctx["eval_steps"] == 0 or last:
            self._validate(trainer, pl_module, last)

    def epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Validate at an epoch end (adpsgd: after its ranks have met; called by the module)."""
        if self.at_epoch_end:
            self._validate(trainer, pl_module,
                           self.max_steps is not None and self.steps >= self.max_steps)

    def _validate(self, trainer: Any, pl_module: Any, last: bool) -> None:
        decentdp_case.settle(trainer.strategy.model, self.case)  # on the clock
        self.train_s += time.perf_counter() - self.t_resume
        if self.evaluate(trainer, pl_module, last):
            trainer.should_stop = True
            self._mark("end")
        self.t_resume = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if "end" not in self.marks:  # the loop ended on its own (epochs): one last point
            self.train_s += time.perf_counter() - self.t_resume
            self.evaluate(trainer, pl_module)
            self._mark("end")
        self.close_torchft()

    def evaluate(self, trainer: Any, pl_module: Any, last: bool = False) -> bool:
        """Metric of the exact replica average; record it; True when every rank should stop.

        Collective (every rank calls it equally often): the clock is the ranks' maximum, the
        samples the ranks' sum (adpsgd's shared cursor lets ranks take different numbers of
        steps), and any rank's ``last`` (its step cap) stops all of them.
        """
        group = self.ctx["group"]
        dist.barrier(group=group)
        tx0 = self._tx()
        with torch.no_grad():
            params = list(net_of(pl_module).parameters())
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.all_reduce(flat, group=group)
            flat /= self.ctx["world"]
            assert self.eval_model is not None
            torch.nn.utils.vector_to_parameters(flat, self.eval_model.parameters())
            metric = validation_metric(self.eval_model, self.ctx, pl_module)
            clock = torch.tensor([self.train_s, metric, float(last)], dtype=torch.float64)
            dist.all_reduce(clock, op=dist.ReduceOp.MAX, group=group)
            samples = torch.tensor([self.samples], dtype=torch.int64)
            dist.all_reduce(samples, group=group)
        seconds = float(clock[0])
        self.curve.append([seconds, metric, int(samples[0])])
        if self.ctx["rank"] == 0:
            print(f"[race] {self.case['name']}: {seconds:.1f} s, {int(samples[0])} samples, "
                  f"metric {metric:.2f}", flush=True)
        dist.barrier(group=group)
        self.excluded += self._tx() - tx0
        reached = self.target is not None and better_or_equal(metric, self.target, self.ctx)
        spent = self.budget_s is not None and seconds >= self.budget_s
        return bool(reached or spent or clock[2] > 0)


def params_sha256(net: nn.Module) -> str:
    """SHA-256 of a network's parameters (fp32 bytes, in order): the same model, the same hash."""
    digest = hashlib.sha256()
    for p in net.parameters():
        digest.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def net_of(module: Any) -> nn.Module:
    """The trained network of a race module (digits: ``net``; asr: the recognizer's ``model``)."""
    return module.net if hasattr(module, "net") else module.model


def batch_len(batch: Any) -> int:
    """Samples in a training batch (digits: ``[x, y]``; asr: a ``Batch``)."""
    return len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)


def better_or_equal(metric: float, target: float, ctx: dict[str, Any]) -> bool:
    """Whether ``metric`` reaches ``target`` (accuracy: at or above; WER: at or below)."""
    return metric >= target if ctx["higher_is_better"] else metric <= target


def validation_metric(net: nn.Module, ctx: dict[str, Any], module: Any) -> float:
    """Accuracy % (digits) or WER % (asr, collective) of ``net`` on the held-out set."""
    if ctx["workload"] == "asr":
        return asr_workload.wer(net, ctx["data"], module.vocabulary, ctx["group"])
    pred = net(ctx["x_val"]).argmax(1)
    return 100.0 * float((pred == ctx["y_val"]).float().mean())


def make_strategy(case: dict[str, Any], timeout: timedelta, node_group: Any = None,
                  procs: int = 1, warmup_steps: int = 20, workload: str = "asr") -> Any:
    """The Lightning strategy of ``case`` (torchft cases: DDP on the node's ``node_group``;
    Decent-DP: ``procs`` ranks per node, the race's ``warmup_steps``)."""
    from lightning.pytorch.strategies import DDPStrategy

    if case["kind"] in torchft_cases.KINDS:
        return DDPStrategy(process_group_backend="gloo", timeout=timeout,
                           process_group=node_group)
    if case["kind"] in decentdp_case.KINDS:
        return decentdp_case.make_strategy(case, timeout, float(case["lr"]), procs,
                                           warmup_steps, workload)
    if case["kind"] != "gossip":
        # PowerSGD: one bucket (hooks.SINGLE_BUCKET_MB), else its chained collectives
        # interleave differently on each rank under gloo (hooks' docstring)
        buckets = ({"bucket_cap_mb": hooks.SINGLE_BUCKET_MB}
                   if case["kind"] == "ddp_powersgd" else {})
        if case.get("bucket_cap_mb") is not None:  # ddp's bucket size, a tuned option
            buckets = {"bucket_cap_mb": float(case["bucket_cap_mb"])}
        return DDPStrategy(process_group_backend="gloo", timeout=timeout, **buckets)
    import lightning_gossip

    cls = {"dpsgd": lightning_gossip.DPSGDStrategy,
           "adpsgd": lightning_gossip.ADPSGDStrategy}[case["strategy"]]
    kwargs = library_kwargs(case)
    kwargs.update(final_average=False, consensus_every_n_steps=None,
                  process_group_backend="gloo", timeout=timeout)
    return cls(**kwargs)


def library_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    """The strategy options of a library case: its ``kwargs``, with ``gossip_every_n_steps``
    passed only where it is not 1 (the option exists from the ``budget`` work on; at 1 the
    case runs on a library without it, bit for bit today's default).

    >>> library_kwargs({"kwargs": {"hierarchical": True, "gossip_every_n_steps": 1}})
    {'hierarchical': True}
    >>> library_kwargs({"kwargs": {"gossip_every_n_steps": 4}})
    {'gossip_every_n_steps': 4}
    """
    kwargs = dict(case.get("kwargs") or {})
    if kwargs.get("gossip_every_n_steps", 1) == 1:
        kwargs.pop("gossip_every_n_steps", None)
    return kwargs


def bytes_between(meters: list[dict[str, Any]], start: str, end: str) -> float | None:
    """Tx bytes per node and step between two marks, evaluation windows excluded.

    All nodes' link bytes over all nodes' optimizer steps: where the nodes take different
    numbers of steps (``adpsgd``) a plain mean of per-node rates would weigh a slow node's few
    steps as much as a fast node's many.
    """
    sent = steps = 0
    for m in meters:
        if start not in m or end not in m:
            return None
        s0, b0, e0 = m[start]
        s1, b1, e1 = m[end]
        if s1 <= s0:
            return None
        sent += (b1 - b0) - (e1 - e0)
        steps += s1 - s0
    return sent / steps if steps else None


def run_case(ctx: dict[str, Any], spec: dict[str, Any], case: dict[str, Any],
             target: float | None, budget_s: float | None) -> dict[str, Any]:
    """Train ``case`` from the common seed until target/budget (ddp without a given target:
    ``epochs``, and its final metric sets the target); its record."""
    fixed = case["name"] == "ddp" and target is None
    max_steps = round(ctx["steps_per_epoch"] * float(spec["epochs"])) if fixed else None
    if spec.get("max_steps"):
        max_steps = min(max_steps or spec["max_steps"], int(spec["max_steps"]))
    budget = case.get("max_samples") or spec.get("max_samples")  # (a tuning trial's own cap)
    if budget:  # a budget in samples of all ranks (load-independent)
        cap = -(-int(budget) // (int(spec["batch_size"]) * ctx["world"]))
        max_steps = min(max_steps or cap, cap)
    L.seed_everything(int(spec.get("seed", 0)), workers=True, verbose=False)
    # Decent-DP steps its own optimizers inside backward: Lightning's is built at rate 0
    model = make_model(spec, ctx, dict(case, lr=0.0) if case["kind"] in decentdp_case.KINDS
                       else case)
    meter = RaceMeter(ctx, case, None if fixed else target, None if fixed else budget_s,
                      max_steps)
    asr = ctx["workload"] == "asr"
    trainer = L.Trainer(
        accelerator="cpu", devices=int(spec["procs"]), num_nodes=int(spec["nodes"]),
        strategy=make_strategy(case, ctx["timeout"], ctx["node_group"], ctx["procs"],
                               int(spec["asr"]["warmup_steps"]), ctx["workload"]),
        max_epochs=100_000,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=not asr, gradient_clip_val=5.0 if asr else None,
        callbacks=[meter], default_root_dir=str(ctx["out"] / case["name"] / "lightning"))
    trainer.fit(model, make_loader(spec, ctx))
    meter.close_torchft()  # (closed at the train end already; idempotent)
    dist.barrier(group=ctx["group"])
    marks = [None] * ctx["world"]
    dist.all_gather_object(marks, meter.marks if ctx["local_rank"] == 0 else None,
                           group=ctx["group"])
    nodes = [m for m in marks if m is not None]
    steps_per_rank = [None] * ctx["world"]  # adpsgd: a faster node takes more of each epoch
    dist.all_gather_object(steps_per_rank, meter.steps, group=ctx["group"])
    stats = [None] * ctx["world"]  # the gossip strategies' counters (staleness waits, ...)
    dist.all_gather_object(stats, dict(getattr(trainer.strategy, "gossip_stats", None) or {}),
                           group=ctx["group"])
    autos = [None] * ctx["world"]  # gossip_every_n_steps="auto": each rank's decisions
    dist.all_gather_object(autos, auto_periods(trainer.strategy), group=ctx["group"])
    slept_per_step = [None] * ctx["world"]  # a slow node's mean sleep per step (others 0)
    dist.all_gather_object(slept_per_step, round(meter.slept_s / max(meter.steps, 1), 3),
                           group=ctx["group"])
    curve = [[round(s, 3), round(m, 3)] for s, m, _ in meter.curve]
    if case["kind"] in torchft_cases.KINDS:
        expected = torchft_cases.expected_ratio(meter.steps, int(case["period"]), ctx["nodes"],
                                                ctx["procs"])
    elif case["kind"] in decentdp_case.KINDS:
        expected = decentdp_case.expected_ratio(case, ctx["nodes"], ctx["procs"])
    else:
        expected = hooks.expected_ratio(case, net_of(model))
    return {
        "name": case["name"], "kind": case["kind"], "strategy": case.get("strategy"),
        "kwargs": case.get("kwargs", {}), "period": case.get("period"),
        "rank": case.get("rank"), "params": sum(p.numel() for p in net_of(model).parameters()),
        "expected_hook_ratio": expected, "seed": int(spec.get("seed", 0)),
        "comm_compute": ctx.get("comm_compute"), "options": case_options(case),
        "torchft_commits": meter.torchft_commits, "lr": case_peak(spec, case),
        "init_params_sha256": meter.init_sha,
        "slow_extra_s": ctx["slow_extra_s"], "load_during": [ctx["load0"], load()],
        "slow_local_step_s": ctx.get("slow_local_step_s"),
        "calibration_steps_s": ctx.get("calibration_steps_s"),
        "slow_alone_step_s": ctx.get("slow_alone_s"),
        "slow_calibration": ctx.get("slow_calibration"),
        "slowdown": (None if ctx["slow_extra_s"] is None
                     else rules.slowdown(ctx["slow_extra_s"], ctx["slow_local_step_s"])),
        "slow_slept_per_step_s": slept_per_step,
        "curve": curve, "curve_samples": [int(n) for _, _, n in meter.curve],
        "steps": meter.steps, "steps_per_rank": steps_per_rank, "gossip_stats": stats,
        "auto_period": autos if any(a is not None for a in autos) else None,
        "train_s": curve[-1][0] if curve else None,
        "final_metric": curve[-1][1] if curve else None,
        "bytes_per_step_inter_node": bytes_between(nodes, "start", "end"),
        "bytes_per_step_after_warmup": bytes_between(nodes, "warmup", "end"),
        "bytes_per_step_warmup": bytes_between(nodes, "start", "warmup"),
    }


def auto_periods(strategy: Any) -> dict[str, Any] | None:
    """``gossip_every_n_steps="auto"``: what this rank's strategy decided in the fit (``None``
    for every other case): ``period``, the one in force at the end; ``decisions``, each with
    the step it took effect at, the period, the compute and exchange times (ms) and R the
    policy was given (for ``dpsgd`` the maxima over the ranks, the same on every rank), whether
    the exchange hides, and this rank's own medians; ``postponed``, the ``[step, until]`` of
    decisions put off past a pending stop or requeue.

    >>> from lightning_gossip.gossip_period.auto import PeriodDriver, PeriodSwitch
    >>> from lightning_gossip.gossip_period import AutoPeriod, PeriodDecision
    >>> class S:
    ...     auto_period = PeriodDriver(AutoPeriod(), agree=False)
    >>> S.auto_period.switches.append(PeriodSwitch(11, 0.2, 0.5, PeriodDecision(
    ...     3, 0.2, 0.5, 2.5, True, 1.1, 10, 8, 8)))
    >>> record = auto_periods(S())
    >>> record["decisions"][0]["exchange_ms"], record["decisions"][0]["ratio"]
    (500.0, 2.5)
    >>> auto_periods(object()) is None
    True
    """
    driver = getattr(strategy, "auto_period", None)
    if driver is None:
        return None
    decisions = []
    for switch in driver.switches:
        d = switch.decision
        decisions.append({
            "step": switch.step, "period": d.period, "compute_ms": round(d.compute_s * 1e3, 3),
            "exchange_ms": round(d.exchange_s * 1e3, 3), "ratio": round(d.ratio, 4),
            "hidden": d.hidden, "margin": d.margin,
            "local_compute_ms": round(switch.local_compute_s * 1e3, 3),
            "local_exchange_ms": round(switch.local_exchange_s * 1e3, 3)})
    period = decisions[-1]["period"] if decisions else 1
    return {"period": period, "decisions": decisions,
            "postponed": [list(p) for p in getattr(driver, "postponed", [])]}


def case_options(case: dict[str, Any]) -> dict[str, Any]:
    """What a case is besides its kind and rate (periods, outer optimizer, bucket size, rank,
    topology, library options), for the record.

    >>> case_options({"name": "x", "kind": "postlocal", "period": 4, "lr": 1e-3, "index": 0})
    {'period': 4}
    """
    return {k: v for k, v in case.items() if k not in ("name", "kind", "lr", "index", "peaks")}


def load() -> list[float]:
    """The machine's load average (1, 5, 15 min) now."""
    return [round(x, 2) for x in os.getloadavg()]


def case_peak(spec: dict[str, Any], case: dict[str, Any] | None) -> float:
    """The peak learning rate of ``case`` (the driver's ``case['lr']``; else ``spec['lr']``)."""
    if case is not None and case.get("lr") is not None:
        return float(case["lr"])
    return float(spec["lr"])


def make_model(spec: dict[str, Any], ctx: dict[str, Any],
               case: dict[str, Any] | None = None) -> L.LightningModule:
    """The workload's model at ``case``'s peak rate, from the seed set just before."""
    if ctx["workload"] == "asr":
        return asr_workload.make_model(spec, ctx["data"], RaceMeter, case_peak(spec, case))
    return RaceClassifier(int(spec["width"]), case_peak(spec, case))


def make_loader(spec: dict[str, Any], ctx: dict[str, Any]) -> Any:
    """The workload's training loader (digits: Lightning adds its distributed sampler)."""
    from torch.utils.data import DataLoader

    if ctx["workload"] == "asr":
        return asr_workload.loader(spec, ctx["data"], ctx["rank"], ctx["world"])
    return DataLoader(ctx["train"], batch_size=int(spec["batch_size"]), shuffle=True)


def calibrate(spec: dict[str, Any], ctx: dict[str, Any], steps: int = 8,
              lockstep: bool = True, adamw: bool = False) -> tuple[float, float]:
    """Median local step (forward, backward, optimizer step; no communication) of this rank,
    and the median of its forward (loss) alone, on rank 0's batches (the same on every rank).

    ``lockstep`` (collective): every rank at once, a barrier before each step, the contention
    of training; otherwise this rank alone, no collective (:func:`alone_step`). ``adamw``:
    the optimizer step is AdamW's (the asr workload's), else a plain SGD step."""
    L.seed_everything(0, verbose=False)
    model = make_model(spec, ctx)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-6) if adamw
           else torch.optim.SGD(model.parameters(), lr=1e-6))
    batches = [b for _, b in zip(range(steps), make_loader(spec, {**ctx, "rank": 0}))]
    times, forwards = [], []
    for i in range(steps):
        batch = batches[i % len(batches)]
        if lockstep:
            dist.barrier(group=ctx["group"])
        t0 = time.perf_counter()
        loss = model._loss(batch)[0] if ctx["workload"] == "asr" else model.training_step(batch, 0)
        forwards.append(time.perf_counter() - t0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if lockstep:
        dist.barrier(group=ctx["group"])
    return (sorted(times[1:])[len(times[1:]) // 2], sorted(forwards[1:])[len(forwards[1:]) // 2])


def setup(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """Process groups (default, evaluation, this node's), data, sizes: the shared context."""
    timeout = timedelta(seconds=float(spec["pg_timeout_s"]))
    dist.init_process_group("gloo", timeout=timeout)  # Lightning reuses it
    rank, world = dist.get_rank(), dist.get_world_size()
    procs = int(spec["procs"])
    group = dist.new_group(backend="gloo", timeout=timeout)
    node_group, _ = dist.new_subgroups(group_size=procs, backend="gloo", timeout=timeout)
    batch = int(spec["batch_size"])
    ctx: dict[str, Any] = {
        "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "procs": procs, "nodes": int(spec["nodes"]), "torchft": spec.get("torchft"),
        "iface": os.environ["GLOO_SOCKET_IFNAME"], "timeout": timeout, "out": out,
        "group": group, "node_group": node_group, "workload": spec["workload"],
        "higher_is_better": spec["workload"] != "asr",
        "eval_steps": max(1, round(int(spec["eval_every"]) / (batch * world))),
        "warmup": int(spec["warmup"]), "slow_extra_s": None, "load0": load(),
        "seed": int(spec.get("seed", 0)),
    }
    if spec["workload"] == "asr":
        ctx["data"] = asr_workload.load(spec, rank, world)
        num_train = ctx["data"]["num_train"]
    else:
        ctx["train"], ctx["x_val"], ctx["y_val"] = digits_80_20()
        num_train = len(ctx["train"])
    per_rank = -(-num_train // world)
    ctx["steps_per_epoch"] = -(-per_rank // batch)
    if spec.get("slow_node") is not None:
        set_handicap(spec, ctx)
    return ctx


def _slow_node_median(spec: dict[str, Any], ctx: dict[str, Any], mine: float) -> float:
    """Every rank's ``mine`` gathered (collective); the slow node's ranks' median."""
    world, procs = ctx["world"], ctx["procs"]
    steps = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(steps, torch.tensor([mine], dtype=torch.float64), group=ctx["group"])
    slow = int(spec["slow_node"])
    node = sorted(float(t[0]) for t in steps[slow * procs:(slow + 1) * procs])
    ctx["calibration_steps_s"] = [round(float(t[0]), 4) for t in steps]  # recorded per case
    return node[len(node) // 2]


def slow_node_step(spec: dict[str, Any], ctx: dict[str, Any]) -> float:
    """The slow node's median local step with every rank computing (lockstep; collective)."""
    return _slow_node_median(spec, ctx, calibrate(spec, ctx)[0])


def alone_step(spec: dict[str, Any], ctx: dict[str, Any]) -> float:
    """The slow node's median local step with nothing else computing: its ranks measure one
    at a time while every other rank waits in a barrier (collective; every rank gets it)."""
    procs, slow = ctx["procs"], int(spec["slow_node"])
    mine = 0.0
    for r in range(slow * procs, (slow + 1) * procs):
        if ctx["rank"] == r:
            mine = calibrate(spec, ctx, lockstep=False)[0]
        dist.barrier(group=ctx["group"])
    return _slow_node_median(spec, ctx, mine)


def set_handicap(spec: dict[str, Any], ctx: dict[str, Any]) -> None:
    """The fixed handicap: ``spec['slow_extra_s']``, or (None) the slow node's local step with
    every rank computing, calibrated once, here, before the first case, with its step alone
    (``spec['slow_calibration']`` when a first launch calibrated them); the slow node's ranks
    sleep it per step."""
    calibration = spec.get("slow_calibration")
    if calibration is None:
        calibration = {"contended_s": slow_node_step(spec, ctx),
                       "alone_s": alone_step(spec, ctx)}
    extra = spec.get("slow_extra_s")
    ctx["slow_calibration"] = calibration
    ctx["slow_extra_s"] = float(calibration["contended_s"] if extra is None else extra)
    slow = int(spec["slow_node"])
    ctx["sleep_s"] = ctx["slow_extra_s"] if ctx["rank"] // ctx["procs"] == slow else 0.0


def achieved_local_step(spec: dict[str, Any], ctx: dict[str, Any]) -> float:
    """The slow node's local step under training's contention, now, for the case about to run
    (collective): its step alone, measured now, times the contention factor of the
    calibration (contended over alone step). Measured with every rank computing, even in
    lockstep on the same batches, the slow node's step ranged over 0.27-0.45 s between the
    four cases of one run (the second slow-node race, run 0): too noisy for the check's 10 %.
    Measured alone, it changes with the machine's own speed (other load), which is what the
    check is for."""
    calibration = ctx["slow_calibration"]
    ctx["slow_alone_s"] = alone_step(spec, ctx)
    return calibration["contended_s"] * ctx["slow_alone_s"] / calibration["alone_s"]


def measure_comm_compute(spec: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """R and its two terms for this launch (collective; ``benchmarks/race/comm_compute.py``):
    the lockstep compute step of the race's model (its optimizer's step) and a bf16 replica's
    time on the link."""
    step_s = calibrate(spec, ctx, adamw=ctx["workload"] == "asr")[0]
    params = sum(p.numel() for p in net_of(make_model(spec, ctx)).parameters())
    return comm_compute.measure(ctx["group"], ctx["rank"], ctx["world"], ctx["procs"],
                                ctx["nodes"], params, step_s)


def main(spec_path: Path) -> None:
    """Run the race's cases in order on this rank; rank 0 writes one result file per case."""
    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    out = spec_path.parent
    ctx = setup(spec, out)
    if spec.get("measure_comm_compute", True):
        ctx["comm_compute"] = measure_comm_compute(spec, ctx)
        if ctx["rank"] == 0:
            print(f"[race] R: {ctx['comm_compute']}", flush=True)
    target, budget_s = spec.get("target"), spec.get("budget_s")
    sign = 1.0 if ctx["higher_is_better"] else -1.0
    for case in spec["cases"]:
        dist.barrier(group=ctx["group"])
        if spec.get("slow_node") is not None:
            # the handicap stays fixed; its achieved slowdown is measured before every case
            ctx["slow_local_step_s"] = achieved_local_step(spec, ctx)
        print(f"[race rank {ctx['rank']}] case {case['name']}", flush=True)
        ctx["load0"] = load()
        res = run_case(ctx, spec, case, target, budget_s)
        if case["name"] == "ddp":
            if target is None:  # the slack makes the target easier: below (WER: above)
                target = res["final_metric"] - sign * float(spec["slack"])
            if budget_s is None:
                budget_s = float(spec["budget_factor"]) * res["train_s"]
        res.update(target=target, budget_s=budget_s)
        if ctx["rank"] == 0:
            (out / case["name"]).mkdir(parents=True, exist_ok=True)
            tmp = out / case["name"] / ".result.json"
            tmp.write_text(json.dumps(res))
            tmp.rename(out / case["name"] / "result.json")  # the driver sees whole files only
    dist.barrier(group=ctx["group"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
