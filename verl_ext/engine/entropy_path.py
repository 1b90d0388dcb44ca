"""The fp32 entropy feature (ERC's ``entropy_as_mask``): verl's two entropy call sites pointed at
:func:`verl_ext.core.entropy.entropy_fp32` for one step, ``entropy_checkpointing`` off. docs/engine.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from verl_ext.core.entropy import entropy_fp32, entropy_fp32_compiled
from verl_ext.engine.guard import engine_attribute
from verl_ext.engine.swap import Swap


def entropy_fn_for(engine: Any) -> Callable[..., torch.Tensor]:
    """The fp32 entropy function an engine's two passes share: compiled on CUDA when the engine compiles
    (verl's default ``use_torch_compile``), eager otherwise. One engine always uses one of the two."""
    compile_on = bool(engine_attribute(engine, "engine_config.use_torch_compile"))
    return entropy_fp32_compiled if compile_on and torch.cuda.is_available() else entropy_fp32


def _config_without_entropy_checkpointing(config: Any) -> Any:
    """A shallow copy of verl's (frozen) engine config with ``entropy_checkpointing=False``."""
    view = copy.copy(config)
    object.__setattr__(view, "entropy_checkpointing", False)
    return view


def entropy_swaps(engine: Any, entropy_fn: Callable[..., torch.Tensor]) -> list[Swap]:
    """The swaps of one forward step on the fp32 entropy path (module docstring)."""
    import verl.utils.torch_functional as verl_F

    swaps = [
        Swap(engine, "compute_entropy_from_logits", entropy_fn, "fp32 entropy"),
        Swap(verl_F, "entropy_from_logits", entropy_fn, "fp32 entropy"),
    ]
    if bool(engine_attribute(engine, "engine_config.entropy_checkpointing")):
        swaps.append(
            Swap(engine, "engine_config", _config_without_entropy_checkpointing(engine.engine_config), "fp32 entropy")
        )
    return swaps
