"""DDP communication hooks of the race's DDP cases, and the bytes each should send.

Lightning's ``DDPStrategy`` registers communication hooks only on CUDA (it silently skips them
on CPU), and its post-local SGD needs subgroups it leaves unset on CPU, so the race registers
them itself on the wrapped ``DistributedDataParallel`` before the first backward
(:func:`install`), and checks in the link bytes that they ran (:func:`expected_ratio`, compared
with the measured bytes per step by ``benchmarks/race/driver.py``):

* ``ddp_bf16``: torch's ``bf16_compress_hook`` (half of ddp's bytes);
* ``ddp_powersgd<R>``: torch's ``powerSGD_hook`` with ``matrix_approximation_rank=R`` as torch's
  documentation recommends (``use_error_feedback=True``, ``warm_start=True``, plain all-reduce
  for the first ``start_powerSGD_iter`` = ``--warmup`` steps); after them a matrix ``n x m``
  sends ``R (n + m)`` numbers where that compresses at least ``min_compression_rate`` (2) times,
  and vectors (biases) are all-reduced uncompressed. PowerSGD runs with **one DDP bucket**
  (``bucket_cap_mb=``:data:`SINGLE_BUCKET_MB`, set by ``worker.make_strategy``): its hook
  chains three all-reduces per bucket (uncompressed tensors, then ``P``, then ``Q``), the next
  one issued from the previous one's completion callback; with several buckets (DDP's default:
  a 1 MB first bucket, then 25 MB ones) each rank issues the buckets' chained collectives in
  the order their callbacks happen to run, gloo pairs them by issue order, and the ranks
  abort ("Received data size doesn't match expected size"; the 2x2 ASR race at 200 Mbit/s
  after about 60 steps at rank 4; reproduced on 2 ranks on loopback with a 4.8 MB MLP, at
  ranks 2 and 4, in under 300 steps, and never in 300 steps with one bucket). One bucket
  costs PowerSGD the overlap of its all-reduce with the backward pass (none of DDP's
  buckets overlaps much on CPU gloo here: the step is compute-bound);
* ``postlocal<P>``: torch's ``post_localSGD_hook`` (``PostLocalSGDState`` with this node's ranks
  as ``subgroup``, ``start_localSGD_iter`` = ``--warmup``) plus a ``PeriodicModelAverager`` of
  period ``P`` after every optimizer step (one global average every ``P`` steps: ``1/P``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

SINGLE_BUCKET_MB = 1024.0
"""DDP's ``bucket_cap_mb`` for the PowerSGD cases: every gradient in one bucket (an explicit cap
also sets the first bucket's size; see the module docstring for why)."""

MIN_COMPRESSION_RATE = 2
"""PowerSGD compresses a matrix only where it shrinks at least this many times (torch's default)."""


def powersgd_ratio(module: nn.Module, rank: int) -> float:
    """PowerSGD's numbers sent per step over plain all-reduce's, for ``module``'s parameters.

    >>> round(powersgd_ratio(nn.Linear(100, 100), 2), 4)  # 2 (100 + 100) + 100 bias
    0.0495
    """
    total = sent = 0
    for p in module.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        total += n
        if p.dim() <= 1:
            sent += n
            continue
        rows = p.shape[0]
        cols = n // rows
        compressed = rank * (rows + cols)
        sent += compressed if compressed * MIN_COMPRESSION_RATE < n else n
    return sent / total


def expected_ratio(case: dict[str, Any], module: nn.Module) -> float | None:
    """Bytes per step (after the warm-up for PowerSGD/post-local SGD) over ddp's."""
    kind = case["kind"]
    if kind == "ddp_bf16":
        return 0.5
    if kind == "ddp_powersgd":
        return powersgd_ratio(module, int(case["rank"]))
    if kind == "postlocal":
        return 1.0 / float(case["period"])
    return None


def powersgd_state(rank: int, warmup: int, seed: int = 0) -> Any:
    """torch's ``PowerSGDState`` as the race uses it (see the module docstring), its random
    projections from the run's ``seed``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    return psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=max(2, warmup),
        min_compression_rate=MIN_COMPRESSION_RATE, use_error_feedback=True, warm_start=True,
        random_seed=seed)


def install(case: dict[str, Any], trainer: Any, warmup: int, node_group: Any,
            seed: int = 0) -> Any:
    """Register ``case``'s hook on the trainer's wrapped model; the averager to call, or None."""
    kind = case["kind"]
    if kind in ("ddp", "gossip", "decentdp") or kind.startswith("torchft_"):
        # (torchft: torchft_cases.py; Decent-DP: decentdp_case.py)
        return None
    from torch.nn.parallel import DistributedDataParallel

    ddp = trainer.strategy.model
    assert isinstance(ddp, DistributedDataParallel), type(ddp)
    if kind == "ddp_bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            bf16_compress_hook,
        )

        ddp.register_comm_hook(None, bf16_compress_hook)
        return None
    if kind == "ddp_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        size = sum(p.numel() * p.element_size() for p in ddp.parameters())
        if ddp.bucket_bytes_cap < size:
            raise ValueError(f"PowerSGD needs one DDP bucket here (gloo): bucket_cap_mb="
                             f"{ddp.bucket_bytes_cap / 2**20:g} < the model's "
                             f"{size / 2**20:.2f} MB (see benchmarks.race.hooks' docstring)")
        ddp.register_comm_hook(powersgd_state(int(case["rank"]), warmup, seed),
                              psgd.powerSGD_hook)
        return None
    if kind == "postlocal":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )

        state = pls.PostLocalSGDState(process_group=None, subgroup=node_group,
                                      start_localSGD_iter=warmup)
        ddp.register_comm_hook(state, pls.post_localSGD_hook)
        return PeriodicModelAverager(period=int(case["period"]), warmup_steps=warmup)
    raise ValueError(f"unknown case kind {kind!r}")
