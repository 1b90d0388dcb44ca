"""One way for the CPU layer to replace a verl function: checked against verl 0.9.1's signature, once.

The CPU platform changes two of verl's functions for the process (``ray_resources``: the Ray resource check;
``platform``: the FSDP2 save that must copy on CPU). :func:`patch_verl` does it for both: it refuses a verl
whose function no longer takes the parameters the replacement was written for, naming it, and marks the
replacement so that a second call changes nothing.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

PATCHED_ATTR = "__verl_ext_cpu__"


def patch_verl(owner: Any, name: str, params: list[str], where: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make(original)`` (wrapped with ``functools.wraps``) unless it already is the
    CPU layer's. ``params``: the parameter names verl 0.9.1's function has; ``where``: its dotted name, for the
    error a different verl gets."""
    original = getattr(owner, name)
    if getattr(original, PATCHED_ATTR, False):
        return
    found = list(inspect.signature(original).parameters)
    if found != params:
        raise RuntimeError(
            f"verl_ext.cpu: {where} has parameters {found}, expected {params} as in verl 0.9.1; the CPU layer's "
            "replacement of it needs updating."
        )
    replacement = functools.wraps(original)(make(original))
    setattr(replacement, PATCHED_ATTR, True)
    setattr(owner, name, replacement)
