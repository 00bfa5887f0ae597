"""Hierarchical AD-PSGD and its compressed wire on real processes (gloo).

The cases (``tests/multinode.py``) run in three shared launches (``tests/shared_runs.py``): 2
simulated nodes x 2 processes (torchrun ``--nnodes 2`` on loopback), 2 nodes x 1 process
(hierarchical against flat), and 1 node x 2 processes (plain data parallelism). The rank script
is ``tests/scripts/hier_cases.py`` (start offsets drawn per node for hierarchical cases).
Checks: bit-identical weights inside each node after every step, conservation of the replicas'
sum with lr = 0 (fp32 and bf16 wire, flat and hierarchical) with shrinking disagreement, the
bytes each rank sends, a short digits run, a slow node's smaller share of the batches; and,
without processes, the pairing over nodes, the sharded delta mailbox and the set-up check of
the node layout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gossip.async_gossip import DeltaMailbox
from lightning_gossip.flat import FlatState, flatten_module_
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.pairing import ColumnPairing, Pairing
from lightning_gossip.strategies import ADPSGDStrategy
from testbed.launch import ROOT, base_env, read_rank_results
from tests.cases import Case, assert_conserved_and_contracting, consensus_by_epoch
from tests.multinode import (
    AD_BF16,
    AD_FP16,
    AD_ONE_PROC_FLAT,
    AH_BALANCED,
    AH_BF16,
    AH_DELAY,
    AH_LR0,
    AH_ONE_NODE,
    AH_ONE_PROC,
    AH_STRAGGLER,
    AH_TRAIN,
    CONV_AH,
    CONV_AH_BF16,
    DEVICES,
    NODES,
    WORLD,
)
from tests.shared_runs import output

multiprocess = pytest.mark.multiprocess
TINY_NUMEL = 5 * 3 + 3 + 3 * 2 + 2  # the tiny model of tests/scripts/gossip_cases.py
TINY_BN_NUMEL = TINY_NUMEL + 4 * 3  # with BatchNorm1d(3): weight, bias, running mean/var


@pytest.fixture(scope="module")
def run(shared_run) -> Path:
    """The 2 x 2 torchrun launch (``world4`` of ``tests/shared_runs.py``)."""
    return shared_run("world4")


def _results(folder: Path, case: Case, world: int = WORLD) -> list[dict]:
    return read_rank_results(folder / case.name, world)


def _assert_identical_in_nodes(results: list[dict]) -> None:
    """``==`` between the ranks of each node: after every step, and at the end."""
    for node in range(NODES):
        ranks = results[node * DEVICES:(node + 1) * DEVICES]
        steps = [np.array(r["steps"]) for r in ranks]
        assert all(len(s) == len(steps[0]) for s in steps)
        for t in range(len(steps[0])):
            assert all((s[t] == steps[0][t]).all() for s in steps), f"node {node}, step {t}"
        finals = [np.array(r["final"]) for r in ranks]
        assert all((f == finals[0]).all() for f in finals), f"node {node}, final"


def _bytes_per_exchange(results: list[dict]) -> list[float]:
    return [r["gossip_stats"]["sent_bytes"] / r["gossip_stats"]["exchanges"] for r in results]


def _relative(x: np.ndarray) -> float:
    mean = x.mean(0)
    return float(np.mean(np.sum((x - mean) ** 2, axis=1)) / np.sum(mean**2))


# -- 2 nodes x 2 processes ----------------------------------------------------------------------
@multiprocess
@pytest.mark.parametrize("case", [AH_LR0, AH_DELAY], ids=lambda c: c.name)
def test_node_replicas_identical_and_sum_conserved(run, case):
    results = _results(run, case)
    _assert_identical_in_nodes(results)
    x0 = np.array([r["x0"] for r in results])
    assert np.abs(x0[0] - x0[DEVICES]).max() > 0.1  # the nodes started apart
    # the sum over all ranks is twice the sum over nodes: conserved, and consensus contracts
    assert_conserved_and_contracting(run / case.name, WORLD)
    # each rank sent its half of the replica (13 of 26 values, fp32) per exchange
    assert _bytes_per_exchange(results) == [4 * TINY_NUMEL / DEVICES] * WORLD


@multiprocess
@pytest.mark.parametrize("case", [AH_BF16, AD_BF16, AD_FP16], ids=lambda c: c.name)
def test_compressed_wire_keeps_the_mean_and_reaches_consensus(run, case):
    results = _results(run, case)
    hier = case.strategy_kwargs.get("hierarchical", False)
    if hier:
        _assert_identical_in_nodes(results)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    final = np.array([r["final"] for r in results], dtype=np.float64)
    drift = np.abs(final.mean(0) - x0.mean(0)).max()
    print(f"{case.name}: drift of the mean {drift:.2e}")
    assert drift < 1e-6  # fp32 rounding; bf16 rounding of the values would be ~4e-3
    d0 = _relative(x0)
    dists = consensus_by_epoch(run / case.name)
    print(f"{case.name}: consensus distance {d0:.3f} -> {dists}")
    assert d0 > 0.1 and len(dists) == 3
    assert dists[0] < 0.5 * d0 and dists[-1] < 1e-3 * d0, (d0, dists)  # down to the floor
    assert sum(r["gossip_stats"]["exchanges"] for r in results) > 0
    shard = TINY_NUMEL / DEVICES if hier else TINY_NUMEL
    assert _bytes_per_exchange(results) == [2 * shard] * WORLD  # 16-bit values


@multiprocess
def test_training_keeps_node_ranks_bit_identical(run):
    results = _results(run, AH_TRAIN)
    _assert_identical_in_nodes(results)
    # the nodes share each epoch's batches (node claims): every batch once, 2 per node step
    per_node = [results[n * DEVICES]["global_step"] for n in range(NODES)]
    assert sum(per_node) == 2 * AH_TRAIN.batches * WORLD // DEVICES, per_node
    # nodes differ: gossip, not DDP. After some steps, not at the end: with two nodes the last
    # event may be their average, which leaves both with the same replica (seen on torch 2.15.0
    # under load). Under DDP every step's replicas would be the same.
    assert any(np.abs(np.subtract(a, b)).max() > 0
               for a, b in zip(results[0]["steps"], results[DEVICES]["steps"], strict=False))
    finals = np.array([r["final"] for r in results])
    assert np.abs(finals[0] - np.array(results[0]["start_weights"])).max() > 1e-3  # it trained
    assert _bytes_per_exchange(results) == [4 * TINY_BN_NUMEL / DEVICES] * WORLD


@multiprocess
def test_hierarchical_digits_converges(run):
    acc = {c.name: _results(run, c)[0]["val_acc"] for c in (CONV_AH, CONV_AH_BF16)}
    print("digits held-out accuracy, adpsgd hierarchical (2 nodes x 2):", acc)
    assert acc["conv_ah"] > 0.9, acc
    assert acc["conv_ah_bf16"] > 0.9, acc


@multiprocess
def test_a_faster_node_takes_more_of_each_epoch(run):
    """The shared cursor is claimed per node: node 1 (slow) is not given a fixed 1/4 per rank,
    node 0 takes more batches, its ranks step together, and every sample is used once per
    epoch (before the node claims, each rank took exactly 12 of the 48 batches per epoch)."""
    results = _results(run, AH_STRAGGLER)
    n = 12 * 4 * 4  # batches x batch size x world
    assert all(len(b) == 4 for r in results for b in r["indices"])
    seen = sorted(i for r in results for b in r["indices"] for i in b)
    assert seen == sorted(list(range(n)) * 2)  # every sample exactly once in each of 2 epochs
    steps = [r["global_step"] for r in results]
    assert steps[0] == steps[1] and steps[2] == steps[3], steps  # a node steps together
    assert steps[0] >= 1.5 * steps[2], steps


@multiprocess
def test_a_balanced_end_leaves_the_last_batches_to_the_fast_node(run):
    """``shared_cursor="balanced"``: the slow node (over 4x slower) stops claiming before the
    counter runs out, in each epoch, leaving the last batches to node 0; still every sample once
    per epoch and a node's ranks step together."""
    results = _results(run, AH_BALANCED)
    n = AH_BALANCED.batches * 4 * 4
    seen = sorted(i for r in results for b in r["indices"] for i in b)
    assert seen == sorted(list(range(n)) * 2)
    steps = [r["global_step"] for r in results]
    assert steps[0] == steps[1] and steps[2] == steps[3], steps
    left_early = [r["left_early"] for r in results]  # local rank 0 decides for its node
    assert left_early[0] == left_early[1] == left_early[3] == [], left_early
    assert 1 in left_early[2], left_early  # (in epoch 0 it may not know its pace in time)


