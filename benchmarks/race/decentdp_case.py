"""Decent-DP as a race case (``decentdp_*``): the closest like-for-like gossip library.

Decent-DP (``decent-dp`` on PyPI, pinned in the ``race`` extra; never a dependency of the
library; ICLR 2025, "From Promise to Practice: Realizing High-performance Decentralized
Training") wraps a module in ``DecentralizedDataParallel``: it traces the parameters' order in
the first step, then fuses each bucket's optimizer step into the backward pass (a
post-accumulate-grad hook on the bucket's last parameter) and overlaps the bucket's gossip with
the next step's compute (the mixing of step ``t``'s exchange is applied at step ``t + 1``).

Set up as its own documentation and the paper's experiment configurations recommend
(WangZesen/Decentralized-Training-Exp: ``backend = "decentdp"``, ``topology =
"alternating-exp-ring"``, optimizer ``accumadamw``/``accumadam``): the multi-node topology
``alternating-exp-ring`` (on 2 nodes: a node-local average and a global one, alternately;
``decentdp_ring`` races its one-peer ``ring`` for comparison), the decentralized Adam with
gradient accumulation of its ``optim_fn_accum_adamw`` (``accum_iter`` = its default 4, the
number of workers here, as its docstring asks it to scale), its own bucket size (25 MB), its
gradient clipping (the race's 5.0, per bucket, applied by Decent-DP since it steps the
optimizers itself). Every case's common parts stay: the race's weight decay (0), its warm-up
(``recipes.asr.schedule.lr_factor``, as a per-bucket LR scheduler) and its per-learner rule
(one learner per rank: ``rules.learners``).

Lightning integration: :class:`DecentDPStrategy` is Lightning's ``DDPStrategy`` that wraps
the module in ``DecentralizedDataParallel`` instead of torch's DDP (no gradient all-reduce).
Lightning's own optimizer is built at a zero rate (the worker's ``make_model`` for this kind):
Decent-DP steps its own per-bucket optimizers inside backward and sets the gradients to None,
so Lightning's step finds no gradient. Decent-DP installs its hooks at the second step; the
first step's gradient is traced, not applied (one batch of the case's first chunk).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

KINDS = ("decentdp",)
"""Case kinds driven by Decent-DP."""

PIN = "decent-dp==0.2.3"
"""The Decent-DP release the race is set up for (the ``race`` extra of ``pyproject.toml``)."""

ACCUM_ITER = 4
"""``AccumAdamW``'s accumulation (its default; its docstring: scale it with the workers)."""


def unavailable() -> str | None:
    """None when Decent-DP imports here, else why not (with the install command)."""
    try:
        import decent_dp.ddp  # noqa: F401
    except Exception as e:  # ImportError, or a dependency missing
        return (f"decent-dp is not importable ({type(e).__name__}: {e}); install the benchmark "
                f"extra: .tools/bin/uv pip install --python .venv/bin/python -c "
                f"constraints.txt -e '.[race]' (pins {PIN})")
    return None


def _accum_adamw(params: list[tuple[str, Any]], *, lr: float, accum_iter: int) -> Any:
    """Decent-DP's decentralized Adam (``optim_fn_accum_adamw``) at the race's weight decay."""
    from decent_dp.optim import optim_fn_accum_adamw

    return optim_fn_accum_adamw(params, lr=lr, weight_decay=0.0, accum_iter=accum_iter)


def _warmup(optimizer: Any, *, warmup_steps: int) -> Any:
    """The race's warm-up (the recipe's ``lr_factor``) as a per-bucket LR scheduler."""
    import torch

    from recipes.asr.schedule import lr_factor

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, 0, warmup_steps=warmup_steps))


def _sgd(params: list[tuple[str, Any]], *, lr: float) -> Any:
    """The digits workload's optimizer (SGD, momentum 0.9), per bucket."""
    import torch

    return torch.optim.SGD([p for _, p in params], lr=lr, momentum=0.9)


def make_strategy(case: dict[str, Any], timeout: timedelta, lr: float, procs: int,
                  warmup_steps: int, workload: str = "asr") -> Any:
    """The Lightning strategy of a ``decentdp`` case at peak rate ``lr`` (``digits``: the
    workload's SGD with momentum, no warm-up, in place of the decentralized Adam)."""
    if workload == "asr":
        optim_fn: Any = functools.partial(_accum_adamw, lr=lr,
                                          accum_iter=int(case.get("accum_iter", ACCUM_ITER)))
    else:
        optim_fn, warmup_steps = functools.partial(_sgd, lr=lr), 0
    from lightning.pytorch.strategies import DDPStrategy

    class DecentDPStrategy(DDPStrategy):
        """``DDPStrategy`` whose model wrapper is Decent-DP's ``DecentralizedDataParallel``."""

        def _setup_model(self, model: Any) -> Any:
            from decent_dp.ddp import DecentralizedDataParallel

            return DecentralizedDataParallel(
                model, optim_fn=optim_fn,
                lr_scheduler_fn=functools.partial(_warmup, warmup_steps=warmup_steps),
                topology=case["topology"], grad_clip_norm=5.0, _local_world_size=procs)

        def teardown(self) -> None:
            if self.model is not None and self.lightning_module is not None:
                self.model = self.lightning_module  # unwrap, as DDPStrategy does its DDP
            super().teardown()

    return DecentDPStrategy(process_group_backend="gloo", timeout=timeout)


def settle(model: Any, case: dict[str, Any]) -> None:
    """Wait for a Decent-DP case's exchanges in flight (launched at the end of a step, overlapped
    with the next): the race calls it before it stops the clock to validate, so an exchange is
    timed, and its bytes counted, on the clock and not inside the validation window. Anything
    else: nothing. (Waiting twice on a finished ``Work`` is a no-op: Decent-DP's next step waits
    on it again.)"""
    if case.get("kind") not in KINDS:
        return
    for work in getattr(model, "_comm_ops", None) or []:
        if work is not None:
            work.wait()


def expected_ratio(case: dict[str, Any], nodes: int, procs: int) -> float | None:
    """Link bytes per step over ddp's (fp32 both): ``alternating-exp-ring`` on 2 nodes
    all-reduces the whole model over every rank every other step (the other step stays in the
    node): half of ddp's ring; ``ring`` (pairs of ranks, alternating sides) pairs every rank
    of a node with one of the other node every other step: ``procs`` fp32 replicas per node
    per two steps.

    >>> expected_ratio({"topology": "alternating-exp-ring"}, 2, 2)
    0.5
    >>> round(expected_ratio({"topology": "ring"}, 2, 2), 4)  # 2 replicas / 2 steps / 1.5
    0.6667
    """
    if nodes != 2:
        return None
    world = nodes * procs
    ddp = 2 * (world - 1) / world  # replicas per node per step, ddp's ring
    if case["topology"] == "alternating-exp-ring":
        return 0.5
    if case["topology"] == "ring":
        return (procs / 2) / ddp
    return None
