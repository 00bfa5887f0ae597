"""Learning-rate schedule: linear warmup, hold, then per-epoch exponential annealing."""

from __future__ import annotations

import math


def lr_factor(step: int, epoch: int, *, warmup_steps: int = 0, warmup_start: float = 0.1,
              anneal_start_epoch: int | None = None, anneal_factor: float = 0.5**0.5) -> float:
    """Multiplier of the peak learning rate at optimizer ``step`` in ``epoch`` (both from 0).

    * steps ``0 .. warmup_steps``: linear ramp from ``warmup_start`` to 1 (large-batch and
      asynchronous training need this to stay stable, cf. Goyal et al. 2017 and the paper);
    * then 1 until epoch ``anneal_start_epoch``;
    * from then on multiplied by ``anneal_factor`` once per epoch (the paper's Switchboard
      recipe anneals by 1/sqrt(2) per epoch).
    """
    factor = 1.0
    if warmup_steps > 0 and step < warmup_steps:
        factor = warmup_start + (1.0 - warmup_start) * step / warmup_steps
    if anneal_start_epoch is not None and epoch >= anneal_start_epoch:
        factor *= anneal_factor ** (epoch - anneal_start_epoch + 1)
    return factor


def gossip_learners(strategy: object, world_size: int) -> int:
    """How many independent learners ``strategy`` trains: 1 unless it is a gossip strategy.

    Under ``dpsgd``/``adpsgd`` every rank is a learner with its own optimizer; with
    ``hierarchical=True`` a node's ranks average their gradients every step and the node is the
    learner. Any other strategy (``ddp``, one process) steps one model on the mean gradient.
    """
    from lightning_gossip.strategies import GossipStrategy

    if not isinstance(strategy, GossipStrategy):
        return 1
    if getattr(strategy, "hierarchical", False):
        return max(1, int(strategy.num_nodes))
    return max(1, world_size)


def gossip_lr_multiplier(optimizer: str, learners: int, rule: str = "auto") -> float:
    """Factor for the peak learning rate found under ``ddp`` when ``learners`` gossip.

    ``rule="auto"``: ``sqrt(learners)`` for Adam, 1 for SGD; ``"none"``: always 1.

    SGD (with momentum) is linear in the gradient: the mean of the gossip replicas takes
    exactly ``ddp``'s step, so ``ddp``'s learning rate carries over. Adam divides by the root
    of its second moment, which each learner takes of its own gradient; that gradient has
    ``learners`` times the variance of ``ddp``'s averaged one, so where the noise dominates
    the mean replica's step is ``1/sqrt(learners)`` of ``ddp``'s (measured on the demo:
    ``benchmarks/perf/parity.py``, docs/strategies.md "Equal accuracy per epoch").

    >>> gossip_lr_multiplier("adam", 4), gossip_lr_multiplier("sgd", 4)
    (2.0, 1.0)
    >>> gossip_lr_multiplier("adam", 4, rule="none"), gossip_lr_multiplier("adam", 1)
    (1.0, 1.0)
    """
    if rule not in ("auto", "none"):
        raise ValueError(f"gossip_lr_rule must be 'auto' or 'none', got {rule!r}")
    if rule == "none" or optimizer != "adam":
        return 1.0
    return math.sqrt(learners)
