"""The ``lightning-gossip`` command: every sub-command, its output and its errors."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from lightning_gossip import topology
from lightning_gossip.analysis import (
    analyze,
    closed_form_gaps,
    measure_consensus_steps,
    predicted_consensus_steps,
)
from lightning_gossip.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse errors and --help
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


# -- analysis -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(topology.TOPOLOGIES))
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 12, 16, 30, 32])
def test_closed_forms_match_the_eigensolver(name, n):
    try:
        topo = topology.build(name, n)
    except ValueError:
        with pytest.raises(ValueError):
            closed_form_gaps(name, n)
        return
    gap, ms_gap = closed_form_gaps(name, n)
    assert gap == pytest.approx(topo.spectral_gap(), abs=1e-9)
    assert ms_gap == pytest.approx(topo.mean_square_gap(), abs=1e-9)


def test_ring_closed_form_is_the_papers():
    assert closed_form_gaps("ring", 64)[0] == pytest.approx(topology.ring_spectral_gap(64))
    assert closed_form_gaps("ring", 64)[0] == pytest.approx(0.0032, abs=1e-4)
    assert closed_form_gaps("random_ring", 1024)[0] == pytest.approx(2 / 3, abs=1e-3)


def test_predicted_and_measured_consensus_steps():
    assert predicted_consensus_steps(1.0) == 1
    assert math.isinf(predicted_consensus_steps(0.0))
    with pytest.raises(ValueError):
        predicted_consensus_steps(0.5, tolerance=2.0)
    ring = topology.build("ring", 16)
    measured = measure_consensus_steps(ring, 1e-3)
    predicted = predicted_consensus_steps(ring.mean_square_gap(), 1e-3)
    assert 0.7 * predicted <= measured <= predicted + 1
    assert measure_consensus_steps(topology.build("complete", 16)) == 1
    assert measure_consensus_steps(topology.build("one_peer_exponential", 16)) == 4  # log2(16)
    assert measure_consensus_steps(ring, 1e-3, max_steps=5) is None


def test_analyze_row_and_unavailable_topology():
    row = analyze("random_ring", 64, model_params=1000, bytes_per_param=2)
    assert row.peers == 2 and row.bytes_per_step == 4000
    assert row.gap == pytest.approx(row.gap_closed_form)
    assert row.steps_measured is not None and row.steps_measured <= row.steps_predicted + 1
    bad = analyze("torus", 7)
    assert bad.error and "torus" in bad.error and bad.gap is None


# -- topologies -----------------------------------------------------------------------------------


def test_topologies_table_json_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "t.json", tmp_path / "t.png"
    code, out, _ = run(capsys, "topologies", "-n", "8", "7", "--model-params", "1M",
                       "--no-progress", "--json", str(js), "--plot", str(png))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["topology", "n", "gap"]
    ring8 = next(line for line in lines if line.startswith("ring ") and line.split()[1] == "8")
    assert f"{topology.ring_spectral_gap(8):.4f}" in ring8 and "8.0 MB" in ring8
    assert "n/a: torus at n=7: torus needs" in out
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 2 * len(topology.TOPOLOGIES)
    rr = next(r for r in rows if r["topology"] == "random_ring" and r["world_size"] == 8)
    assert rr["gap"] == pytest.approx(topology.random_ring_spectral_gap(8))
    assert rr["steps_measured"] >= 1
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_topologies_no_measure_and_cap(capsys):
    code, out, _ = run(capsys, "topologies", "-n", "64", "-t", "ring", "--no-measure",
                       "--no-progress")
    assert code == 0 and "0.0032" in out
    code, out, _ = run(capsys, "topologies", "-n", "64", "-t", "ring", "--max-steps", "10",
                       "--no-progress")
    assert code == 0 and ">10" in out


@pytest.mark.parametrize("argv, message", [
    (["topologies", "-n", "0"], "positive integer"),
    (["topologies", "-n", "eight"], "positive integer"),
    (["topologies", "-t", "star"], "invalid choice: 'star'"),
    (["topologies", "--tolerance", "5"], "(0, 1)"),
    (["topologies", "--model-params", "lots"], "parameter count"),
    (["topologies", "--plot", "/nonexistent/dir/x.png"], "does not exist"),
    (["inspect", "ring"], "-n N"),
    (["inspect", "torus", "-n", "7"], "torus needs a world size"),
    (["inspect", "star", "-n", "4"], "unknown topology 'star'"),
    (["inspect", "missing.npy"], "no such matrix file"),
    (["inspect", "ring", "-n", "4", "--step", "-1"], "integer >= 0"),
    (["simulate", "-a", "adpsgd", "-n", "1"], "at least 2 learners"),
    (["simulate", "-n", "5000"], "at most 1797 learners"),
    (["simulate", "-n", "4", "5", "-t", "torus", "--steps", "1"], "torus with 5 learners"),
    (["simulate", "--lr", "-1"], "number >= 0"),
    (["simulate", "--slow", "9", "-n", "8"], "--slow 9"),
    (["simulate", "--partition", "random"], "invalid choice"),
    ([], "required: COMMAND"),
])
def test_bad_arguments_give_clear_errors(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err, err


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    code, _, err = run(capsys, "topologies", "-n", "4", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "--plot needs matplotlib" in err


@pytest.mark.parametrize("command", ["topologies", "inspect", "simulate"])
def test_help(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and out.startswith("usage: lightning-gossip " + command)


def test_console_script_is_declared():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "lightning-gossip"]
    assert ep.value == "lightning_gossip.cli:main" and ep.load() is main


# -- inspect --------------------------------------------------------------------------------------


def test_inspect_named(capsys):
    code, out, _ = run(capsys, "inspect", "random_ring", "-n", "6", "--step", "2", "--seed", "4")
    assert code == 0
    assert "random_ring: 6 ranks, step 2 (time-varying, seed 4)" in out
    w = topology.build("random_ring", 6, seed=4).mixing_matrix(2)
    p = topology.build("random_ring", 6, seed=4).peers(0, 2)
    assert f"sends to {', '.join(map(str, p.send_to))}" in out
    for label in ("doubly stochastic      yes", "symmetric              yes",
                  "connected (strongly)   yes"):
        assert label in out
    assert w.shape == (6, 6) and out.count("0.333") >= 18


def test_inspect_directed_and_large(capsys):
    code, out, _ = run(capsys, "inspect", "exponential", "-n", "8")
    assert code == 0 and "symmetric              NO" in out
    code, out, _ = run(capsys, "inspect", "ring", "-n", "100")
    assert code == 0 and "100x100, 300 non-zeros" in out and "(84 more ranks)" in out


def test_inspect_matrix_file(capsys, tmp_path):
    good = tmp_path / "w.txt"
    np.savetxt(good, [[0.5, 0.5, 0], [0.5, 0.25, 0.25], [0, 0.25, 0.75]])
    code, out, _ = run(capsys, "inspect", str(good))
    assert code == 0 and "w.txt: 3 ranks" in out
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([[0.5, 0.5], [0.6, 0.4]]))
    code, _, err = run(capsys, "inspect", str(bad))
    assert code == 2 and "not doubly stochastic" in err


# -- simulate -------------------------------------------------------------------------------------


def test_simulate_table_json_plot(capsys, tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    code, out, _ = run(capsys, "simulate", "-n", "8", "-a", "dpsgd", "adpsgd", "-t", "ring",
                       "complete", "--steps", "8", "--eval-every", "4", "--lr", "0.5",
                       "--slow", "1", "--hidden", "8", "--no-progress", "--json", str(js),
                       "--plot", str(png), "--target-loss", "100", "--pairings", "random")
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:5]]
    assert [r[:3] for r in rows] == [["dpsgd", "ring", "8"], ["dpsgd", "complete", "8"],
                                     ["adpsgd", "random", "8"]]
    assert rows[0][4] == "2.0"  # 8 time units / a slow learner's 4 units per synchronous step
    runs = json.loads(js.read_text())["runs"]
    assert len(runs) == 3 and runs[0]["loss"][-1] < runs[0]["loss"][0]
    assert runs[2]["local_steps"][:7] == [8] * 7 and runs[2]["local_steps"][7] == 2
    assert png.stat().st_size > 10_000


def test_simulate_delay_by_one_and_no_overlap(capsys):
    pytest.importorskip("sklearn")
    common = ["simulate", "-n", "4", "-a", "dpsgd", "adpsgd", "-t", "ring", "--steps", "4",
              "--eval-every", "4", "--hidden", "4", "--no-progress"]
    code, default, _ = run(capsys, *common)
    assert code == 0
    rows = {}
    for flag in ("--delay-by-one", "--adpsgd-no-overlap"):
        code, out, _ = run(capsys, *common, flag)
        assert code == 0
        rows[flag] = [line for line in out.splitlines() if line.startswith("adpsgd")]
        assert rows[flag]
    plain = [line for line in default.splitlines() if line.startswith("adpsgd")]
    assert rows["--delay-by-one"] != plain and rows["--adpsgd-no-overlap"] != plain
    code, _, err = run(capsys, *common, "--delay", "2")  # never released; removed
    assert code == 2 and "unrecognized arguments: 2" in err
