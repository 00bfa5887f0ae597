"""Without torchaudio (it has no release for the newest torch: ``make test-latest``), the ASR
recipe's tests skip, each with a message that says why; the ImageNet recipe's run as usual."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

NO_TORCHAUDIO = importlib.util.find_spec("torchaudio") is None
REASON = ("torchaudio is not installed (its last release, 2.11, pins its own torch; "
          "`make test-latest` runs without it): the ASR recipe needs it")


class _SkippedModule(pytest.Module):
    """A test module of the ASR recipe, skipped at collection (it imports torchaudio)."""

    def _getobj(self):  # noqa: ANN202 - pytest's hook
        pytest.skip(REASON, allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector
                                ) -> pytest.Module | None:
    """The ASR tests' modules skip without torchaudio."""
    if NO_TORCHAUDIO and module_path.name.startswith("test_asr_"):
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Cases of other recipe tests that run the ASR recipe skip without torchaudio."""
    if not NO_TORCHAUDIO:
        return
    for item in items:
        if "tests/recipes/" in item.nodeid and "asr" in item.nodeid.split("::")[-1]:
            item.add_marker(pytest.mark.skip(reason=REASON))