# -- other layouts ------------------------------------------------------------------------------
@multiprocess
def test_one_process_per_node_is_the_flat_strategy(shared_run):
    folder = shared_run("nodes2x1")
    hier = _results(folder, AH_ONE_PROC, world=2)
    flat = _results(folder, AD_ONE_PROC_FLAT, world=2)
    # Asynchronous gossip is not bit-reproducible between two runs (when a delta lands depends
    # on thread timing), so what is compared: the same start, the same flat path (whole
    # replicas on the wire, no node groups), the same invariants.
    assert [r["x0"] for r in hier] == [r["x0"] for r in flat]
    assert _bytes_per_exchange(hier) == _bytes_per_exchange(flat) == [4 * TINY_NUMEL] * 2
    for case in (AH_ONE_PROC, AD_ONE_PROC_FLAT):
        assert_conserved_and_contracting(folder / case.name, 2)


@multiprocess
def test_one_node_is_plain_data_parallelism(shared_run):
    folder = shared_run("world2")
    results = _results(folder, AH_ONE_NODE, world=2)
    steps = np.array([r["steps"] for r in results])
    assert steps.shape[1] == AH_ONE_NODE.batches
    assert (steps[0] == steps[1]).all()  # one replica, as with DDP
    assert np.abs(steps[0][-1] - np.array(results[0]["x0"])).max() > 1e-3  # it trained
    assert "plain data parallelism" in output(folder)  # the warning (rank 0 only)
    assert all(r["gossip_stats"] == {} for r in results)  # no gossip thread


