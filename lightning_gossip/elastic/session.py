"""What a gossip fit's parts read when they act: :class:`ElasticSession`, the one collaborator
of every part that the membership of the fit can change.

A gossip strategy owns one session (``strategy.session``). It holds the optimizer step ``t``
(the step of the topology's ``W_t``, the step the survivors of a loss agree on), the fit's
gossip engine, and, in an elastic fit, the :class:`~lightning_gossip.elastic.membership.
Membership` (the live ranks and their generation) and the process groups of its generation, by
name (:class:`~lightning_gossip.elastic.nodes.ElasticGroups`). The parts never get or set
these through callables handed to them: they read the session when they act, and what changes
them (the strategy's step, the survivors' recovery and admissions) goes through the session's
methods, so a new engine or new groups after a loss reach every part at once, as torchft's
algorithms read its ``Manager`` after it reconfigured their process groups. The session imports
no Lightning; it knows nothing of the strategy that owns it.

Example::

    >>> session = ElasticSession()
    >>> session.step, session.engine, session.group, session.generation
    (0, None, None, 0)
    >>> session.move_to(5)
    >>> session.swap_engine("engine A"), session.swap_engine(None), session.step
    (None, 'engine A', 5)
"""

from __future__ import annotations

from typing import Any

from lightning_gossip.elastic.membership import Membership
from lightning_gossip.elastic.nodes import ElasticGroups

__all__ = ["ElasticSession"]


class ElasticSession:
    """The step, the engine, and (elastic) the membership and groups of a fit (see the module
    docstring).

    Args:
        step: the optimizer step the session starts at.
    """

    def __init__(self, step: int = 0) -> None:
        #: the optimizer step: steps taken so far, the ``t`` of the mixing matrix ``W_t``
        self.step = int(step)
        #: the fit's gossip engine (``None``: none yet, or nothing to gossip with)
        self.engine: Any = None
        #: an elastic fit's live ranks and generation (``None``: not elastic, or not yet)
        self.membership: Membership | None = None
        #: the process groups of the membership's generation, by name (``None``: the fit's
        #: start groups are the strategy's own)
        self.groups: ElasticGroups | None = None

    def move_to(self, step: int) -> None:
        """The next optimizer step is ``step`` (the strategy's count, or the step the survivors
        of a loss agreed on)."""
        self.step = int(step)

    def current_step(self) -> int:
        """:attr:`step` (for parts that take the step as a callable)."""
        return self.step

    def swap_engine(self, engine: Any) -> Any:
        """Make ``engine`` the fit's (``None``: none); returns the one it replaces."""
        old, self.engine = self.engine, engine
        return old

    def begin(self, membership: Membership | None, groups: ElasticGroups | None = None) -> None:
        """An elastic fit begins with ``membership`` (a newcomer's or a founder's with their
        first ``groups``; ``None``: leave the elastic part, e.g. a fit that is not elastic)."""
        self.membership, self.groups = membership, groups

    def regroup(self, groups: ElasticGroups) -> None:
        """The membership's new generation built ``groups`` (after a loss or a join)."""
        self.groups = groups

    @property
    def live(self) -> tuple[int, ...] | None:
        """The live ranks (``None`` outside an elastic fit: every rank)."""
        return self.membership.live if self.membership is not None else None

    def live_ranks(self) -> tuple[int, ...]:
        """The live ranks of an elastic fit (for parts that take them as a callable)."""
        assert self.membership is not None, "only in an elastic fit"
        return self.membership.live

    @property
    def generation(self) -> int:
        """How many membership changes the fit has had (0 outside an elastic fit)."""
        return self.membership.generation if self.membership is not None else 0

    @property
    def group(self) -> Any:
        """The group of Lightning's collectives and the sync points: ``None`` (the default
        group) unless an elastic fit's membership built one (after a loss or a join, or a
        newcomer's or founder's default group)."""
        return self.membership.group if self.membership is not None else None
