"""When synchronous gossip exchanges: :class:`RoundSchedule`, the rounds of a communication
budget (``gossip_every_n_steps``).

With a period ``n`` the ranks take ``n`` local optimizer steps per gossip round. The round of
period ``k`` belongs to its last step ``e = k n + n - 1`` (the *exchange step*) and mixes with
exactly ``topology.mixing_matrix(e)``; the steps in between exchange nothing. Where the round is
posted and where its change is added depend on the form:

* **overlap**: posted at the start of the period's first step ``s = e - n + 1`` (a snapshot of
  ``x_s``), its change ``W_e x_s - x_s`` added after the optimizer step of ``e``: the exchange
  hides behind ``n`` steps of computation. ``n = 1``: D-PSGD's overlapped step.
* **blocking** (``overlap=False``): posted after the optimizer step of ``e`` and applied at once
  (``x <- W_e x'``).
* **delay_by_one**: as overlap, the change added one step later (after the step ``e + 1``).

Every rank computes the same schedule from the step number, so no message says when a round is.

>>> s = RoundSchedule(period=4)
>>> [t for t in range(12) if s.is_round(t)], s.started_at(4), s.post_step(7), s.apply_step(7)
([3, 7, 11], 7, 4, 7)
>>> RoundSchedule(4, overlap=False).post_step(7), RoundSchedule(4, delay_by_one=True).apply_step(7)
(7, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gossip.topology import Topology, is_connected

__all__ = ["RoundSchedule"]


@dataclass(frozen=True)
class RoundSchedule:
    """The steps of synchronous gossip's rounds (pure arithmetic on step numbers).

    Args:
        period: local optimizer steps per round (``gossip_every_n_steps``, at least 1).
        overlap: the round is posted at the period's first step (else after its last step).
        delay_by_one: its change is added one step after the exchange step (implies
            ``overlap``).
    """

    period: int = 1
    overlap: bool = True
    delay_by_one: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.period, int) or isinstance(self.period, bool) or self.period < 1:
            raise ValueError(f"the gossip period must be a positive integer, got {self.period!r}")
        if self.delay_by_one and not self.overlap:
            object.__setattr__(self, "overlap", True)

    def is_round(self, step: int) -> bool:
        """Whether ``step`` is an exchange step (the last step of a period)."""
        return (step + 1) % self.period == 0

    def started_at(self, step: int) -> int | None:
        """(``overlap``) the exchange step of the round posted before the local step ``step``,
        or ``None`` when none is (not a period's first step, or blocking)."""
        if not self.overlap or step % self.period:
            return None
        return step + self.period - 1

    def post_step(self, round_step: int) -> int:
        """The step at which the round of ``round_step`` is posted (at its start: overlap;
        after its local step: blocking)."""
        return round_step - self.period + 1 if self.overlap else round_step

    def apply_step(self, round_step: int) -> int:
        """The step after whose local step the round's change is added."""
        return round_step + (1 if self.delay_by_one else 0)

    def first_round_posted_from(self, step: int) -> int:
        """The exchange step of the first round posted at ``step`` or later."""
        n = self.period
        first = step + n - 1 if self.overlap else step  # the earliest exchange step to post
        return first + (-(first + 1)) % n

    def check_connects(self, topology: Topology) -> None:
        """Raise ``ValueError`` when the exchange steps of a periodic topology never connect the
        ranks: a period that shares a factor with the topology's own cycle (e.g. 4 on
        ``one_peer_exponential`` over 4 ranks, whose odd steps all use the same hop) mixes
        with some of its matrices only."""
        cycle = getattr(topology, "period", None)
        if self.period == 1 or not topology.is_time_varying or not isinstance(cycle, int):
            return  # static, or random (every step's graph connects): any steps connect
        rounds = [k * self.period + self.period - 1 for k in range(cycle)]
        union = sum(topology.mixing_matrix(e) for e in rounds)
        if not is_connected(union):
            raise ValueError(
                f"gossip_every_n_steps={self.period} exchanges only at steps "
                f"{rounds[:3]}... of {topology.name!r} over {topology.world_size} ranks, whose "
                f"matrices repeat every {cycle} steps: those rounds never connect the ranks. "
                f"Choose a period that shares no factor with {cycle}, or another topology")
