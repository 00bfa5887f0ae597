"""Import cost: the package and the ``lightning-gossip`` command do not import torch or
Lightning until something needs them, and the strategy names are still registered with
Lightning in either import order (see the docstring of :mod:`lightning_gossip`).

Every check runs in a fresh interpreter (``sys.modules`` of the test process already holds
torch). No wall time is asserted; the timings are measured by hand (docs/cli.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Every check starts a fresh interpreter (some import Lightning): not part of `make test-fast`.
pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "pytorch_lightning")
TIMEOUT_S = 300  # a loaded 2-core machine imports Lightning in ~40 s; this is only a guard


def fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it ends by printing one JSON line, returned."""
    prelude = textwrap.dedent(
        """
        import json, sys
        def heavy():
            return sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
        """
    ) + f"HEAVY = {HEAVY!r}\n"
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cli_modules(*argv: str) -> dict:
    """Run ``lightning-gossip ARGV`` through :func:`lightning_gossip.cli.main` in a fresh
    interpreter; the exit code and the heavy packages imported by then."""
    return fresh(
        f"""
        import contextlib, io
        from lightning_gossip.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                code = main({list(argv)!r})
            except SystemExit as e:
                code = e.code
        print(json.dumps({{"code": code, "heavy": heavy(), "out": out.getvalue()}}))
        """
    )


def test_package_and_cli_import_neither_torch_nor_lightning():
    got = fresh(
        """
        import lightning_gossip, lightning_gossip.cli, lightning_gossip.topology
        hook = any(type(f).__name__ == "_LightningImportHook" for f in sys.meta_path)
        print(json.dumps({"heavy": heavy(), "hook": hook,
                          "all": sorted(lightning_gossip.__all__)}))
        """
    )
    assert got["heavy"] == []
    assert got["hook"]  # registration waits for lightning.pytorch
    assert {"DPSGDStrategy", "ADPSGDStrategy", "GossipStrategy"} <= set(got["all"])


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["topologies", "--help"], ["inspect", "--help"], ["simulate", "--help"]],
    ids=["help", "topologies-help", "inspect-help", "simulate-help"],
)
def test_help_imports_neither_torch_nor_lightning(argv):
    got = cli_modules(*argv)
    assert got["code"] == 0
    assert "usage: lightning-gossip" in got["out"]
    assert got["heavy"] == []


def test_inspect_imports_neither_torch_nor_lightning():
    got = cli_modules("inspect", "ring", "-n", "4")
    assert got["code"] == 0 and "ring: 4 ranks" in got["out"]
    assert got["heavy"] == []


def test_topologies_without_measuring_imports_no_lightning():
    got = cli_modules("topologies", "--world-sizes", "8", "--no-measure", "--no-progress")
    assert got["code"] == 0 and "ring" in got["out"]
    assert "lightning" not in got["heavy"]


def test_topologies_imports_neither_torch_nor_lightning():
    got = cli_modules("topologies", "--world-sizes", "8", "--no-progress")
    assert got["code"] == 0 and "ring" in got["out"]
    assert got["heavy"] == []


def test_console_script_help_imports_nothing_heavy():
    """The installed entry point (``python -m lightning_gossip.cli``), not only main()."""
    code = (
        "import runpy, sys, json\n"
        "sys.argv = ['lightning-gossip', '--help']\n"
        "try:\n"
        "    runpy.run_module('lightning_gossip.cli', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"HEAVY = {HEAVY!r}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(HEAVY))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "usage: lightning-gossip" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


REGISTRY_CHECK = """
from lightning.pytorch.strategies import StrategyRegistry
from lightning_gossip import ADPSGDStrategy, DPSGDStrategy, GossipStrategy
names = ("dpsgd", "adpsgd", "adpsgd_random")
print(json.dumps({
    "registered": [n for n in names if n in StrategyRegistry],
    "classes": {n: StrategyRegistry[n]["strategy"].__name__ for n in names if n in
                StrategyRegistry},
    "params": {n: StrategyRegistry[n]["init_params"] for n in names if n in StrategyRegistry},
    "subclass": issubclass(DPSGDStrategy, GossipStrategy),
    "hook_left": any(type(f).__name__ == "_LightningImportHook" for f in sys.meta_path),
}))
"""


def check_registry(got: dict) -> None:
    assert got["registered"] == ["dpsgd", "adpsgd", "adpsgd_random"]
    assert got["classes"] == {"dpsgd": "DPSGDStrategy", "adpsgd": "ADPSGDStrategy",
                              "adpsgd_random": "ADPSGDStrategy"}
    assert got["params"] == {"dpsgd": {}, "adpsgd": {}, "adpsgd_random": {"pairing": "random"}}
    assert got["subclass"]
    assert not got["hook_left"]  # the hook removes itself once it has fired


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_gossip\nimport lightning.pytorch",
        "import lightning.pytorch\nimport lightning_gossip",
        "import lightning_gossip\nimport lightning",
        "import lightning_gossip.strategies.dpsgd",
    ],  # "from lightning.pytorch import Trainer": test_trainer_finds_the_registered_names
    ids=["gossip-first", "lightning-first", "lightning-top-level", "strategy-module"],
)
def test_strategy_names_are_registered_in_either_import_order(imports):
    code = "import warnings\nwarnings.simplefilter('error')\n" + imports + "\n" + REGISTRY_CHECK
    check_registry(fresh(code))


def test_trainer_finds_the_registered_names():
    """``from lightning.pytorch import Trainer`` after the package: the names are registered
    (no warning on import) and ``Trainer(strategy=name)`` builds each strategy."""
    code = ("import json, sys, warnings\nwarnings.simplefilter('error')\nimport lightning_gossip\n"
            "from lightning.pytorch import Trainer\n" + REGISTRY_CHECK + textwrap.dedent(
                """
                warnings.simplefilter("ignore")
                kw = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
                got = {name: type(Trainer(strategy=name, **kw).strategy).__name__
                       for name in ("dpsgd", "adpsgd", "adpsgd_random")}
                got["pairing"] = Trainer(strategy="adpsgd_random", **kw).strategy.pairing_name
                print(json.dumps(got))
                """))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    registry, trainers = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    check_registry(registry)
    assert trainers == {"dpsgd": "DPSGDStrategy", "adpsgd": "ADPSGDStrategy",
                        "adpsgd_random": "ADPSGDStrategy", "pairing": "random"}


def test_lazy_attributes():
    import lightning_gossip

    assert lightning_gossip.DPSGDStrategy.__name__ == "DPSGDStrategy"
    assert "ADPSGDStrategy" in dir(lightning_gossip)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lightning_gossip.nope  # noqa: B018
    from lightning_gossip import sim  # submodules still import through the package

    assert sim.__name__ == "lightning_gossip.sim"
