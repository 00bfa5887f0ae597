"""No library module is over 350 lines (the design card's rule: one concept per file)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_gossip"
LIMIT = 350


def test_no_library_module_over_the_limit() -> None:
    sizes = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 40  # the package was found
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them by concept): {over}"
