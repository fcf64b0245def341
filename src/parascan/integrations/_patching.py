"""The patching engine of parascan's integrations: which functions of another library's
modules are replaced, how they are found, checked, replaced and put back.

An integration (integrations/transformers/) declares :class:`Family` entries, each a
``marker`` that the library's modules define and the :class:`Function` entries to
replace in every such module, then runs :meth:`Patches.apply` on the checked targets.
Nothing here imports the patched library: modules are found by reading their source
(:func:`modules_defining`), so that only those that define a marker are imported.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "Family",
    "Function",
    "Patched",
    "Patches",
    "calls",
    "defines",
    "global_names",
    "leading_params",
    "modules_defining",
    "own_attribute",
    "owner_of",
]


@dataclass(frozen=True)
class Function:
    """One module-level function of a patched module (or a method, ``Class.name``) and
    its replacement."""

    name: str
    replacement: Callable[..., Any]
    # The original's leading parameters, which the callers pass and the replacement
    # takes; left empty: the replacement's named parameters.
    params: tuple[str, ...] = ()
    # Whether a forward of the module must call it (False: patched where present).
    required: bool = True

    def __post_init__(self) -> None:
        if not self.params:
            named = inspect.signature(self.replacement).parameters.values()
            params = tuple(p.name for p in named if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
            object.__setattr__(self, "params", params)


@dataclass(frozen=True)
class Family:
    """A kind of layer: the modules that define ``marker`` are patched."""

    marker: str
    functions: tuple[Function, ...]
    # The modules the patch promises: a library without them is not supported.
    expected: tuple[str, ...] = ()
    # Markers of other families: a module that defines one of them is theirs, not this one's.
    unless: tuple[str, ...] = ()


@functools.lru_cache(maxsize=64)
def modules_defining(
    root: str, pattern: str, prefix: str, marker: str, unless: tuple[str, ...]
) -> tuple[str, ...]:
    """The modules under the directory ``root`` whose files match ``pattern`` (a glob
    relative to it, e.g. ``"*/modeling_*.py"``) and whose source defines ``marker`` and
    none of ``unless``, named ``prefix`` + their dotted path from ``root``. Read as
    text, once per process and arguments: reading a few hundred modeling files is slow
    enough that every patch() paid for it noticeably for each family (BENCHMARKS.md,
    "Figures the source cites")."""
    names = []
    base = Path(root)
    for path in sorted(base.glob(pattern)):
        text = path.read_text(encoding="utf-8", errors="replace")
        if defines(text, marker) and not any(defines(text, o) for o in unless):
            dotted = ".".join(path.relative_to(base).with_suffix("").parts)
            names.append(f"{prefix}.{dotted}")
    return tuple(names)


def defines(source: str, name: str) -> bool:
    """Whether a module's ``source`` defines the function ``name`` (or ``Class.method``)."""
    if "." in name:
        owner, method = name.split(".")
        return f"\nclass {owner}(" in source and f"\n    def {method}(" in source
    return f"\ndef {name}(" in source


def owner_of(module: ModuleType, name: str) -> tuple[object, str]:
    """Where ``name`` (a function, or ``Class.method``) of ``module`` is an attribute:
    the module or the class, and the attribute's name (the class is None when the module
    has no such class)."""
    if "." in name:
        owner, attribute = name.split(".", 1)
        return getattr(module, owner, None), attribute
    return module, name


def own_attribute(owner: object, attribute: str) -> Any:
    """``owner``'s own ``attribute`` as stored (a class's, not inherited, and a static or
    class method as its descriptor), so that a restore puts back exactly what was there."""
    if isinstance(owner, type):
        return vars(owner).get(attribute)
    return getattr(owner, attribute, None)


def global_names(fn: object, depth: int = 3) -> set[str]:
    """The global (and attribute) names ``fn``'s code looks up, and those of the functions
    it wraps: through ``__wrapped__`` and through its closure, since a decorator may wrap
    without functools.wraps (transformers 5.15's ``force_accelerate_hooks`` does)."""
    code = getattr(fn, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    if depth > 0:
        inner = [getattr(fn, "__wrapped__", None)]
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                inner.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        for f in inner:
            if inspect.isfunction(f):
                names |= global_names(f, depth - 1)
    return names


def calls(module: ModuleType, name: str) -> bool:
    """Whether a class of ``module`` has a ``forward`` that looks ``name`` up."""
    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__:
            forward = vars(value).get("forward")
            if forward is not None and name in global_names(forward):
                return True
    return False


def leading_params(original: object, fn: Function) -> tuple[str, ...] | None:
    """None when ``original`` takes ``fn.params`` first, else the parameters it takes
    (empty when they cannot be read)."""
    try:
        params = tuple(inspect.signature(original).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        params = ()
    return None if params[: len(fn.params)] == fn.params else params


class Patched(list[str]):
    """What a patch() returns: the names of the functions replaced now (a list, as
    before), and a context manager whose exit puts back what that call replaced (not
    what an earlier call had), so that ``with patch(...):`` patches for a block."""

    def __init__(self, names: list[str], patches: Patches, new: tuple[tuple[str, str], ...]):
        super().__init__(names)
        self._patches, self._new = patches, new

    def __enter__(self) -> Patched:
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.restore(self._new)


class Patches:
    """The functions an integration has replaced, by (module name, function name), with
    their originals: applied idempotently, restored all at once."""

    def __init__(self) -> None:
        # (module name, function name) -> the original, for every function patched now
        self.originals: dict[tuple[str, str], Callable[..., Any]] = {}

    def original(self, module: ModuleType, name: str) -> Any:
        """The original of ``name`` in ``module``: the one replaced, when it is, else
        what the module (or class) holds now."""
        owner, attribute = owner_of(module, name)
        return self.originals.get((module.__name__, name), own_attribute(owner, attribute))

    def apply(self, targets: Iterable[tuple[ModuleType, Function]]) -> Patched:
        """Replace each target not replaced yet; returns :meth:`names`, as a
        :class:`Patched` that undoes this call's replacements when used as a context."""
        new = []
        for module, fn in targets:
            key = (module.__name__, fn.name)
            if key not in self.originals:
                owner, attribute = owner_of(module, fn.name)
                self.originals[key] = own_attribute(owner, attribute)
                setattr(owner, attribute, fn.replacement)
                new.append(key)
        return Patched(self.names(), self, tuple(new))

    def restore(self, keys: Iterable[tuple[str, str]] | None = None) -> list[str]:
        """Put the originals of ``keys`` (every replaced function when None) back;
        returns the names that were replaced."""
        chosen = list(self.originals) if keys is None else [k for k in keys if k in self.originals]
        for module_name, name in chosen:
            original = self.originals.pop((module_name, name))
            module = sys.modules.get(module_name)
            if module is not None:
                owner, attribute = owner_of(module, name)
                if owner is not None:
                    setattr(owner, attribute, original)
        return sorted(f"{module}.{name}" for module, name in chosen)

    def names(self) -> list[str]:
        """The fully qualified names of the functions replaced now."""
        return sorted(f"{module}.{name}" for module, name in self.originals)
