"""Elastic gossip in plain loops: ``attach(..., elastic=True)`` and the Fabric strategies'
``elastic=True`` survive a rank killed mid-loop (``docs/fabric.md``, Elastic;
``lightning_gossip/elastic/loop.py``).

One launch per engine of 4 processes, started one per rank with torchrun's variables and no
agent (as a launcher that leaves the others running starts them): ranks 0 and 1 drive gossip
through the Fabric strategy, ranks 2 and 3 through ``attach()``
(``tests/scripts/elastic_loop_ranks.py``). The ``dpsgd`` launch kills an ``attach`` rank (2),
the ``adpsgd`` launch a Fabric rank (1), with ``SIGKILL``, mid-loop; learning rate 0 and
rank-dependent replicas.

Checks: the exit statuses exactly (the victim's ``SIGKILL``, 0 for every survivor, no abort at
exit); every survivor recorded the one loss and the same live ranks, and rank 0 warned naming the
lost rank; ``dpsgd``: every round before the loss is exactly ``W_t X`` over the four ranks, every
round after it exactly the survivors' ``W_t`` (the topology rebuilt over the three survivors,
numbered from the step they agreed on) over them; ``adpsgd``: the sum of the four replicas at the
first sync point is the initial sum, and after the loss the survivors' sum is kept exactly from
the last phase's start to its sync point while they gossip; the checkpoint (``fabric.save`` on
the Fabric ranks, the same sync points under ``attach``) holds the survivors' exact average, and
``finish()`` leaves it on every survivor. The options an elastic loop refuses need no process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.elastic_fuzz import EXIT_ABORT
from testbed.launch import ROOT, Launched, base_env, free_port, launch_processes

DRIVER = ROOT / "tests" / "scripts" / "elastic_loop_ranks.py"
WORLD = 4
VICTIM = {"dpsgd": 2, "adpsgd": 1}
TOPOLOGY = "one_peer_exponential"  # (the driver's)
FP32 = dict(rtol=0, atol=1e-6)


# -- without processes --------------------------------------------------------------------------
def test_fabric_classes_take_elastic() -> None:
    from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy

    for cls in (FabricDPSGDStrategy, FabricADPSGDStrategy):
        strategy = cls(elastic=True)  # (the heartbeat is on by default)
        assert strategy.elastic and strategy.gossip_options()["elastic"] is True


@pytest.mark.parametrize(("options", "match"), [
    ({"heartbeat_timeout": None}, r"elastic=True\) finds lost ranks by their heartbeat"),
    ({"hierarchical": True}, r"elastic=True, hierarchical=True\) is not offered yet"),
    ({"global_average_every_n_steps": 4}, "takes no global_average_every_n_steps"),
    ({"gossip_every_n_steps": 2}, "gossips every step"),
])
def test_elastic_refuses_what_it_cannot_do(options: dict, match: str) -> None:
    """Refused at construction (``ValueError`` naming the class or ``attach``), before any
    collective: the Fabric classes and ``attach`` (whose checks come before it needs a
    process group)."""
    import torch

    import lightning_gossip
    from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy

    for cls in (FabricDPSGDStrategy, FabricADPSGDStrategy):
        with pytest.raises(ValueError, match=f"{cls.__name__}.*{match}"):
            cls(elastic=True, **options)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for kind in ("dpsgd", "adpsgd"):
        with pytest.raises(ValueError, match=f"attach.*{match}"):
            lightning_gossip.attach(model, optimizer, strategy=kind, elastic=True,
                                    **{"heartbeat_timeout": 3.0, **options})


def test_no_process_joins_a_plain_loop() -> None:
    """``start_timeout`` (a start with the ranks that came, the latecomers joining) is the
    Trainer strategies' only: refused by name."""
    import torch

    import lightning_gossip
    from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy

    for cls in (FabricDPSGDStrategy, FabricADPSGDStrategy):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\(start_timeout=60\) is not "
                                             "offered.*no process joins a running loop"):
            cls(elastic=True, start_timeout=60)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"attach\(start_timeout=60\) is not offered"):
        lightning_gossip.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "adpsgd",
                                elastic=True, heartbeat_timeout=3.0, start_timeout=60)


