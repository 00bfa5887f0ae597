"""Every error that lightning-gossip raises about the gossip itself, in one place.

Each one is a :class:`GossipError` and carries ``ranks``, the ranks it points at, so that a
launcher, a test or a retry policy can act on them without parsing the message:

* :class:`GossipTimeout`: a gossip message did not arrive in time, or its connection failed;
  ``ranks``: the ranks that were waited on (empty when the wait named none).
* :class:`PeerSilent` (a :class:`GossipTimeout`): a rank waited on stopped beating, left after
  an error, or the store is unreachable; ``ranks``: those ranks (or the store's host).
* :class:`RankExcluded`: the other ranks of an elastic fit went on without this one (it was
  silent too long); ``ranks``: this rank.
* :class:`NonFiniteFromPeer`: a peer sent NaN/Inf values; ``ranks``: that peer.
* :class:`NonFiniteReplica`: replicas hold NaN/Inf where every rank meets (adpsgd's epoch end);
  ``ranks``: the ranks whose replica is not finite.
* :class:`ConfigMismatch`: the ranks were given different gossip configurations; ``ranks``: the
  ranks whose configuration differs from the most common one.

The module imports nothing from the package (and nothing but the standard library), so every
module can import it, ``import lightning_gossip`` exports its names without importing torch, and
it closes no import cycle. The classes keep the built-in bases of the errors they replaced
(``RuntimeError``, ``ValueError``, ``FloatingPointError``), so an ``except`` written for those
still catches them.

>>> try:
...     raise PeerSilent("rank 0 waiting on rank 2: rank(s) 2 sent no heartbeat", [2])
... except GossipError as e:
...     print(type(e).__name__, e.ranks, isinstance(e, GossipTimeout))
PeerSilent (2,) True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["ConfigMismatch", "GossipError", "GossipTimeout", "NonFiniteFromPeer",
           "NonFiniteReplica", "PeerSilent", "RankExcluded"]  # (and lost_ranks, a helper)


class GossipError(RuntimeError):
    """The base of every gossip, liveness, non-finite and configuration-mismatch error.

    Args:
        message: the error message (names the ranks and what was being done).
        ranks: the ranks the error points at (see the table of :mod:`lightning_gossip.errors`).

    Attributes:
        ranks: ``ranks`` as a tuple of ints, in the order given.
    """

    def __init__(self, message: str, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)


class GossipTimeout(GossipError):
    """A gossip message did not arrive within the configured timeout (or its connection
    failed); ``ranks`` are the ranks that were waited on."""


class PeerSilent(GossipTimeout):
    """A rank that others wait on stopped beating (frozen, killed or cut off).

    Attributes:
        ranks: the silent ranks.
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message, ranks)


class RankExcluded(GossipError):
    """This rank was counted lost by the other ranks of an elastic fit (it was silent for
    longer than the heartbeat timeout, e.g. frozen) and cannot rejoin it; they go on without
    it (``docs/faults.md``)."""


class NewcomersAdmitted(BaseException):  # noqa: N818 - a signal, not an error
    """An elastic ``dpsgd`` fit admitted newcomers at the start of a gossip-only round of a
    rank waiting for the shared cursor's end: that round runs at the next wait, with the new
    members (a ``BaseException``: not a loss to recover from; never leaves the strategy, so it
    is not exported)."""


class GossipStopped(Exception):  # noqa: N818 - a signal, not an error
    """Raised in an ``adpsgd`` gossip thread asked to stop in the middle of an exchange or a
    control message (the engine's ``close``, or the interpreter's exit): the thread ends
    quietly (never leaves the engine, so it is not exported)."""


class NonFiniteFromPeer(GossipError):
    """A peer sent NaN or Inf values; they were not mixed in.

    Attributes:
        peer: the rank that sent them (also ``ranks == (peer,)``).
    """

    def __init__(self, peer: int, rank: int, what: str = "replica") -> None:
        super().__init__(
            f"rank {rank} received non-finite values (NaN/Inf) in the {what} from rank {peer}; "
            "they were not mixed in. That rank's training has diverged (check its learning "
            "rate, loss scaling and data).", (peer,)
        )
        self.peer = peer


class NonFiniteReplica(GossipError, FloatingPointError):
    """The replicas of ``ranks`` hold NaN or Inf where every rank meets (adpsgd's epoch end):
    every rank stops before they are averaged in. Also a ``FloatingPointError``."""


class ConfigMismatch(GossipError, ValueError):
    """The ranks were given different gossip configurations. Also a ``ValueError``.

    Attributes:
        differences: one line per differing key
            (see :func:`~lightning_gossip.agreement.config_differences`).
        ranks: the ranks whose configuration differs from the most common one
            (see :func:`~lightning_gossip.agreement.config_outliers`).
    """

    def __init__(self, message: str, differences: Sequence[str],
                 ranks: Iterable[int] = ()) -> None:
        super().__init__(message, ranks)
        self.differences = list(differences)


def lost_ranks(error: BaseException) -> tuple[int, ...] | None:
    """The ranks a :class:`PeerSilent` in ``error``'s chain (its causes) names, or ``None``.

    >>> lost_ranks(RuntimeError("the gossip thread failed"))
    >>> try:
    ...     try:
    ...         raise PeerSilent("rank 2 went silent", [2])
    ...     except PeerSilent as e:
    ...         raise RuntimeError("the gossip thread failed") from e
    ... except RuntimeError as outer:
    ...     lost_ranks(outer)
    (2,)
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, PeerSilent):
            return tuple(int(r) for r in error.ranks)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return None
