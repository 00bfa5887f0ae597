"""The options ranks must agree on are listed, not discovered: ``AGREED_OPTIONS``."""

from __future__ import annotations

import inspect

import pytest

from lightning_gossip import ADPSGDStrategy, DPSGDStrategy

# Constructor arguments that are Lightning plugins or compared under another key.
NOT_OPTIONS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
               "precision_plugin", "process_group_backend", "timeout", "kwargs"}
ATTRIBUTE_OF = {"topology": "topology_spec", "pairing": "pairing_name", "outer_lr": "outer",
                "outer_momentum": "outer", "outer_nesterov": "outer"}  # one OuterOptimizer
ALWAYS = {"strategy", "world_size", "num_nodes", "processes_per_node", "process_group_backend",
          "timeout_s"}


@pytest.mark.parametrize("cls", [DPSGDStrategy, ADPSGDStrategy])
def test_every_gossip_option_is_compared_and_nothing_else(cls) -> None:
    params = set(inspect.signature(cls.__init__).parameters) - {"self"} - NOT_OPTIONS
    options = {ATTRIBUTE_OF.get(p, p) for p in params}
    assert set(cls.AGREED_OPTIONS) == options
    config = cls().gossip_config()
    assert set(config) == ALWAYS | options


def test_an_unlisted_attribute_is_not_compared() -> None:
    strategy = DPSGDStrategy(topology="ring", seed=3)
    before = strategy.gossip_config()
    strategy.some_new_attribute = 7
    assert strategy.gossip_config() == before
    assert before["topology_spec"] == "ring" and before["seed"] == 3
    assert DPSGDStrategy(topology="ring", seed=4).gossip_config() != before
