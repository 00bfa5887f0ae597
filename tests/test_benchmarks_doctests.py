"""The ``>>>`` examples of ``benchmarks/`` (the race's scoring and rules among them).

Run in one child process: the benchmark scripts put their own folder on ``sys.path`` when
imported, which must not leak into the test process. Every module under ``benchmarks/`` with
an example is collected, so a new one is tested without a list to keep.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.launch import ROOT, base_env

CHILD = r"""
import doctest, importlib, json, sys
out = {}
for name in sys.argv[1:]:
    result = doctest.testmod(importlib.import_module(name), verbose=False, report=False)
    out[name] = [result.failed, result.attempted]
print("DOCTESTS " + json.dumps(out))
"""


def modules_with_examples() -> list[str]:
    """Dotted names of the modules of ``benchmarks/`` that hold a ``>>>`` example."""
    paths = sorted(p for p in (ROOT / "benchmarks").rglob("*.py")
                   if ">>>" in p.read_text() and "results" not in p.parts)
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in paths]


def test_benchmark_doctests_pass() -> None:
    names = modules_with_examples()
    assert {"benchmarks.race", "benchmarks.race_rules", "benchmarks.race_docs"} <= set(names)
    result = subprocess.run([sys.executable, "-c", CHILD, *names], cwd=ROOT, env=base_env(),
                            text=True, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("DOCTESTS "))
    counts = json.loads(line.removeprefix("DOCTESTS "))
    failed = {n: c for n, c in counts.items() if c[0]}
    assert failed == {}, f"{failed}\n{result.stdout[-4000:]}"
    assert all(attempted > 0 for _, attempted in counts.values()), counts