def test_elastic_dpsgd_needs_a_topology_name() -> None:
    """The survivors rebuild the topology over themselves by its name."""
    import torch

    import lightning_gossip
    from lightning_gossip.fabric import FabricDPSGDStrategy
    from lightning_gossip.topology import build

    with pytest.raises(ValueError, match="by its name: give a name, not RingTopology"):
        FabricDPSGDStrategy(elastic=True, topology=build("ring", 4))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="by its name"):
        lightning_gossip.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "dpsgd",
                                elastic=True, heartbeat_timeout=3.0, topology=build("ring", 4))


# -- one launch per engine: 4 ranks, one killed -------------------------------------------------
def _launch(out: Path, kind: str) -> Launched:
    port = str(free_port())
    commands = [([sys.executable, str(DRIVER), str(out), kind, str(VICTIM[kind])],
                 base_env(RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1", GROUP_RANK=str(r), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port, TORCHELASTIC_RUN_ID="elastic-loop"))
                for r in range(WORLD)]
    launched = launch_processes(commands, timeout=400)
    assert not launched.timed_out, launched.stdout[-12000:]
    return launched


class Run:
    """One launch: its processes' exit statuses and output, every rank's records."""

    def __init__(self, kind: str, out: Path) -> None:
        self.kind, self.victim = kind, VICTIM[kind]
        self.launched = _launch(out, kind)
        self.survivors = [r for r in range(WORLD) if r != self.victim]
        #: every rank's records, in order (the victim's until it died)
        self.lines = [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text()
                       .splitlines()] for r in range(WORLD)]
        #: each survivor's summary (none from the victim)
        self.summary = {r: json.loads((out / f"rank{r}.json").read_text())
                        for r in self.survivors if (out / f"rank{r}.json").exists()}

    def tail(self) -> str:
        return self.launched.stdout[-8000:]

    def records(self, name: str, ranks: list[int]) -> list[dict]:
        """The first record called ``name`` of each of ``ranks``."""
        return [next(rec for rec in self.lines[r] if rec["what"] == name) for r in ranks]

    def rounds(self, ranks: list[int], generation: int) -> dict[int, tuple[np.ndarray, ...]]:
        """``{t: (X before, X after)}`` over ``ranks`` (rows in their order) for each step ``t``
        that every one of them ran as an iteration wholly in ``generation`` (no recovery in
        it: the step went from ``t`` to ``t + 1``)."""
        per_rank = []
        for r in ranks:
            seen = {}
            for rec in self.lines[r]:
                before = rec.get("before")
                if (rec["what"] == "iteration" and before["gen"] == rec["gen"] == generation
                        and rec["step"] == before["step"] + 1):
                    seen[before["step"]] = (before["x"], rec["x"])
            per_rank.append(seen)
        steps = sorted(set.intersection(*(set(seen) for seen in per_rank)))
        return {t: (np.array([seen[t][0] for seen in per_rank], dtype=np.float64),
                    np.array([seen[t][1] for seen in per_rank], dtype=np.float64))
                for t in steps}


@pytest.fixture(scope="module", params=["dpsgd", "adpsgd"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(request.param, tmp_path_factory.mktemp(f"elastic_loop_{request.param}"))


@pytest.mark.multiprocess
def test_the_victim_dies_of_its_signal_and_every_survivor_exits_0(run: Run) -> None:
    codes = run.launched.returncodes
    assert codes[run.victim] == -9, (codes, run.tail())
    assert [codes[r] for r in run.survivors] == [0] * len(run.survivors), (codes, run.tail())
    assert sorted(run.summary) == run.survivors, run.tail()
    assert EXIT_ABORT not in run.launched.stdout, run.tail()


@pytest.mark.multiprocess
def test_the_survivors_agree_on_the_loss(run: Run) -> None:
    """Both fronts survived (Fabric's ranks 0 and 1, attach's 2 and 3, less the victim), each
    recorded the one loss; rank 0 warned, naming the lost rank."""
    assert {run.summary[r]["front"] for r in run.survivors} == {"fabric", "attach"}
    for r in run.survivors:
        assert run.summary[r]["losses"] == [[run.victim]], run.summary[r]
        assert run.summary[r]["live"] == run.survivors, run.summary[r]
    assert f"elastic fit: rank(s) {run.victim} lost at step" in run.launched.stdout, run.tail()


@pytest.mark.multiprocess
def test_dpsgd_mixes_exactly_before_and_after_the_loss(run: Run) -> None:
    """lr=0: every round of all four ranks is ``W_t X`` of the topology over 4; after the loss
    every round of the survivors is ``W_t X`` of the topology rebuilt over them (its seed moved
    on by the generation, its rounds numbered from the step they agreed on,
    :class:`~lightning_gossip.elastic.member_topology.MemberTopology`); the survivors' replicas
    differed in several of those rounds."""
    if run.kind != "dpsgd":
        pytest.skip("dpsgd's rounds")
    from lightning_gossip.elastic.member_topology import MemberTopology
    from lightning_gossip.topology import build

    before = run.rounds(list(range(WORLD)), generation=0)
    assert len(before) >= 5, sorted(before)
    full = build(TOPOLOGY, WORLD, seed=0)
    for t, (x, mixed) in before.items():
        np.testing.assert_allclose(mixed, full.mixing_matrix(t) @ x, **FP32, err_msg=f"step {t}")
    first = {run.summary[r]["first_step"] for r in run.survivors}
    assert len(first) == 1 and None not in first, first
    topology = MemberTopology(build(TOPOLOGY, len(run.survivors), seed=0 + 1), run.survivors,
                              WORLD, first.pop())
    after = run.rounds(run.survivors, generation=1)
    assert len(after) >= 6, sorted(after)  # (phase 3's six at least)
    rows = np.ix_(run.survivors, run.survivors)
    for t, (x, mixed) in after.items():
        np.testing.assert_allclose(mixed, topology.mixing_matrix(t)[rows] @ x, **FP32,
                                   err_msg=f"step {t}")
    # nothing trivial: the survivors' replicas differed (the offset of the last phase) in
    # several of the rounds checked
    apart = [np.abs(x - x.mean(0)).max() > 1e-3 for x, _ in after.values()]
    assert sum(apart) >= 3, apart


@pytest.mark.multiprocess
def test_adpsgd_keeps_the_survivors_sum(run: Run) -> None:
    """lr=0: at the first sync point the four replicas sum to their start; after the loss the
    survivors' replicas move (their new engine's exchanges) and their sum is kept exactly from
    the third phase's start (after Q2 and the offset) to the sync point Q3."""
    if run.kind != "adpsgd":
        pytest.skip("adpsgd's pairwise averages")
    every = list(range(WORLD))
    x0, q1 = (np.array([rec["x"] for rec in run.records(name, every)])
              for name in ("start0", "q1"))
    np.testing.assert_allclose(q1.sum(0), x0.sum(0), rtol=0, atol=1e-5)
    assert np.abs(q1 - x0).max() > 1e-3  # they gossiped before the loss
    q2, q3 = (run.records(name, run.survivors) for name in ("q2", "q3"))
    assert [rec["gen"] for rec in q2 + q3] == [1] * 2 * len(run.survivors), q2 + q3
    x2, x3 = (np.array([rec["x"] for rec in run.records(name, run.survivors)])
              for name in ("start2", "q3"))
    np.testing.assert_allclose(x3.sum(0), x2.sum(0), rtol=0, atol=1e-5)
    assert np.abs(x3 - x2).max() > 1e-3, "the survivors did not gossip after the loss"
    assert sum(b["exchanges"] - a["exchanges"] for a, b in zip(q2, q3)) > 0


@pytest.mark.multiprocess
def test_the_checkpoint_and_finish_hold_the_survivors_exact_average(run: Run) -> None:
    """After the last sync point nobody steps: ``fabric.save``'s file (rank 0) and every
    survivor's replica after ``finish()`` are the exact average of the survivors' replicas."""
    x3 = np.array([rec["x"] for rec in run.records("q3", run.survivors)])
    mean = x3.mean(0)
    np.testing.assert_allclose(np.array(run.summary[0]["saved"]), mean, **FP32)
    finals = np.array([run.summary[r]["final"] for r in run.survivors])
    np.testing.assert_allclose(finals, np.repeat(mean[None], len(run.survivors), 0), **FP32)
    assert (finals == finals[0]).all()
