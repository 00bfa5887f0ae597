"""The command line the benchmark drivers share: ranks, timeout, quick mode, output, the
hidden ``--worker SPEC`` of the ranks, and the straggler options.

Standard library only: a driver parses its flags without importing torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    """A driver's parser; ``--help`` shows every default."""
    return argparse.ArgumentParser(description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_ranks(p: argparse.ArgumentParser, default: int | list[int] = 4) -> None:
    """``--ranks``: the world size (a list of default: one launch per world size)."""
    if isinstance(default, list):
        p.add_argument("--ranks", type=int, nargs="+", default=default,
                       help="world sizes, one launch each (e.g. --ranks 4 2)")
    else:
        p.add_argument("--ranks", type=int, default=default, help="world size")


def add_run_options(p: argparse.ArgumentParser, *, timeout: float, out: Path,
                    quick: str, per: str = "for the launch") -> None:
    """``--timeout``, ``--quick`` (``quick``: what it does), ``--out`` and the hidden
    ``--worker SPEC`` (how the driver starts the ranks)."""
    p.add_argument("--timeout", type=float, default=timeout, help=f"seconds {per}")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", type=Path, default=out, help="JSON results path")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)


def add_straggler_options(p: argparse.ArgumentParser, *, modes: Iterable[str],
                          slowdown: str, rank: str) -> None:
    """``--modes`` (equal ranks and/or one straggler), ``--slowdown``, ``--straggler-rank``;
    ``slowdown`` and ``rank``: their help."""
    modes = list(modes)
    p.add_argument("--modes", nargs="+", default=modes, choices=modes,
                   help="equal ranks and/or one straggler")
    p.add_argument("--slowdown", type=float, default=2.0, help=slowdown)
    p.add_argument("--straggler-rank", type=int, default=1, help=rank)


def add_adpsgd_kwargs(p: argparse.ArgumentParser, example: str) -> None:
    """``--adpsgd-kwargs``: extra ``ADPSGDStrategy`` keywords as JSON."""
    p.add_argument("--adpsgd-kwargs", type=json.loads, default=None,
                   help=f"extra ADPSGDStrategy keywords as JSON, e.g. '{example}'")


def parse(p: argparse.ArgumentParser, argv: list[str] | None,
          worker: Callable[[Path], None]) -> argparse.Namespace | None:
    """Parse ``argv``; with ``--worker SPEC`` run ``worker(SPEC)`` (this is a rank) and return
    ``None``, else return the driver's arguments."""
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return None
    return args


def check_straggler_rank(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error unless ``--straggler-rank`` is one of the ``--ranks``."""
    if not 0 <= args.straggler_rank < args.ranks:
        p.error(f"--straggler-rank must be in [0, {args.ranks})")


def spec_of(args: argparse.Namespace, keys: Iterable[str]) -> dict[str, Any]:
    """The arguments ``keys`` as a dict (what the driver hands the ranks)."""
    return {k: getattr(args, k) for k in keys}


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument but ``--worker``, JSON-ready (paths as strings): the report's config."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k != "worker"}
