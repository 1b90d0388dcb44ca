"""One forward step's attribute swaps, applied together and restored on every exit path.

Every feature of the seam says what it needs replaced for one step as a list of :class:`Swap` (an owner,
an attribute, the value for the step, the feature asking). :func:`swapped` applies a step's whole list in
one place, refuses two swaps of the same attribute (so no symbol is ever wrapped twice, whatever the
features), and restores each attribute -- or removes an instance attribute that was not there before --
when the step ends, also when it raises.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence


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
    saved: list[tuple[Swap, Any]] = []
    try:
        for swap in swaps:
            saved.append((swap, vars(swap.owner).get(swap.name, _MISSING)))
            setattr(swap.owner, swap.name, swap.value)
        yield
    finally:
        for swap, previous in reversed(saved):
            if previous is _MISSING:
                delattr(swap.owner, swap.name)  # an instance attribute shadowing the class's: remove it
            else:
                setattr(swap.owner, swap.name, previous)
