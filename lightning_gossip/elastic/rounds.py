"""The rounds of an elastic ``DPSGDStrategy(elastic=True)`` fit: :class:`ElasticRounds` (owned by
the strategy as ``strategy.elastic_rounds``; its Lightning side is
:mod:`lightning_gossip.strategies.dpsgd_elastic`) and the survivors' engines,
:class:`RoundEngines`.

Synchronous gossip couples every rank to this round's peers, so a lost rank stops its peers'
rounds, and theirs stop the next ones: every survivor meets the loss within a heartbeat
timeout, as a failed round (:class:`~lightning_gossip.errors.PeerSilent`) or the liveness
monitor's finding at a step boundary. Each survivor then (:class:`~.survivors.Survivors`, the
``adpsgd`` recovery, with :class:`RoundEngines`):

1. drops its rounds in flight unapplied (:meth:`~lightning_gossip.sync_gossip.SyncGossip.
   abandon`): that round's mixing is lost, the local step before it is kept;
2. agrees with the others on the live ranks, builds the new groups and returns the lost rank's
   claimed, untrained batches to the shared cursor;
3. agrees on the step the rounds go on from (the largest of the survivors' next steps: they may
   be a step or two apart), and builds the topology's graph over the survivors
   (:class:`~.member_topology.MemberTopology`, the topology re-drawn for their number with the
   membership's generation added to the seed), numbered from that step.

Data: the training loader draws from the shared cursor (as under ``adpsgd``), so the survivors
take over the rest of the epoch. Ranks may then claim different numbers of batches; a rank that
finds the epoch's batches all taken keeps running gossip-only rounds while it waits for the
others there (:meth:`ElasticRounds.wait_round`, :class:`~.claim_ledger.ClaimLedger`), and
before validation or the epoch's end every rank settles on the same step
(:class:`~.even_rounds.EvenRounds`). Mid-epoch, Lightning's collectives stay local (the ranks'
batch counts may differ by one at an epoch's end), as under ``adpsgd``.

Hierarchical (:mod:`~.nodes`): a lost rank's node leaves; the step is agreed over the column,
then over the node; the topology is built over the live nodes; a node's ranks wait at an epoch's
end in lockstep (each gossip-only round is a node collective: the ledger's ``lockstep``,
:class:`~.claim_ledger.ClaimLedger`); a node joins whole (the requests are
all-reduced over the columns, then the nodes).

Joins: once a rank was lost, a replacement started with its environment asks for the free slot
(:func:`~.newcomer.join_running_fit`, as under ``adpsgd``). Rounds couple the members, so they
must admit it at the same step: every :data:`~.joins.JOIN_CHECK_EVERY` steps
(:class:`~.joins.JoinSteps`) each member reads the requests from the store and the members
all-reduce what they saw (a maximum over one flag per rank slot, on the survivors' gloo groups);
a request any member saw is admitted by all, at that step's start
(:meth:`~.survivors.Survivors.admit`: the members' exact average and the lowest member's
checkpoint handed over). The newcomer builds the same topology over the new members
(:meth:`ElasticRounds.enter`) and its first round is that step's. No member admits while any is
in its meeting before validation or at an epoch's end (one more flag in the all-reduce): the
lowest member's checkpoint would say that the epoch's last batch is done, and the newcomer could
not tell whether the members validate next; the request waits for the next look.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_gossip.cursor.store import default_store
from lightning_gossip.elastic.engines import node_regroup
from lightning_gossip.elastic.even_rounds import EvenRounds
from lightning_gossip.elastic.joins import JoinSteps
from lightning_gossip.elastic.member_topology import MemberTopology
from lightning_gossip.elastic.nodes import ElasticGroups
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.elastic.survivors import Survivors
from lightning_gossip.errors import NewcomersAdmitted
from lightning_gossip.hierarchy import NodeGroups, NodeLayout
from lightning_gossip.topology import build

__all__ = ["ElasticRounds", "RoundEngines", "max_over_survivors"]


def max_over_survivors(groups: ElasticGroups, values: torch.Tensor) -> torch.Tensor:
    """``values`` (int64, CPU) become their maximum over the survivors: on the gloo control
    group (flat: every live rank; hierarchical: the column's, then the node's)."""
    for group in (groups.control, groups.node_control):
        if group is not None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


class RoundEngines:
    """``dpsgd``'s engines over the live ranks: the step agreed (the largest next step), the
    topology over them (hierarchical: over the live nodes) numbered from it.

    Args:
        session: the fit's session (the step agreed goes there; its generation seeds the
            topology).
        layout: the fit's nodes (hierarchical: what leaves together; the topology is over
            its ``num_nodes`` slots; flat: over its ranks).
        topology: the topology's name (rebuilt over the survivors, or their nodes) and seed.
        make: ``(topology, group, **kw)``: a synchronous engine, not started, over the
            survivors' data group (hierarchical: the rounds' group; ``kw``: ``groups``,
            ``node_gather``).
        node: hierarchical: this rank's node averaging (its all-gather; it goes on over the
            new node group); ``None``: flat.
        gather_on_worker: hierarchical: the communication thread all-gathers a sharded round
            (on the survivors' gloo node group; ``False``: NCCL, the training thread).
    """

    def __init__(self, session: ElasticSession, layout: NodeLayout,
                 topology: tuple[str, int], make: Callable[..., Any], node: Any = None,
                 gather_on_worker: bool = True) -> None:
        self.session, self.layout = session, layout
        self.topology, self.make = topology, make
        self.node, self.gather_on_worker = node, gather_on_worker

    def over(self, live: Sequence[int], groups: ElasticGroups) -> Any:
        """A started engine over ``live`` and ``groups`` (none for fewer than two units), the
        session moved to the step the survivors agreed on (see the class docstring)."""
        # (hierarchical: a node's ranks may have failed a step apart)
        common = int(max_over_survivors(groups, torch.tensor([self.session.step])).item())
        self.session.move_to(common)
        d, kw = self.layout.devices, {}
        if self.node is not None:  # hierarchical
            node_regroup(self.node, groups)
            kw = {"node_gather": self.node.all_gather, "groups": NodeGroups(
                node=groups.node, column=groups.data,
                node_gossip=groups.node_control if self.gather_on_worker else None)}
        units = sorted({r // d for r in live})  # the live ranks, or nodes
        if len(units) < 2:
            return None
        name, seed = self.topology
        base = build(name, len(units), seed + self.session.generation)
        engine = self.make(MemberTopology(base, units, self.layout.num_nodes, common),
                           groups.gossip, **kw)
        engine.start()
        return engine


class ElasticRounds:
    """The rounds of an elastic ``dpsgd`` fit around its survivors, and its end-of-epoch
    meetings (see the module docstring).

    Args:
        session: the fit's session (its step, engine and groups, read when the rounds act).
        survivors: the fit's survivors (built with ``engines``, ``poll_joins=False``).
        engines: the survivors' engines (a newcomer's and a founder's first engine too).
        run: the fit's name, the same on every rank.
        rank, world_size, timeout: this rank, the fit's rank slots, the meetings' timeout.
        end_round: ``(step)``: what follows a round in the strategy's step: the step counted
            and its periodic collectives (global average, consensus distance); also after a
            gossip-only round, so that every rank runs the same collectives.
    """

    def __init__(self, session: ElasticSession, survivors: Survivors, engines: RoundEngines, *,
                 run: str, rank: int, world_size: int, timeout: timedelta,
                 end_round: Callable[[int], None]) -> None:
        self.session, self.survivors, self.engines = session, survivors, engines
        self.run, self.world_size, self.end_round = run, world_size, end_round
        self.layout = engines.layout
        self.rounds = EvenRounds(default_store(), f"elastic/{run}/rounds", rank,
                                 live=session.live_ranks, timeout_s=timeout.total_seconds())
        #: whether this rank trains in an epoch that has not settled yet; the epoch's batches
        #: it trained; whether the fit resumed at an epoch's end (its last batch trained)
        self.in_epoch, self.batches, self.epoch_end_restored = False, 0, False
        self.settling = False  # in the meeting before validation or at the epoch's end
        self.join_steps = JoinSteps()  # when the members look for joins

    def before_step(self, step: int) -> None:
        """The engine's :meth:`~lightning_gossip.sync_gossip.SyncGossip.before_step` (start
        ``step``'s round), except that a lost peer (posting to it fails at once) makes the
        survivors go on first; the round then starts at the step they agree on, on the next
        call (the strategy's ``optimizer_step`` makes it)."""
        try:
            self.admit_joins(step)
            engine = self.session.engine
            if engine is not None:
                engine.before_step(step)
        except Exception as e:
            self.survivors.survive(e)

    def admit_joins(self, step: int) -> bool:
        """At the start of ``step`` (a multiple of :data:`~.joins.JOIN_CHECK_EVERY`, once a
        rank was lost, once per step): admit the processes any member found asking to join
        (see the module docstring); whether some were."""
        survivors, groups = self.survivors, self.session.groups
        if survivors.hand_over is None or groups is None or not self.join_steps.due(step):
            return False
        asked = survivors.asked_to_join() or ()
        flags = torch.zeros(self.world_size + 1, dtype=torch.int64)
        flags[list(asked)] = 1
        flags[-1] = self.settling  # a member at its epoch-end meeting: not now (the docstring)
        max_over_survivors(groups, flags)
        if flags[-1]:
            return False
        joined = self.layout.complete_nodes(flags[:-1].nonzero().flatten().tolist())  # whole nodes
        if joined:
            survivors.retry(survivors.admit, joined)
        return bool(joined)

    def enter(self, step: int, live: Sequence[int]) -> Any:
        """A newcomer's engine, handed ``step`` by the lowest member: the topology over ``live``
        (the session's groups: of its generation) numbered from the step agreed with the
        members (in their :meth:`admit_joins`); that step's round is its first (the members
        looked for joins at it already)."""
        assert self.session.groups is not None
        self.session.move_to(step)
        engine = self.engines.over(live, self.session.groups)
        self.join_steps.looked(self.session.step)
        self.in_epoch = True  # it joins mid-epoch
        return engine

    def found(self, live: Sequence[int]) -> Any:
        """A founder's engine (a fit started with the ranks that came, :mod:`~.founders`):
        the topology over ``live`` from the founders' common step (0)."""
        assert self.session.groups is not None
        return self.engines.over(live, self.session.groups)

    def finish(self, step: int, engine: Any) -> None:
        """After the local step of ``step``: its round (``engine``'s), then :attr:`end_round`.
        When either fails on a lost rank, the step is counted and the survivors go on without
        it, at a step they agree on; other errors are raised."""
        try:
            if engine is not None:
                engine.after_step(step)
        except Exception as e:
            self.session.move_to(step + 1)  # the round's mixing is lost, the local step kept
            self.survivors.survive(e)
            return
        try:
            self.end_round(step)
        except Exception as e:  # a periodic collective (each survivor meets the loss)
            self.survivors.survive(e)

    def pad(self, step: int) -> int:
        """One gossip-only round at ``step`` (the replica mixed, no gradient); returns the next
        step. A lost peer raises, the step counted (callers recover through
        :meth:`~.survivors.Survivors.retry`, which runs their operation again). Newcomers
        admitted at ``step``'s start raise :class:`~lightning_gossip.errors.NewcomersAdmitted`
        (the step's round not run yet)."""
        if self.admit_joins(step):
            raise NewcomersAdmitted
        engine = self.session.engine
        if engine is not None:
            engine.before_step(step)
            try:
                engine.after_step(step)
            except BaseException:
                self.session.move_to(step + 1)
                raise
        self.end_round(step)
        return self.session.step

    def pad_next(self) -> int:
        """:meth:`pad` at the session's step."""
        return self.pad(self.session.step)

    def wait_round(self) -> None:
        """The shared cursor's wait at an epoch's end: a gossip-only round, so that the ranks
        still training find this rank in their rounds (first, a loss the liveness monitor
        found is recovered from)."""
        self.survivors.poll()
        try:
            self.survivors.retry(self.pad_next)
        except NewcomersAdmitted:
            pass  # the round runs at the next wait, with the new members

    def resumed(self, at_epoch_end: bool) -> None:
        """The fit starts; ``at_epoch_end``: from a checkpoint written at an epoch's end (its
        last batch trained)."""
        self.epoch_end_restored = at_epoch_end

    def open_epoch(self, epoch: int) -> None:
        """Training epoch ``epoch`` starts on this rank."""
        self.in_epoch, self.batches, self.epoch_end_restored = True, 0, False
        self.survivors.epoch_opened(epoch)

    def batch_trained(self, epoch: int) -> None:
        """This rank trained one more batch of ``epoch``."""
        self.batches += 1
        self.survivors.batch_trained(epoch)

    def interrupted(self) -> None:
        """The fit ended in an exception: a later validate or test meets the others without
        settling the epoch."""
        self.in_epoch = False

    def settle(self, epoch: int) -> None:
        """Before validation and at the epoch's end: leave ``epoch`` at the same step as every
        live rank (:class:`~.even_rounds.EvenRounds`); once per epoch."""
        if not self.in_epoch:
            return
        self.settling = True
        try:  # named by the generation: a loss begins a new meeting (joins wait: admit_joins)
            self.survivors.retry(self._settle, epoch)
        finally:
            self.settling = False
        self.in_epoch = False

    def _settle(self, epoch: int) -> int:
        """One try at :meth:`settle`'s meeting (under the current generation's name)."""
        return self.rounds.settle(f"epoch{epoch}/gen{self.session.generation}",
                                  self.session.step, self.pad)