_BAD_LAYOUT = textwrap.dedent("""
    import tempfile, torch, torch.distributed as dist
    from lightning_gossip.strategies import ADPSGDStrategy
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                            world_size=1)
    s = ADPSGDStrategy(hierarchical=True, parallel_devices=[torch.device("cpu")] * 2)
    s.num_nodes = 2  # claims 2 nodes of 2 processes; only this one process exists
    try:
        s._check_node_layout()
    except ValueError as e:
        print("ERROR:", e)
    dist.destroy_process_group()
""")


@multiprocess
def test_bad_layout_fails_at_set_up():
    out = subprocess.run([sys.executable, "-c", _BAD_LAYOUT], capture_output=True, text=True,
                         env=base_env(), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert ("ERROR: hierarchical gossip needs 2 nodes of 2 ranks each, but node 0 has 1 rank(s)"
            in out.stdout), out.stdout + out.stderr[-4000:]


# -- no processes -------------------------------------------------------------------------------
def test_column_pairing_is_the_node_pairing_in_global_ranks():
    for name in ("ring", "random"):
        nodes = Pairing(name, 5, seed=2)
        for node in range(5):
            for local in range(3):
                col = ColumnPairing(nodes, NodeLayout(5, 3, node, local))
                rank = node * 3 + local
                assert col.is_active(rank) == nodes.is_active(node)
                assert col.candidates(rank) == tuple(n * 3 + local
                                                     for n in nodes.candidates(node))
                assert col.contacted_by(rank) == tuple(n * 3 + local
                                                       for n in nodes.contacted_by(node))
                if nodes.is_active(node):
                    assert [col.partner(rank, k) for k in range(6)] == [
                        nodes.partner(node, k) * 3 + local for k in range(6)]
    with pytest.raises(ValueError, match="over 4 ranks, but there are 5 nodes"):
        ColumnPairing(Pairing("ring", 4), NodeLayout(5, 2, 0, 0))


def test_sharded_mailbox_takes_only_its_slice():
    model = torch.nn.Linear(5, 1)  # 6 values: slices [0, 3) and [3, 6)
    flat = FlatState(model)
    x = flat.pack()
    for delay in (False, True):
        box = DeltaMailbox(flat, delay_by_one=delay, shard=(3, 6))
        box.leave_snapshot(step=1)
        box.post_delta(torch.tensor([1.0, 2.0, 3.0]), covered=1)
        assert box.fresh[3:].tolist() == (x[3:] + torch.tensor([1.0, 2.0, 3.0])).tolist()
        out = torch.full((3,), 9.0)
        box.take_due(out)
        if delay:  # due one boundary later
            assert out.tolist() == [0.0] * 3
            box.take_due(out)
        assert out.tolist() == [1.0, 2.0, 3.0]
        box.take_due(out)
        assert out.tolist() == [0.0] * 3
        box.post_delta(torch.ones(3), covered=2)
        box.take_all(out, steps=2)
        assert out.tolist() == [1.0] * 3 and box.gossiped == 2
    assert torch.equal(flat.pack(), x)  # the weights are the training thread's to change


class _ZeroingMailbox(DeltaMailbox):
    """The mailbox before issue #11 (zero-filled delta buffers, snapshot = copy + adds): the
    reference the dirty-flag mailbox must match bit for bit."""

    def apply_due(self) -> None:
        if not self.delay_by_one:
            if self.acc_dirty:
                self.flat.add_(self.acc)
                self.acc.zero_()
                self.acc_dirty = False
            return
        if self.ready_dirty:
            self.flat.add_(self.ready)
            self.ready.zero_()
            self.ready_dirty = False
        if self.acc_dirty:
            self.ready, self.acc = self.acc, self.ready
            self.ready_dirty, self.acc_dirty = True, False

    def leave_snapshot(self, step: int) -> None:
        self.flat.pack(out=self.fresh)
        if self.acc_dirty:
            self.fresh.add_(self.acc)
        if self.ready_dirty:
            self.fresh.add_(self.ready)
        self.fresh_step = step
        self.fresh_ready = True

    def apply_all(self, steps: int) -> None:
        self.flat.add_(self.acc)
        self.acc.zero_()
        if self.delay_by_one:
            self.flat.add_(self.ready)
            self.ready.zero_()
        self.acc_dirty = self.ready_dirty = False
        self.fresh_ready = False
        self.gossiped = steps

    def take_due(self, out: torch.Tensor) -> None:
        out.zero_()
        lo, hi = self.lo, self.hi
        if not self.delay_by_one:
            if self.acc_dirty:
                out[:hi - lo].copy_(self.acc[lo:hi])
                self.acc.zero_()
                self.acc_dirty = False
            return
        if self.ready_dirty:
            out[:hi - lo].copy_(self.ready[lo:hi])
            self.ready.zero_()
            self.ready_dirty = False
        if self.acc_dirty:
            self.ready, self.acc = self.acc, self.ready
            self.ready_dirty, self.acc_dirty = True, False

    def take_all(self, out: torch.Tensor, steps: int) -> None:
        out.zero_()
        n = self.hi - self.lo
        out[:n].add_(self.acc[self.lo:self.hi])
        out[:n].add_(self.ready[self.lo:self.hi])
        self.acc.zero_()
        self.ready.zero_()
        self.acc_dirty = self.ready_dirty = False
        self.fresh_ready = False
        self.gossiped = steps

    def post_delta(self, delta: torch.Tensor, covered: int) -> None:
        self.acc[self.lo:self.hi].add_(delta)
        if self.fresh_ready:
            self.fresh[self.lo:self.hi].add_(delta)
        self.acc_dirty = True
        self.gossiped = max(self.gossiped, covered)


def _bits(x: torch.Tensor) -> list[int]:
    return x.float().view(torch.int32).tolist()


class _Rank:
    """One mailbox driven as the engine drives it (one rank; a sharded node of one rank adds
    its own slice as the gathered delta)."""

    def __init__(self, box_type: type[DeltaMailbox], dtype: torch.dtype, delay: bool,
                 shard: tuple[int, int] | None) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(dtype)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 4)
        flatten_module_(model)
        self.flat = FlatState(model)
        self.box = box_type(self.flat, delay_by_one=delay, shard=shard)
        self.sharded = shard is not None
        self.out = torch.full((self.box.hi - self.box.lo + 1,), 9.0)  # one value of padding
        self.steps = 0
        self.box.reset(0)

    def _add_taken(self) -> None:
        full = torch.zeros(self.flat.numel)
        full[self.box.lo:self.box.hi] = self.out[:self.box.hi - self.box.lo]
        self.flat.add_(full)

    def boundary(self) -> None:  # AsyncGossip.after_step
        self.steps += 1
        box = self.box
        if self.sharded:
            box.take_due(self.out)
            self._add_taken()
        elif box.due_now():
            box.apply_due()
        if not box.fresh_ready:
            box.leave_snapshot(self.steps)

    def exchange(self, delta: torch.Tensor) -> int:  # the gossip thread's side
        covered = self.box.take_snapshot()
        self.box.post_delta(delta[self.box.lo:self.box.hi], covered)
        return covered

    def end_phase(self) -> None:  # AsyncGossip.quiesce, then the next phase's before_step
        if self.sharded:
            self.box.take_all(self.out, self.steps)
            self._add_taken()
        else:
            self.box.apply_all(self.steps)
        self.box.reset(self.steps)

    def state(self) -> dict:
        box, lo, hi = self.box, self.box.lo, self.box.hi
        return {"weights": _bits(self.flat.pack()), "view": _bits(box.view[lo:hi]),
                "fresh": _bits(box.fresh[lo:hi]) if box.fresh_ready else None,
                "out": _bits(self.out) if self.sharded else None,
                "flags": (box.acc_dirty, box.ready_dirty, box.fresh_ready, box.fresh_step,
                          box.gossiped)}


