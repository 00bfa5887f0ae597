"""ClaimLedger (elastic shared cursor): a lost rank's unfinished units go back to the survivors.

Threads stand in for ranks, each with its own client of one real ``TCPStore`` (the end-wait
cases use a ``HashStore``, which threads share). No Lightning launch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_gossip.cursor.batches import SharedBatchSampler
from lightning_gossip.cursor.claims import Claims
from lightning_gossip.cursor.sampler import SharedCursorSampler
from lightning_gossip.elastic.claim_ledger import ClaimLedger
from lightning_gossip.hierarchy import NodeLayout

UNITS, WORLD, VICTIM = 40, 4, 3
CLAIMED, TRAINED = 5, 2  # the victim dies holding CLAIMED - TRAINED unfinished units
WAIT = 20.0  # seconds any thread may block before the test fails


@pytest.fixture
def tcp() -> Callable[[], dist.Store]:
    """``tcp()``: a new client of one real TCPStore (one per thread, as one per rank)."""
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    return lambda: dist.TCPStore("127.0.0.1", master.port, None, False,
                                 timeout=timedelta(seconds=30))


def run_threads(targets: dict[int, Callable[[], object]]) -> dict[int, object]:
    """Run ``targets`` (rank -> function) in threads; their results, or the first error."""
    out: dict[int, object] = {}
    errors: list[BaseException] = []

    def wrap(rank: int, target: Callable[[], object]) -> None:
        try:
            out[rank] = target()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=item, daemon=True) for item in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("detect", ["step", "end"])
def test_lost_rank_units_trained_once_by_survivors(tcp, detect: str) -> None:
    """4 ranks share an epoch of 40 units; rank 3 dies holding 3 unfinished claims. Found lost
    at a training step ("step") or only while the others wait at the epoch's end ("end"), its
    unfinished units are pushed once and trained by the survivors: every unit once. The next
    epoch runs among the 3 survivors."""
    survivors = [r for r in range(WORLD) if r != VICTIM]
    go, dead = threading.Event(), threading.Event()
    lock = threading.Lock()
    trained_total = [0]
    victim_claims: list[int] = []
    returned: dict[int, list[int]] = {}

    def survivor(rank: int) -> dict[int, list[int]]:
        handled = threading.Event()

        def live() -> list[int]:
            return survivors if handled.is_set() else list(range(WORLD))

        def recover() -> None:  # the strategy's heartbeat check, on a loss
            if dead.is_set() and not handled.is_set():
                returned[rank] = ledger.return_units(0, VICTIM)
                handled.set()

        ledger = ClaimLedger(tcp(), "run", rank, live, on_wait=recover, poll_s=0.01,
                             timeout=WAIT)
        claims = Claims(ledger.store, "run", ledger=ledger)
        finished: dict[int, list[int]] = {0: [], 1: []}
        for epoch in (0, 1):
            ledger.open(epoch)  # (the strategy's epoch-start hook)
            while (unit := claims.next(epoch, UNITS)) is not None:
                time.sleep(0.002)  # training
                finished[epoch].append(unit)
                ledger.record_finished(epoch)
                with lock:
                    trained_total[0] += 1
                    if trained_total[0] == 9:
                        go.set()  # the victim claims while the others are mid-epoch
                if epoch == 0 and go.is_set():
                    assert dead.wait(WAIT)  # (so the survivors cannot drain the epoch first)
                if detect == "step" and epoch == 0:
                    recover()
        return finished

    def victim() -> None:
        ledger = ClaimLedger(tcp(), "run", VICTIM, lambda: list(range(WORLD)))
        claims = Claims(ledger.store, "run", ledger=ledger)
        assert go.wait(WAIT)
        for _ in range(CLAIMED):
            victim_claims.append(claims.next(0, UNITS))
        for _ in range(TRAINED):
            ledger.record_finished(0)
        dead.set()  # it stops here, holding its other claims

    results = run_threads({**{r: (lambda r=r: survivor(r)) for r in survivors}, VICTIM: victim})
    unfinished = victim_claims[TRAINED:]
    assert len(victim_claims) == CLAIMED and len(unfinished) == CLAIMED - TRAINED
    # every survivor's return_units gave the same list: the victim's unfinished claims
    assert returned == {r: unfinished for r in survivors}
    epoch0 = [u for r in survivors for u in results[r][0]] + victim_claims[:TRAINED]
    assert sorted(epoch0) == list(range(UNITS))  # every unit once, none twice
    assert sorted(u for r in survivors for u in results[r][1]) == list(range(UNITS))
    reader = ClaimLedger(tcp(), "run", 0, lambda: survivors)
    assert reader.returned(0) == unfinished  # pushed once
    assert reader.unfinished(0, VICTIM) == unfinished
    assert all(reader.unfinished(e, r) == [] for e in (0, 1) for r in survivors)
    assert reader.returned(1) == []


def test_return_units_pushes_once_when_all_call_at_once(tcp) -> None:
    store = tcp()
    dying = ClaimLedger(store, "run", 3, lambda: [0, 1, 2, 3])
    for unit in (7, 2, 9, 4):
        dying.record_claim(5, unit)
    dying.record_finished(5)
    start = threading.Barrier(3)

    def call(rank: int) -> list[int]:
        ledger = ClaimLedger(tcp(), "run", rank, lambda: [0, 1, 2], poll_s=0.005)
        start.wait()
        first = ledger.return_units(5, lost=3)
        return [first, ledger.return_units(5, lost=3)]  # again: idempotent

    out = run_threads({r: (lambda r=r: call(r)) for r in range(3)})
    assert all(lists == [[2, 9, 4], [2, 9, 4]] for lists in out.values())
    assert dying.returned(5) == [2, 9, 4]
    assert int(store.add("run/epoch5/returned_by/3", 0)) == 6  # all six calls, one push


def test_take_returned_hands_each_unit_to_one_rank(tcp) -> None:
    pusher = ClaimLedger(tcp(), "run", 0, lambda: [0])
    lost = ClaimLedger(pusher.store, "run", 9, lambda: [0])
    for unit in range(20):
        lost.record_claim(0, unit)
    assert pusher.return_units(0, lost=9) == list(range(20))
    start = threading.Barrier(4)

    def take(rank: int) -> list[int]:
        ledger = ClaimLedger(tcp(), "run", rank, lambda: [0])
        start.wait()
        return list(iter(lambda: ledger.take_returned(0), None))

    out = run_threads({r: (lambda r=r: take(r)) for r in range(4)})
    assert sorted(u for units in out.values() for u in units) == list(range(20))


def waiter(ledger: ClaimLedger, epoch: int) -> tuple[threading.Thread, list[object]]:
    """``ledger.wait_at_end(epoch)`` in a thread; its result (or error) lands in the list."""
    result: list[object] = []

    def run() -> None:
        try:
            result.append(ledger.wait_at_end(epoch))
        except Exception as e:  # noqa: BLE001
            result.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_end_wait_until_every_live_rank_arrives() -> None:
    store = dist.HashStore()
    a = ClaimLedger(store, "run", 0, lambda: [0, 1], poll_s=0.01, timeout=WAIT)
    b = ClaimLedger(store, "run", 1, lambda: [0, 1], poll_s=0.01, timeout=WAIT)
    a.open(0), b.open(0)
    ca, cb = Claims(store, "run", ledger=a), Claims(store, "run", ledger=b)
    assert (ca.next(0, 2), cb.next(0, 2)) == (0, 1)
    assert (a.arrived, b.arrived) == (None, None)
    thread, result = waiter(a, 0)  # rank 0 found the counter exhausted: it waits
    thread.join(0.3)
    assert thread.is_alive() and not result and a.arrived == 0  # (it begins no admission)
    assert cb.next(0, 2) is None  # rank 1 arrives too: both leave
    thread.join(WAIT)
    assert result == [None] and (a.arrived, b.arrived) == (0, 0)


def test_end_wait_takes_a_returned_unit_then_waits_again() -> None:
    store, live = dist.HashStore(), [0, 1, 2]
    lost = threading.Event()

    def recover() -> None:  # rank 0's heartbeat check finds rank 2 lost
        if lost.is_set() and 2 in live:
            a.return_units(0, lost=2)
            live.remove(2)

    a = ClaimLedger(store, "run", 0, lambda: live, on_wait=recover, poll_s=0.01, timeout=WAIT)
    b = ClaimLedger(store, "run", 1, lambda: live, poll_s=0.01, timeout=WAIT)
    c = ClaimLedger(store, "run", 2, lambda: live)
    a.open(0), b.open(0), c.open(0)
    ca, cb, cc = (Claims(store, "run", ledger=x) for x in (a, b, c))
    assert (ca.next(0, 3), cb.next(0, 3), cc.next(0, 3)) == (0, 1, 2)
    ca_next: list[object] = []
    thread = threading.Thread(target=lambda: ca_next.append(ca.next(0, 3)), daemon=True)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # waiting at the end: ranks 1 and 2 still hold claims
    lost.set()  # rank 2 dies before finishing unit 2
    thread.join(WAIT)
    assert ca_next == [2]  # rank 0 took it (and recorded the claim as its own)
    assert a.claimed(0, 0) == [0, 2]
    assert not store.check(["run/epoch0/arrived/0"])  # it left the end while it trains unit 2
    assert a.arrived is None
    thread, result = waiter(a, 0)
    assert cb.next(0, 3) is None  # rank 1 arrives; rank 2 no longer counts
    thread.join(WAIT)
    assert result == [None]


def test_end_wait_times_out_naming_the_missing_ranks() -> None:
    store = dist.HashStore()
    ledger = ClaimLedger(store, "run", 0, lambda: [0, 1, 2], poll_s=0.01, timeout=0.2)
    store.set("run/epoch0/arrived/2", "1")  # rank 2 arrived; rank 1 never does
    ledger.open(0)
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not reach the end of epoch 0"):
        ledger.wait_at_end(0)


def test_before_its_epoch_opened_a_rank_arrives_without_waiting() -> None:
    """Lightning draws an epoch's first batch while it sets the loader up, before the epoch-start
    hook (``open``): a rank that finds the units all taken there arrives and leaves at once
    (its peers meet it at the epoch's start); once the epoch is open it waits."""
    store = dist.HashStore()
    ledger = ClaimLedger(store, "run", 0, lambda: [0, 1], poll_s=0.01, timeout=0.2)
    assert ledger.wait_at_end(0) is None
    assert store.check(["run/epoch0/arrived/0"])
    ledger.open(0)
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not reach"):
        ledger.wait_at_end(0)


def test_without_a_ledger_the_store_holds_the_counter_only() -> None:
    store = dist.HashStore()
    claims = Claims(store, "run")
    assert [claims.next(0, 3) for _ in range(4)] == [0, 1, 2, None]
    assert store.num_keys() == 1 and int(store.add("run/epoch0", 0)) == 4


def test_a_lost_nodes_claims_go_back_whole_to_a_live_node() -> None:
    """Two nodes of 2 ranks claim as nodes (hierarchical adpsgd): each node's local rank 0 is
    its claimant in the ledger (ranks 0 and 2), its other rank reads the node's claims. Node 1
    dies after training one of its two claims (units 2-3 trained, 4-5 not): the live node
    takes the untrained claim back whole (both of its ranks, units 4 and 5), then both of its
    ranks end the epoch together once its claimant finds nothing left."""
    store, live = dist.HashStore(), [0, 2]
    ledgers = {r: ClaimLedger(store, "run", r - r % 2, lambda: live, poll_s=0.01, timeout=WAIT)
               for r in range(4)}
    claims = {r: Claims(store, "run", NodeLayout(num_nodes=2, devices=2, node=r // 2,
                                                  local=r % 2), ledgers[r]) for r in range(4)}
    for ledger in ledgers.values():
        ledger.open(0)
    units = 8  # 4 node claims
    assert [claims[r].next(0, units) for r in range(4)] == [0, 1, 2, 3]
    assert [claims[r].next(0, units) for r in (2, 3, 0, 1)] == [4, 5, 6, 7]
    ledgers[2].record_finished(0)  # node 1 trained claim 1 (units 2, 3) and died
    live.remove(2)
    assert ledgers[0].return_units(0, lost=2) == [2] and ledgers[0].return_units(0, lost=3) == []
    assert [claims[r].next(0, units) for r in (0, 1)] == [4, 5]  # claim 2, whole
    ends = run_threads({r: lambda r=r: claims[r].next(0, units) for r in (1, 0)})
    assert ends == {0: None, 1: None}
    assert ledgers[0].claimed(0, 0) == [0, 3, 2] and not store.check(["run/epoch0/claims/1"])


def test_a_lockstep_nodes_ranks_wait_at_the_end_equally_often() -> None:
    """Hierarchical dpsgd (a ledger with ``lockstep=True``): each wait at an epoch's end is a
    gossip-only round, a collective of the node's ranks, so they must make the same number of
    them. Node 0's claimant (rank 0) waits for node 1's (rank 2), which arrives 0.3 s later;
    its node-mate (rank 1) makes one wait per wait rank 0 announced, and both end together."""
    store, live = dist.HashStore(), [0, 2]
    calls = {0: 0, 1: 0}

    def counted(rank: int) -> Callable[[], None]:
        def on_wait() -> None:
            calls[rank] += 1
            time.sleep(0.002 if rank == 0 else 0.02)  # the node-mate's waits are slower
        return on_wait

    ledgers = {r: ClaimLedger(store, "run", r - r % 2, lambda: live, on_wait=counted(r),
                              poll_s=0.01, timeout=WAIT, lockstep=True) for r in (0, 1)}
    claims = {r: Claims(store, "run", NodeLayout(2, 2, 0, r), ledgers[r]) for r in (0, 1)}
    other = ClaimLedger(store, "run", 2, lambda: live, poll_s=0.01, timeout=WAIT)
    for ledger in (*ledgers.values(), other):
        ledger.open(0)
    assert [claims[r].next(0, 2) for r in (0, 1)] == [0, 1]  # the epoch's only claim

    def arrive_late() -> None:
        time.sleep(0.3)
        assert other.wait_at_end(0) is None

    ends = run_threads({0: lambda: claims[0].next(0, 2), 1: lambda: claims[1].next(0, 2),
                        2: arrive_late})
    assert ends == {0: None, 1: None, 2: None}
    assert calls[0] > 3 and calls[1] == calls[0], calls


def test_a_rejoined_nodes_claims_are_keyed_by_its_incarnation() -> None:
    """A node whose processes were admitted in generation 2 (the ledger's ``incarnation``)
    claims under keys of its own: the claim its earlier processes left under the same counter
    (``node0/claim0``) is not read again, so its other rank takes the unit its leader claimed."""
    store, live = dist.HashStore(), [0]
    store.set("run/epoch0/node0/claim0", "3")  # the node's earlier processes' first claim
    ledgers = {r: ClaimLedger(store, "run", 0, lambda: live, poll_s=0.01, timeout=WAIT,
                              incarnation=2) for r in (0, 1)}
    claims = {r: Claims(store, "run", NodeLayout(1, 2, 0, r), ledgers[r]) for r in (0, 1)}
    for ledger in ledgers.values():
        ledger.open(0)
    assert [claims[r].next(0, 4) for r in (0, 1)] == [0, 1]
    assert store.get("run/epoch0/node0.2/claim0") == b"0"


def test_the_samplers_draw_through_the_ledger() -> None:
    store = dist.HashStore()
    cursor = SharedCursorSampler(10, 4, store, "cur", seed=1,
                                 ledger=ClaimLedger(store, "cur", 0, lambda: [0]))
    assert sorted(cursor) == list(range(10)) and cursor.claims.ledger is not None
    assert cursor.claims.ledger.claimed(0, 0) == [0, 1, 2]
    batches = SharedBatchSampler(lambda e: [[0, 1], [2], [3, 4]], store, "bat",
                                 ledger=ClaimLedger(store, "bat", 0, lambda: [0]))
    assert list(batches) == [[0, 1], [2], [3, 4]]
    assert batches.claims.ledger.claimed(0, 0) == [0, 1, 2]


def test_shared_cursor_loader_passes_the_ledger_on() -> None:
    """Both kinds of rebuilt loader draw through the ledger (their claims are recorded)."""
    from torch.utils.data import DataLoader

    from lightning_gossip.strategies.shared_loader import shared_cursor_loader

    class Listed:  # a batch sampler that lists its epoch's batches
        def shared_batches(self, epoch: int) -> list[list[int]]:
            return [[0, 1, 2], [3, 4], [5]]

        def __iter__(self):  # (its own sharded iteration, unused here)
            return iter(self.shared_batches(0))

    store = dist.HashStore()
    for key, loader in [("plain", DataLoader(list(range(6)), batch_size=4)),
                        ("listed", DataLoader(list(range(6)), batch_sampler=Listed()))]:
        ledger = ClaimLedger(store, f"ledger/{key}", 0, lambda: [0])
        shared = shared_cursor_loader(loader, key=key, store=store, ledger=ledger)
        assert shared is not None and shared.claims.ledger is ledger
        assert sorted(int(i) for batch in shared.loader for i in batch) == list(range(6))
        assert sorted(ledger.claimed(0, 0)) == list(range(2 if key == "plain" else 3))


def test_forget_deletes_this_ranks_records_of_an_epoch() -> None:
    store = dist.HashStore()
    mine = ClaimLedger(store, "run", 0, lambda: [0])
    other = ClaimLedger(store, "run", 1, lambda: [0])
    for ledger in (mine, other):
        ledger.record_claim(0, ledger.rank)
        ledger.record_finished(0)
    assert mine.wait_at_end(0) is None
    keys = store.num_keys()
    mine.forget(0)
    assert store.num_keys() == keys - 3
    assert (mine.claimed(0, 0), mine.finished(0, 0)) == ([], 0)
    assert (mine.claimed(0, 1), mine.finished(0, 1)) == ([1], 1)  # the other rank's stay


def test_a_sampler_forgets_the_epoch_before_last_when_it_starts_an_epoch() -> None:
    """The store keeps this rank's records of two epochs at most (the current and the last)."""
    store = dist.HashStore()
    ledger = ClaimLedger(store, "run", 0, lambda: [0])
    sampler = SharedCursorSampler(8, chunk_size=2, store=store, key="run", ledger=ledger)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        assert sorted(sampler) == list(range(8))
        for _ in range(4):
            ledger.record_finished(epoch)
        remembered = [e for e in range(epoch + 1) if ledger.claimed(e, 0)]
        assert remembered == list(range(max(0, epoch - 1), epoch + 1)), (epoch, remembered)
