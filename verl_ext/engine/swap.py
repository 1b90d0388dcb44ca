"""One forward step's attribute swaps, applied together and restored on every exit path; a module global is never
rebound per step but dispatched to the current thread's override. docs/engine.md ("Two engines in one process").
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

ORIGINAL_ATTR = "__divclip_original__"
"""Set on every seam wrapper and dispatcher: verl's function it wraps."""

_DISPATCH_ATTR = "__divclip_dispatch__"
_NO_OVERRIDES: Mapping[tuple[str, str], Callable[..., Any]] = types.MappingProxyType({})
"""The overrides outside any step: none (read-only, so no step can add to the default every context shares)."""
_GLOBAL_OVERRIDES: ContextVar[Mapping[tuple[str, str], Callable[..., Any]]] = ContextVar(
    "divclip_global_overrides", default=_NO_OVERRIDES
)


def install_dispatch(module: types.ModuleType, name: str) -> None:
    """Replace ``module.name`` once (idempotent) with a dispatcher: the current step's override of it (a
    :class:`Swap` applied by :func:`swapped` in this thread or task), else verl's function. Inside a
    ``torch.compile`` trace (verl compiles ``entropy_from_logits`` at engine init) it is verl's function."""
    current = getattr(module, name)
    key = (module.__name__, name)
    if getattr(current, _DISPATCH_ATTR, None) == key:
        return
    original = current

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        return _GLOBAL_OVERRIDES.get().get(key, original)(*args, **kwargs)

    setattr(dispatch, _DISPATCH_ATTR, key)
    setattr(dispatch, ORIGINAL_ATTR, original)
    setattr(module, name, dispatch)


def verl_function(module: types.ModuleType, name: str) -> Callable[..., Any]:
    """verl's own ``module.name``, under the seam's dispatcher if installed (what an override may call)."""
    current = getattr(module, name)
    return getattr(current, ORIGINAL_ATTR, current) if hasattr(current, _DISPATCH_ATTR) else current


@dataclass(frozen=True)
class Swap:
    owner: Any  #: a module, a class or an instance
    name: str
    value: Any
    feature: str  #: who asks, for the error on a conflict


_MISSING = object()


@contextmanager
def swapped(swaps: Sequence[Swap]) -> Iterator[None]:
    """Apply ``swaps`` for the block (see the module docstring)."""
    seen: dict[tuple[int, str], Swap] = {}
    for swap in swaps:
        key = (id(swap.owner), swap.name)
        if key in seen:
            raise RuntimeError(
                f"the divclip seam would swap {getattr(swap.owner, '__name__', type(swap.owner).__name__)}.{swap.name} "
                f"twice in one step ({seen[key].feature!r} and {swap.feature!r}): one swap per attribute"
            )
        seen[key] = swap
    overrides: dict[tuple[str, str], Callable[..., Any]] = {}
    for swap in swaps:
        if isinstance(swap.owner, types.ModuleType):
            key = (swap.owner.__name__, swap.name)
            if getattr(getattr(swap.owner, swap.name, None), _DISPATCH_ATTR, None) != key:
                raise RuntimeError(
                    f"the divclip seam's dispatcher for {key[0]}.{key[1]} is not installed ({swap.feature!r} would "
                    "rebind a module global for every thread): verl_ext.engine.seam.install installs it"
                )
            overrides[key] = swap.value
    token = _GLOBAL_OVERRIDES.set({**_GLOBAL_OVERRIDES.get(), **overrides}) if overrides else None
    saved: list[tuple[Swap, Any]] = []
    try:
        for swap in swaps:
            if isinstance(swap.owner, types.ModuleType):
                continue
            saved.append((swap, vars(swap.owner).get(swap.name, _MISSING)))
            setattr(swap.owner, swap.name, swap.value)
        yield
    finally:
        for swap, previous in reversed(saved):
            if previous is _MISSING:
                delattr(swap.owner, swap.name)  # an instance attribute shadowing the class's: remove it
            else:
                setattr(swap.owner, swap.name, previous)
        if token is not None:
            _GLOBAL_OVERRIDES.reset(token)
