"""Elastic ``adpsgd`` and ``dpsgd``: a replacement takes a lost rank's slot
(``testbed/elastic_fit.py``; 4 ranks started as ``srun`` starts tasks, the replacement started
with the victim's environment once the survivors went on). The checks and the rest of the
elastic tests: ``tests/test_elastic.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.launch import fake_slurm_commands, launch_processes, relaunched_once
from tests.test_elastic import (
    SCRIPT,
    check_each_sample_once,
    check_epoch_values,
    check_exits,
    live_learners,
    trained,
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "victims"), [("adpsgd", (2,)), ("adpsgd", (2, 3)),
                                                   ("dpsgd", (2, 3))])
def test_a_replacement_takes_the_lost_ranks_slot_and_trains(
        tmp_path: Path, strategy: str, victims: tuple[int, ...]) -> None:
    """Rank 2 (or ranks 2 and 3, at the same batch) is killed mid-epoch; once the survivors
    went on, a replacement is started with the last victim's environment (as ``srun``
    relaunching the task would): it is admitted at the survivors' next step boundary
    (``dpsgd``: the next multiple of ``JOIN_CHECK_EVERY``, every member at the same step, the
    topology rebuilt over the new members), resumes from the lowest survivor's state (the
    survivors' exact average), takes batches from the shared cursor, and all finish every epoch
    with the same final replica; every sample is trained once per epoch among all processes.
    With two victims the fit goes on with slot 2 free after the join (the newcomer's default
    group numbers the ranks 0, 1, 3 from 0).

    A newcomer admitted as the shared cursor runs out trains no batch in that epoch: it
    validates late with the members (``Phases.end_epoch``). Before that fix the fit ended with
    a collective mismatch in 2 of 7 runs."""
    ranks, slot = 4, victims[-1]
    # 1 s steps: the fit lasts while the replacement starts
    commands = fake_slurm_commands(SCRIPT, str(tmp_path), ",".join(map(str, victims)), "3",
                                   ntasks=ranks, env={"ELASTIC_FIT_STEP_S": "1.0",
                                                      "ELASTIC_FIT_STRATEGY": strategy})
    commands.append(relaunched_once(commands[slot], tmp_path / "recovered"))
    result = launch_processes(commands, timeout=300)
    out = result.stdout[-8000:]
    assert not result.timed_out, out
    assert [result.returncodes[v] for v in victims] == [-9] * len(victims), (
        result.returncodes, out)
    # launch 4 is the replacement, whose results are the slot's
    live = [r for r in range(ranks) if r not in victims or r == slot]
    results = {i: tmp_path / f"done{slot if i == 4 else i}.json"
               for i in (*[r for r in live if r != slot], 4)}
    check_exits(result, results, out)
    assert f"elastic fit: rank(s) {slot} joined at step" in result.stdout, out
    check_each_sample_once(tmp_path, ranks)
    done = {r: json.loads((tmp_path / f"done{r}.json").read_text()) for r in live}
    assert done[slot]["joined"] and not done[0]["joined"], done
    lost_at = json.loads((tmp_path / "victim.json").read_text())["t"]
    assert any(rec["t"] > lost_at for rec in trained(tmp_path, slot))  # the replacement's
    assert all(d["joins"] and d["joins"][0][0] == [slot] for r, d in done.items()
               if r != slot), done
    assert len({round(d["sum"], 5) for d in done.values()}) == 1, done
    check_epoch_values(list(done.values()))
    learners = live_learners(tmp_path)
    # two victims may be found in one agreement or in two (they die a step apart)
    assert learners[0] == 4 and learners[-1] == len(live), learners
    assert min(learners) == ranks - len(victims), learners


@pytest.mark.multiprocess
def test_a_join_asked_while_members_wait_at_the_epochs_end_is_admitted(tmp_path: Path) -> None:
    """``adpsgd``: rank 2 is killed in epoch 0; in epoch 1 rank 1 pauses 15 s in a batch, so
    ranks 0 and 3 run out of batches and wait for it at the epoch's end, and the replacement of
    rank 2 asks to join during the pause. A member that has arrived at its epoch's end must not
    begin the admission (the others may have gone on to the epoch's meetings: the SLURM hang of
    5 Dec 2026); rank 1, still training, begins it at its next step boundary and the arrived
    members take part. All four finish every epoch; the join came in epoch 1; every sample once
    per epoch among all processes; the same final replica."""
    victim, ranks, pause_s = 2, 4, 20
    commands = fake_slurm_commands(SCRIPT, str(tmp_path), str(victim), "3", ntasks=ranks,
                                   env={"ELASTIC_FIT_PAUSE": f"1,1,5,{pause_s}"})
    commands.append(relaunched_once(commands[victim], tmp_path / "paused"))
    result = launch_processes(commands, timeout=300)
    out = result.stdout[-8000:]
    assert not result.timed_out, out
    assert result.returncodes[victim] == -9, (result.returncodes, out)
    check_exits(result, {i: tmp_path / f"done{victim if i == 4 else i}.json" for i in (0, 1, 3, 4)},
                out)
    paused = float((tmp_path / "paused").read_text())
    joined = [rec["t"] for rec in trained(tmp_path, victim)
              if rec["t"] > json.loads((tmp_path / "victim.json").read_text())["t"]]
    assert joined and min(joined) > paused, (joined, paused)  # the replacement came at the pause
    check_each_sample_once(tmp_path, ranks)
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in range(ranks)]
    assert all(d["joins"] and d["joins"][0][0] == [victim] for r, d in enumerate(done)
               if r != victim), done
    # no member began the admission while rank 1 paused (ranks 0 and 3 waited at the end)
    began = min(d["joins"][0][3] for r, d in enumerate(done) if r != victim)
    assert began > paused + pause_s - 1, (began - paused, done)
    assert len({round(d["sum"], 5) for d in done}) == 1, done
    check_epoch_values(done)
