"""Without torchaudio (``make test-latest``: it has no release for the newest torch), the
modules that import the ASR recipe skip with the reason, also under ``--doctest-modules``
(``make test``'s selection), instead of failing to import. Checked here on any torch by hiding
torchaudio from a pytest run in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from testbed.launch import ROOT, base_env
from tests.conftest import TORCHAUDIO_REASON, imports_torchaudio

# A pytest run in which ``import torchaudio`` fails and find_spec finds nothing.
HIDE = ("import sys; sys.modules['torchaudio'] = None; import pytest; "
        "raise SystemExit(pytest.main(sys.argv[1:]))")
FILES = ["tests/recipes/asr_corpus.py", "tests/recipes/test_asr_metrics.py",
         "tests/test_parity_demo.py", "tests/recipes/test_recipes_resume.py"]


def test_modules_that_import_the_asr_recipe_are_found():
    for name in FILES[:3]:
        assert imports_torchaudio(ROOT / name), name
    for name in ("tests/recipes/test_recipes_resume.py", "tests/recipes/test_imagenet_data.py",
                 "tests/conftest.py"):
        assert not imports_torchaudio(ROOT / name), name


@pytest.mark.multiprocess  # a pytest run in a process of its own (50-85 s): not make test-fast's
def test_asr_tests_skip_with_the_reason_without_torchaudio():
    # -k asr: of test_recipes_resume.py only its ASR case (skipped by its name), no launch
    cmd = [sys.executable, "-c", HIDE, "-q", "-rs", "-p", "no:cacheprovider",
           "--doctest-modules", "-m", "slow or not slow", "-k", "asr", *FILES]
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, capture_output=True,
                            timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("4 skipped, ") and "error" not in summary, out[-4000:]
    # one skipped node per module (for its tests and its doctests), one skipped ASR case
    assert "SKIPPED [3] tests/conftest.py:" in out and TORCHAUDIO_REASON in out, out[-4000:]
    assert "SKIPPED [1] tests/recipes/test_recipes_resume.py" in out, out[-4000:]
