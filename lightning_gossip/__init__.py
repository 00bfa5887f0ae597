"""lightning-gossip: decentralized data-parallel training for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so that

    import lightning_gossip
    trainer = Trainer(strategy="dpsgd", accelerator="cpu", devices=4)

works (Lightning does not discover external strategies by itself). The names are
``"dpsgd"``, ``"adpsgd"`` and ``"adpsgd_random"``; each class registers its own in its
``register_strategies`` classmethod, Lightning's pattern.

Import cost. ``import lightning_gossip`` itself imports neither torch nor Lightning (only
NumPy, for :mod:`lightning_gossip.topology`), so that the ``lightning-gossip`` command and
the topology tools start in a fraction of a second; importing ``lightning.pytorch`` costs many
seconds. Two mechanisms keep the promises above without that import:

* The strategy classes (:class:`DPSGDStrategy`, :class:`ADPSGDStrategy`,
  :class:`GossipStrategy`) and the engines with their parts (:class:`SyncGossip`,
  :class:`AsyncGossip`, :class:`FlatState`, :class:`Pairing`; they import torch but no
  Lightning, see ``docs/engines.md``) are attributes loaded on first access (a module
  ``__getattr__``):
  ``from lightning_gossip import DPSGDStrategy`` imports :mod:`lightning_gossip.strategies`,
  and with it torch and Lightning, at that moment.
* The names are registered as soon as Lightning is there: at once if ``lightning.pytorch`` is
  already imported, otherwise by a post-import hook, a :data:`sys.meta_path` finder that
  wraps the loader of the package ``lightning.pytorch`` and registers right after that package
  has finished executing (never while a submodule of it is half imported, which would be a
  circular import). The finder removes itself once it has fired. Importing
  :mod:`lightning_gossip.strategies` (which every strategy module does) also registers, so
  whichever comes first wins and the second time is a no-op.

``Trainer(strategy="dpsgd")`` needs ``lightning.pytorch`` imported, so by the time a Trainer
looks the name up it is registered, in either import order. If the registration itself fails
(a broken installation), ``import lightning.pytorch`` still succeeds, a ``RuntimeWarning``
says why the names are missing, and ``lightning_gossip.DPSGDStrategy`` raises the real
error. The standalone ``pytorch_lightning`` package is not hooked (the strategies are built on
``lightning.pytorch``).

The errors of :mod:`lightning_gossip.errors` (:class:`GossipError` and the errors under it,
each carrying the ``ranks`` to blame) are exported here too; that module imports only the
standard library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_gossip import topology
from lightning_gossip.errors import (
    ConfigMismatch,
    GossipError,
    GossipTimeout,
    NonFiniteFromPeer,
    NonFiniteReplica,
    PeerSilent,
    RankExcluded,
)
from lightning_gossip.topology import Topology, build

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_gossip.async_gossip import AsyncGossip
    from lightning_gossip.checkpoints import newest_checkpoint
    from lightning_gossip.flat import FlatState
    from lightning_gossip.pairing import Pairing
    from lightning_gossip.plain_loop import attach
    from lightning_gossip.strategies import ADPSGDStrategy, DPSGDStrategy, GossipStrategy
    from lightning_gossip.sync_gossip import SyncGossip

__version__ = "0.1.0"

__all__ = [
    "ADPSGDStrategy",
    "AsyncGossip",
    "ConfigMismatch",
    "DPSGDStrategy",
    "FlatState",
    "GossipError",
    "GossipStrategy",
    "GossipTimeout",
    "NonFiniteFromPeer",
    "NonFiniteReplica",
    "Pairing",
    "PeerSilent",
    "RankExcluded",
    "SyncGossip",
    "Topology",
    "attach",
    "build",
    "newest_checkpoint",
    "topology",
    "__version__",
]

# Loaded on first access (they import torch; the strategies also Lightning), by module.
_LAZY = {
    "ADPSGDStrategy": "lightning_gossip.strategies",
    "DPSGDStrategy": "lightning_gossip.strategies",
    "GossipStrategy": "lightning_gossip.strategies",
    # The engines and their parts, for a plain PyTorch loop (no Lightning): docs/engines.md
    "AsyncGossip": "lightning_gossip.async_gossip",
    "SyncGossip": "lightning_gossip.sync_gossip",
    "FlatState": "lightning_gossip.flat",
    "Pairing": "lightning_gossip.pairing",
    "newest_checkpoint": "lightning_gossip.checkpoints",
    # gossip for a plain PyTorch loop in one call (no Lightning): docs/engines.md
    "attach": "lightning_gossip.plain_loop",
}
_LIGHTNING = "lightning.pytorch"


def __getattr__(name: str) -> Any:
    """Load the strategy classes and the engine on first access (they import torch; the
    strategies also Lightning)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the lazily loaded strategy classes included."""
    return sorted(set(globals()) | set(_LAZY))


def _register() -> None:
    """Register the strategy names with Lightning (imports the strategies; idempotent).

    A no-op while :mod:`lightning_gossip.strategies` is itself being imported (its import of
    Lightning fired the hook): that package registers the names when it has finished.
    """
    strategies = sys.modules.get("lightning_gossip.strategies")
    if strategies is not None and getattr(strategies.__spec__, "_initializing", False):
        return
    importlib.import_module("lightning_gossip.strategies").register_all()


def _register_or_warn() -> None:
    """:func:`_register`, turning a failure into a ``RuntimeWarning`` (used by the hook, where
    raising would break ``import lightning.pytorch`` for every program)."""
    try:
        _register()
    except Exception as e:  # noqa: BLE001 - reported, and re-raised on class access
        warnings.warn(
            f"lightning_gossip could not register its strategies with Lightning "
            f"({type(e).__name__}: {e}); Trainer(strategy='dpsgd') will not find them",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisteringLoader(importlib.abc.Loader):
    """Wraps the loader of ``lightning.pytorch``: executes the package as usual, then
    registers the strategies. Every other attribute is the wrapped loader's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        """Delegate to the wrapped loader."""
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        """Run the package with its own loader in place, then register the strategies."""
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _uninstall_hook()
        _register_or_warn()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _LightningImportHook(importlib.abc.MetaPathFinder):
    """A :data:`sys.meta_path` finder that only acts on ``lightning.pytorch``: it asks the
    other finders for the package's spec and wraps its loader in :class:`_RegisteringLoader`."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of ``lightning.pytorch`` with a registering loader; ``None`` otherwise."""
        if fullname != _LIGHTNING:
            return None
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, _LightningImportHook):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def _uninstall_hook() -> None:
    """Remove every :class:`_LightningImportHook` from :data:`sys.meta_path`."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LightningImportHook)]


def _install() -> None:
    """Register now if ``lightning.pytorch`` is imported, otherwise hook its import."""
    module = sys.modules.get(_LIGHTNING)
    if module is not None:
        spec = getattr(module, "__spec__", None)
        if not getattr(spec, "_initializing", False):
            _register()
        # else: lightning.pytorch is importing lightning_gossip while it executes; its own
        # import is past the finders, so registration is left to lightning_gossip.strategies
        return
    if not any(isinstance(f, _LightningImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportHook())


_install()
