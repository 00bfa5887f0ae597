"""The ``lightning-gossip`` command: analyze topologies and simulate many learners on a laptop.

Commands::

    lightning-gossip topologies --world-sizes 8 16 32 64 128 --plot gaps.png
    lightning-gossip inspect random_ring -n 8 --step 3
    lightning-gossip simulate --topologies ring random_ring complete --world-sizes 16 64 \\
        --steps 300 --plot training.png

Run ``lightning-gossip COMMAND --help`` for every option. One module per command
(:mod:`~lightning_gossip.cli.topologies`, :mod:`~lightning_gossip.cli.inspect`,
:mod:`~lightning_gossip.cli.simulate`), each with its sub-parser next to the command;
argument types and formatting in :mod:`~lightning_gossip.cli.common`, figures in
:mod:`~lightning_gossip.cli.plotting`. torch and matplotlib are imported only by the commands
that need them. The same code is reachable from Python as :func:`main`::

    >>> from lightning_gossip.cli import main
    >>> main(["inspect", "ring", "-n", "4"])  # doctest: +ELLIPSIS
    ring: 4 ranks, step 0 (static)
    ...
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_gossip.cli import inspect, simulate, topologies
from lightning_gossip.cli.common import CLIError

__all__ = ["CLIError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``lightning-gossip`` (all sub-commands)."""
    parser = argparse.ArgumentParser(
        prog="lightning-gossip",
        description="Analyze gossip topologies and simulate decentralized training "
                    "(D-PSGD, AD-PSGD, RAND-PSGD) with many learners in one process.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from lightning_gossip.cli import plan  # cost model: pure Python/NumPy

    for command in (topologies, inspect, simulate, plan):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-gossip`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CLIError as e:
        parser.exit(2, f"lightning-gossip {args.command}: error: {e}\n")
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
