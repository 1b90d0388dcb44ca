"""The fp32 entropy feature: what one forward step swaps so that verl's entropy call sites use ours.

verl 0.9.1 computes the entropy in ``FSDPEngineWithLMHead.prepare_model_outputs`` at two call sites:
``self.compute_entropy_from_logits`` (remove-padding, Ulysses and chunked path; an instance attribute,
``torch.compile``d on GPU by default) and ``verl_F.entropy_from_logits`` (the padded path; a module
global). On an engine whose loss declared ``entropy_as_mask`` (ERC), :func:`entropy_swaps` points both at
:func:`verl_ext.core.entropy.entropy_fp32` (or its compiled form on CUDA with ``use_torch_compile``) for
the duration of one step, in *both* passes, so on-policy the two entropies are the same number.

Because the entropy has no graph then, the step also

* turns verl's ``entropy_checkpointing`` off for the step -- on a shallow copy of the engine's config,
  swapped on the engine instance (nothing to recompute, and checkpointing a graph-free function breaks
  the backward);
* gives ``logprobs_from_logits`` flash-attn's in-place backward back (verl turns it off whenever
  ``calculate_entropy`` is on, because its autograd entropy needs the logits). That swap is shared with
  pi_old's top-k and so is built by the seam (:func:`verl_ext.engine.seam.logprobs_swap`).

With ``use_fused_kernels`` the entropy comes from verl's fused kernel in both passes (consistent, bf16):
the feature is resolved to :attr:`EntropyPath.FUSED_KERNEL` and swaps nothing.
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
