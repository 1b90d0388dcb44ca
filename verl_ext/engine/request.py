"""What a loss asks of the engine that runs it: an :class:`EngineRequest` carried on the (pickled) loss function,
from which the seam sets the engine's features for both passes (the old-log-prob pass has no loss of its own).
Imports no verl or torch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

REQUEST_ATTR = "divclip_engine_request"
"""Attribute of a loss function holding its :class:`EngineRequest`."""

SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")
"""``actor.strategy`` values whose engine (verl's ``FSDPEngineWithLMHead``) the seam hooks. FSDP2 runs on
the CPU platform and in every CPU test; FSDP1 (``fsdp``) only on GPUs (docs/experiments.md)."""

POLICY_LOSS_KEY = "actor_rollout_ref.actor.policy_loss"

STEP_PATH_KEY = "divclip_step_path"
"""Non-tensor key the seam sets on every micro-batch it steps: which path computed its numbers
(``{"seam", "entropy_fp32", "vocab_pass", "pack_old_log_prob_as_update"}`` -> 1.0 / 0.0); the actor loss logs it as
``actor/divclip/path/*``. A micro-batch without it was not stepped by the seam."""


class EntropyPath(str, enum.Enum):
    """Which function computes the per-token entropy in both passes of a run."""

    VERL = "verl"  # verl's entropy_from_logits (autograd, logits dtype, compiled on GPU by default)
    DIVCLIP_FP32 = "divclip_fp32"  # entropy_fp32: float32, no graph, same function in both passes
    FUSED_KERNEL = "fused_kernel"  # verl's fused linear-cross-entropy kernel (bf16) in both passes


@dataclass(frozen=True)
class EngineRequest:
    """What a loss function asks of its engine (see the module docstring)."""

    entropy_as_mask: bool = False
    vocab_pass: bool = False
    pack_old_log_prob_as_update: bool = False

    @property
    def any(self) -> bool:
        return self.entropy_as_mask or self.vocab_pass or self.pack_old_log_prob_as_update

    def keys(self) -> list[str]:
        """The config keys behind the features asked for (for an error naming them)."""
        named = {
            "entropy_as_mask": f"{POLICY_LOSS_KEY}.erc_beta_low/erc_beta_high (ERC's fp32 entropy)",
            "vocab_pass": f"{POLICY_LOSS_KEY}.vocab_pass",
            "pack_old_log_prob_as_update": f"{POLICY_LOSS_KEY}.pack_old_log_prob_as_update",
        }
        return [key for field, key in named.items() if getattr(self, field)]


def request_of(loss_function: Optional[Callable[..., Any]]) -> EngineRequest:
    """The request a loss function carries (an empty one if it declares nothing, or for ``None``)."""
    request = getattr(loss_function, REQUEST_ATTR, None)
    return request if isinstance(request, EngineRequest) else EngineRequest()


def declare(loss_function: Callable[..., Any], **features: bool) -> Callable[..., Any]:
    """``loss_function`` as a picklable ``functools.partial`` whose request adds ``features`` to the one it
    already carries (declarations compose: ERC's mask and the vocabulary pass, say)."""
    unknown = set(features) - {field.name for field in dataclasses.fields(EngineRequest)}
    if unknown:
        raise TypeError(f"unknown engine features {sorted(unknown)}")
    request = dataclasses.replace(request_of(loss_function), **{k: bool(v) for k, v in features.items()})
    if isinstance(loss_function, functools.partial):  # one level: the same function, arguments and attributes
        wrapped = functools.partial(loss_function.func, *loss_function.args, **loss_function.keywords)
        vars(wrapped).update(vars(loss_function))
    else:
        wrapped = functools.partial(loss_function)
    setattr(wrapped, REQUEST_ATTR, request)
    return wrapped


def entropy_as_mask(loss_function: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that ``loss_function`` uses the current entropy only as a (detached) mask (ERC). Valid only
    without an entropy bonus: the rule :func:`verl_ext.config_rules.policy.check_entropy_as_mask`, which the
    caller runs (the actor loss; the recipe's validation before Ray)."""
    return declare(loss_function, entropy_as_mask=True)


def resolve_entropy_path(request: EngineRequest, *, use_fused_kernels: bool) -> EntropyPath:
    """The entropy path a run really takes: with verl's fused kernels the entropy comes from the kernel in
    both passes whatever the loss asks for."""
    if not request.entropy_as_mask:
        return EntropyPath.VERL
    return EntropyPath.FUSED_KERNEL if use_fused_kernels else EntropyPath.DIVCLIP_FP32


def describe(request: EngineRequest, path: EntropyPath) -> str:
    """One log line's worth: how log-probs and entropies are computed, and how the old pass is packed."""
    if request.vocab_pass:
        numbers = "log-probs and entropy from the vocabulary pass (fp32, no logits tensor)"
    else:
        numbers = {
            EntropyPath.VERL: (
                "verl's materialised logits; entropy by verl's entropy_from_logits (autograd, logits dtype)"
            ),
            EntropyPath.DIVCLIP_FP32: "verl's materialised logits; entropy by divclip entropy_fp32 in both passes",
            EntropyPath.FUSED_KERNEL: (
                "verl's fused kernel (bf16) for log-probs and entropy in both passes; the divclip fp32 entropy is "
                "inactive because use_fused_kernels=True"
            ),
        }[path]
    packing = (
        "old-log-prob pass packed as the update"
        if request.pack_old_log_prob_as_update
        else "verl's packing of the old-log-prob pass"
    )
    return f"{numbers}; {packing}"
