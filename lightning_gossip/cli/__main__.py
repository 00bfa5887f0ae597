"""``python -m lightning_gossip.cli``: the ``lightning-gossip`` command."""

import sys

from lightning_gossip.cli import main

sys.exit(main())