@pytest.mark.parametrize("shard", [None, (0, 4), (4, 23)], ids=["whole", "head", "tail"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delay_by_one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mailbox_without_zeroing_matches_the_zeroing_one_bit_for_bit(shard, delay, dtype):
    """Clean delta buffers hold stale values instead of zeros, and the snapshot is packed and
    added in one pass: a random interleaving of exchanges, step boundaries and phase ends gives
    the same weights, views, snapshots and taken deltas, bit for bit, as the zeroing mailbox."""
    new, old = (_Rank(t, dtype, delay, shard) for t in (DeltaMailbox, _ZeroingMailbox))
    assert new.state() == old.state()
    g = torch.Generator().manual_seed(11)
    zeros = torch.tensor([0.0, -0.0])
    for i in range(300):
        op = torch.randint(10, (1,), generator=g).item()
        if op < 5:  # exchanges, often several between two boundaries
            delta = torch.randn(new.flat.numel, generator=g) * 2.0 ** -torch.randint(
                0, 30, (new.flat.numel,), generator=g)
            delta[torch.rand(new.flat.numel, generator=g) < 0.2] = zeros[i % 2]
            assert new.exchange(delta) == old.exchange(delta)
        elif op < 9:
            new.boundary()
            old.boundary()
        else:
            new.end_phase()
            old.end_phase()
        assert new.state() == old.state(), (i, op)
    assert new.box.acc_dirty or new.box.ready_dirty or new.steps > 0


def test_a_clean_buffer_is_overwritten_as_a_zeroed_one_would_be_added_to():
    """``post_delta`` on a clean ``acc`` writes ``0.0 + delta``: -0.0 becomes +0.0, as it did
    with zero-filled buffers, so a -0.0 weight ends +0.0 either way."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[-0.0, 1.0]]))
    box = DeltaMailbox(FlatState(model), delay_by_one=False)
    box.post_delta(torch.tensor([5.0, 6.0]), covered=0)
    box.apply_due()  # acc is clean now and still holds [5, 6]
    assert box.acc.tolist() == [5.0, 6.0] and not box.acc_dirty
    box.post_delta(torch.tensor([-0.0, 0.5]), covered=0)
    assert _bits(box.acc) == _bits(torch.tensor([0.0, 0.5]))
    model.weight.data.copy_(torch.tensor([[-0.0, 1.0]]))
    box.apply_due()
    assert _bits(model.weight.detach().reshape(-1)) == _bits(torch.tensor([0.0, 1.5]))


def test_options_and_configuration():
    s = ADPSGDStrategy(hierarchical=True, wire_dtype="bf16")
    assert s.hierarchical and s.wire_dtype == "bf16"
    assert not ADPSGDStrategy().hierarchical and ADPSGDStrategy().wire_dtype == "fp32"
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        ADPSGDStrategy(wire_dtype="int8")
    # both are compared between ranks at set-up (lightning_gossip.agreement)
    config = ADPSGDStrategy(hierarchical=True, wire_dtype="fp16").gossip_config()
    assert config["hierarchical"] is True and config["wire_dtype"] == "fp16"
