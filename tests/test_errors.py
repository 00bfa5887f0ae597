"""The error module: every error is a :class:`GossipError` carrying the ranks to blame, keeps the
built-in base of the error it replaced, and the waits and checks that raise them fill ``ranks``
(no process group: events, tensors and plain dicts)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

import lightning_gossip
from lightning_gossip import errors
from lightning_gossip.agreement import config_outliers
from lightning_gossip.exchange import check_finite
from lightning_gossip.liveness.waits import wait_done


def test_every_error_is_exported_at_the_top_level_and_under_gossip_error():
    assert set(errors.__all__) <= set(lightning_gossip.__all__)
    for name in errors.__all__:
        cls = getattr(lightning_gossip, name)
        assert cls is getattr(errors, name) and issubclass(cls, errors.GossipError), name


@pytest.mark.parametrize("cls,builtin", [
    (errors.GossipTimeout, RuntimeError), (errors.PeerSilent, errors.GossipTimeout),
    (errors.NonFiniteFromPeer, RuntimeError), (errors.NonFiniteReplica, FloatingPointError),
    (errors.ConfigMismatch, ValueError),
])
def test_errors_keep_the_builtin_base_of_the_error_they_replaced(cls, builtin):
    assert issubclass(cls, builtin)


def test_ranks_of_each_error():
    assert errors.GossipError("x").ranks == ()
    assert errors.GossipTimeout("x", [3, 1]).ranks == (3, 1)
    assert errors.PeerSilent("x", (2,)).ranks == (2,)
    e = errors.NonFiniteFromPeer(peer=4, rank=0)
    assert (e.peer, e.ranks) == (4, (4,))
    assert str(e).startswith("rank 0 received non-finite values (NaN/Inf) in the replica from "
                             "rank 4; they were not mixed in.")
    m = errors.ConfigMismatch("seeds differ", ["seed: 0 on rank(s) 0; 1 on rank(s) 1"], [1])
    assert (str(m), m.differences, m.ranks) == ("seeds differ", [
        "seed: 0 on rank(s) 0; 1 on rank(s) 1"], (1,))


def test_check_finite_names_the_peer_in_ranks():
    check_finite(torch.ones(5), peer=2, rank=0)
    with pytest.raises(errors.NonFiniteFromPeer) as info:
        check_finite(torch.tensor([1.0, float("nan")]), peer=2, rank=0)
    assert info.value.ranks == (2,)


def test_a_timed_out_wait_names_the_ranks_it_waited_on():
    """The one wait loop (``waits._watch``, through ``wait_done``) without a heartbeat: the
    event is never set, so the deadline passes."""
    with pytest.raises(errors.GossipTimeout, match=r"waiting on rank\(s\) 1, 3\)") as info:
        wait_done(threading.Event(), [3, 1, 3], None, timedelta(milliseconds=20), "a round")
    assert type(info.value) is errors.GossipTimeout and info.value.ranks == (1, 3)
    assert str(info.value).startswith("a round did not complete within 0:00:00.020000")
    done = threading.Event()
    done.set()
    wait_done(done, [1], None, timedelta(0), "a finished round")  # set: returns at once


@pytest.mark.parametrize("configs,outliers", [
    ([{"seed": 0}, {"seed": 0}, {"seed": 5}], [2]),
    ([{"seed": 5}, {"seed": 0}, {"seed": 0}], [0]),
    ([{"seed": 0}, {"seed": 1}], [1]),  # a tie: the lowest rank's configuration counts
    ([{"seed": 0}, {"seed": 0, "topology": "ring"}, {"seed": 0}], [1]),  # a missing key
    ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], []),  # the order of the keys does not matter
])
def test_config_outliers(configs, outliers):
    assert config_outliers(configs) == outliers
