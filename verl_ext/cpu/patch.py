"""The CPU layer's one way to replace a function of verl or vLLM (the three are listed in docs/engine.md, "Every
patch of verl"): checked against its signature, once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

PATCHED_ATTR = "__verl_ext_cpu__"


def patch_checked(
    owner: Any,
    name: str,
    params: list[str],
    where: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    written_for: str = "verl 0.9.1",
) -> None:
    """Replace ``owner.name`` by ``make(original)`` (wrapped with ``functools.wraps``) unless it already is the
    CPU layer's. ``params``: the parameter names the function has in ``written_for`` (the release the replacement
    was written against); ``where``: its dotted name, for the error a different release gets."""
    original = getattr(owner, name)
    if getattr(original, PATCHED_ATTR, False):
        return
    found = list(inspect.signature(original).parameters)
    if found != params:
        raise RuntimeError(
            f"verl_ext.cpu: {where} has parameters {found}, expected {params} as in {written_for}; the CPU layer's "
            "replacement of it needs updating."
        )
    replacement = functools.wraps(original)(make(original))
    setattr(replacement, PATCHED_ATTR, True)
    setattr(owner, name, replacement)
