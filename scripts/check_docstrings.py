"""Fail when a public name of the documented modules has no docstring (run by ``make lint``).

mkdocstrings renders a name without a docstring silently, so this walks what the API reference
shows: every name in each public module's ``__all__`` (or, without one, every public name the
module defines), and the public methods and properties of the public classes. A method that
overrides a documented one of a base class (a Lightning hook) counts as documented. Module
attributes are checked through griffe (the docstring is the string literal after the
assignment, as mkdocstrings reads it).

    python scripts/check_docstrings.py            # exit status 1 and a list when any is missing
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The modules of the API reference (docs/api/*.md), in the order of its navigation.
MODULES = (
    "lightning_gossip",
    "lightning_gossip.strategies",
    "lightning_gossip.topology",
    "lightning_gossip.pairing",
    "lightning_gossip.flat",
    "lightning_gossip.exchange",
    "lightning_gossip.consensus",
    "lightning_gossip.replicas",
    "lightning_gossip.cursor",
    "lightning_gossip.cursor.loader",
    "lightning_gossip.liveness",
    "lightning_gossip.elastic",
    "lightning_gossip.async_gossip",
    "lightning_gossip.mixing",
    "lightning_gossip.sim",
    "lightning_gossip.analysis",
    "lightning_gossip.gossip_period",
)


def public_names(module: types.ModuleType) -> list[str]:
    """``__all__``, or the public names the module itself defines."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__]


def _own_doc(obj: Any) -> str | None:
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return doc.strip() if isinstance(doc, str) and doc.strip() else None


def _documented_in_a_base(cls: type, name: str) -> bool:
    return any(name in vars(base) and _own_doc(vars(base)[name])
               for base in cls.__mro__[1:])


def class_problems(cls: type, where: str) -> list[str]:
    """Public methods and properties defined in ``cls`` without a docstring (own or base's)."""
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = member
        if isinstance(fn, (classmethod, staticmethod)):
            fn = fn.__func__
        if not (inspect.isfunction(fn) or isinstance(member, property)):
            continue
        if _own_doc(member) is None and not _documented_in_a_base(cls, name):
            kind = "property" if isinstance(member, property) else "method"
            out.append(f"{where}.{name} ({kind})")
    return out


@functools.cache
def _griffe_package(package: str) -> Any:
    import griffe

    return griffe.load(package, search_paths=[str(ROOT)])


def attribute_doc(module_name: str, name: str) -> str | None:
    """The docstring mkdocstrings shows for a module attribute (via griffe), if any."""
    import griffe

    try:
        package, _, rest = module_name.partition(".")
        obj = _griffe_package(package)[f"{rest}.{name}" if rest else name]
        while obj.is_alias:
            obj = obj.final_target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    return obj.docstring.value.strip() if obj.docstring else None


def module_problems(module_name: str) -> list[str]:
    """Everything the reference would show for ``module_name`` without a docstring."""
    module = importlib.import_module(module_name)
    out = [] if _own_doc(module) else [f"{module_name} (module)"]
    for name in public_names(module):
        if name.startswith("_"):  # not shown by the reference (``__version__``)
            continue
        where = f"{module_name}.{name}"
        obj = getattr(module, name, None)
        if obj is None and not hasattr(module, name):
            out.append(f"{where} (in __all__ but not defined)")
        elif isinstance(obj, types.ModuleType) or inspect.isclass(obj) or inspect.isroutine(obj):
            if _own_doc(obj) is None:
                out.append(f"{where} ({'class' if inspect.isclass(obj) else 'function'})")
            if inspect.isclass(obj) and getattr(obj, "__module__", "").startswith(module_name):
                out += class_problems(obj, where)
        elif attribute_doc(module_name, name) is None:
            out.append(f"{where} (attribute)")
    return out


def main(argv: list[str]) -> int:
    """Check the modules given (default: :data:`MODULES`); print the names missing docstrings."""
    sys.path.insert(0, str(ROOT))
    problems = [p for m in (argv or MODULES) for p in module_problems(m)]
    seen: set[str] = set()
    problems = [p for p in problems if not (p in seen or seen.add(p))]
    for p in problems:
        print(f"missing docstring: {p}")
    if problems:
        print(f"{len(problems)} public names without a docstring")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
