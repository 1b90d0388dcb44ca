"""The divclip modes in verl's ``POLICY_LOSS_REGISTRY`` (registered on import, never overwriting verl's entries),
with the inputs its signature lacks supplied for one ``ppo_loss`` call (:func:`supplying`; docs/upstream.md), and
:func:`resolve_policy_config`. Imports no engine code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

from verl_ext.config import DivClipPolicyLossConfig, actor_clip_ratios
from verl_ext.config_rules.policy import ERC_ON_VERL_MODE, check_divclip_target, check_policy_config
from verl_ext.core.coarsened_kl import TopKLogMasses
from verl_ext.core.constraints import KL_FULL_NEEDS_TOPK
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.surrogate import constrained_policy_loss


@dataclass(frozen=True)
class LossInputs:
    """What verl's policy-loss signature lacks, for one ``ppo_loss`` call by the actor loss; tensors padded like
    ``log_prob`` (top-k ``(..., k + 1)``), each None when unused: ``old_entropy``/``entropy`` (ERC), ``topk``
    (``kl_full``, the diagnostic), and with ERC on one of verl's modes ``verl_mode`` with the actor config
    ``verl_config`` its function receives (``ppo_loss`` got a view selecting :data:`ERC_ON_VERL_MODE`)."""

    old_entropy: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    topk: Optional[TopKLogMasses] = None
    verl_mode: Optional[str] = None
    verl_config: Any = None


_LOSS_INPUTS: ContextVar[Optional[LossInputs]] = ContextVar("divclip_loss_inputs", default=None)

ROLLOUT_IS_METRIC = "actor/divclip/rollout_is_weight_mean"
"""Mean over valid tokens of the rollout-correction weights the registered function received from
``ppo_loss`` (1.0 when the micro-batch has no valid token)."""


@contextmanager
def supplying(inputs: LossInputs) -> Iterator[None]:
    """Make ``inputs`` visible to the registered loss functions for the duration of one ``ppo_loss`` call."""
    token = _LOSS_INPUTS.set(inputs)
    try:
        yield
    finally:
        _LOSS_INPUTS.reset(token)


def supplied_inputs() -> Optional[LossInputs]:
    """The inputs the actor loss supplies to the current ``ppo_loss`` call, or None outside one."""
    return _LOSS_INPUTS.get()


_OWN_MODE_ATTR = "__divclip_mode__"
"""Set on every registry function this module creates: tells the project's entries from verl's."""

_ADAPTIVE_NEEDS_TRAINER = (
    "policy_loss.adaptive_delta_target turns on the adaptive delta for loss_mode={mode!r}, which the divclip "
    "trainer runs between actor updates; verl's own trainer would silently keep delta static. Run training "
    "through `python -m recipe.main`, or set adaptive_delta_target to null."
)


def is_own_mode(mode: str) -> bool:
    """Whether verl's registry entry ``mode`` is one of this project's constraints (not verl's own loss)."""
    return getattr(POLICY_LOSS_REGISTRY.get(mode), _OWN_MODE_ATTR, None) == mode


def register_modes() -> None:
    """Register every defined constraint, and :data:`ERC_ON_VERL_MODE`, with verl's ``POLICY_LOSS_REGISTRY``
    (idempotent). Raises ``RuntimeError`` instead of replacing an entry that is not the project's own."""
    import verl

    for mode in (*CONSTRAINTS, ERC_ON_VERL_MODE):
        existing = POLICY_LOSS_REGISTRY.get(mode)
        if existing is not None and not is_own_mode(mode):
            raise RuntimeError(
                f"verl {verl.__version__} already registers a policy loss named {mode!r} "
                f"({getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)}); the divclip "
                f"entry {mode!r} would shadow it. verl-divclip supports verl 0.9.1: rename the entry or pin verl"
            )
        if existing is None:  # verl's own decorator; the registry is only read here, for the collision check
            register_policy_loss(mode)(_erc_on_verl_mode if mode == ERC_ON_VERL_MODE else _make_registry_loss(mode))


def resolve_policy_config(config: Any) -> DivClipPolicyLossConfig:
    """The ``DivClipPolicyLossConfig`` inside an actor config, checked against the mode registry
    (:func:`check_policy_config`), or a clear error."""
    policy = config.policy_loss if hasattr(config, "policy_loss") else config["policy_loss"]
    if isinstance(policy, DivClipPolicyLossConfig):
        check_policy_config(policy)  # it may have been built before this module registered the check
        return policy
    target = (policy.get("_target_") if isinstance(policy, Mapping) else None) or type(policy).__name__
    check_divclip_target(policy.get("loss_mode"), target)
    fields = {k: v for k, v in policy.items() if k != "_target_"}
    return DivClipPolicyLossConfig(**fields)  # __post_init__ runs check_policy_config


def _make_registry_loss(mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """verl's policy-loss signature; what it lacks (ERC's entropies, kl_full's top-k) comes one way only,
        :func:`supplying` (the divclip actor loss around verl's ``ppo_loss``)."""
        if config is None:
            raise ValueError(f"policy loss {mode!r} needs the actor config (config=None)")
        low, high = actor_clip_ratios(config)
        policy = resolve_policy_config(config)
        supplied = supplied_inputs()
        old_entropy = entropy = topk = None
        if supplied is not None:  # called by verl's ppo_loss inside the divclip actor loss
            old_entropy, entropy, topk = supplied.old_entropy, supplied.entropy, supplied.topk
        elif policy.adaptive_delta_enabled:
            raise ValueError(_ADAPTIVE_NEEDS_TRAINER.format(mode=mode))
        if policy.kl_full_diagnostic and topk is None:
            raise ValueError(KL_FULL_NEEDS_TOPK.replace("loss_mode='kl_full'", "kl_full_diagnostic"))
        loss, metrics = constrained_policy_loss(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            mode=mode,
            policy=policy,
            clip_ratio_low=low,
            clip_ratio_high=high,
            loss_agg_mode=loss_agg_mode,
            global_batch_info=config.get("global_batch_info", None),
            rollout_is_weights=rollout_is_weights,
            old_entropy=old_entropy,
            entropy=entropy,
            topk=topk,
        )
        if rollout_is_weights is not None:
            metrics[ROLLOUT_IS_METRIC] = _valid_mean(rollout_is_weights, response_mask)
        return loss, metrics

    policy_loss.__name__ = policy_loss.__qualname__ = f"compute_policy_loss_{mode}"
    setattr(policy_loss, _OWN_MODE_ATTR, mode)
    policy_loss.__doc__ = f"verl policy loss ``{mode}``: the divclip operator with constraint {mode!r}."
    return policy_loss


def _erc_on_verl_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ERC stacked on verl's ``supplied_inputs().verl_mode``: the policy term's log-probs gated by the entropy
    band, then verl's registered function with the actor's own config (:mod:`verl_ext.verl_modes`)."""
    from verl_ext.verl_modes import verl_policy_loss

    supplied = supplied_inputs()
    if supplied is None or supplied.verl_mode is None:
        raise ValueError(
            f"policy loss {ERC_ON_VERL_MODE!r} runs only inside the divclip actor loss (verl_ext.actor_loss)"
        )
    actor_config = supplied.verl_config
    loss, metrics = verl_policy_loss(
        supplied.verl_mode,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=actor_config,
        policy=resolve_policy_config(actor_config),
        rollout_is_weights=rollout_is_weights,
        old_entropy=supplied.old_entropy,
        entropy=supplied.entropy,
    )
    if rollout_is_weights is not None:
        metrics[ROLLOUT_IS_METRIC] = _valid_mean(rollout_is_weights, response_mask)
    return loss, metrics


setattr(_erc_on_verl_mode, _OWN_MODE_ATTR, ERC_ON_VERL_MODE)


def _valid_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    valid = values.detach()[mask.bool()]
    return float(valid.float().mean()) if valid.numel() else 1.0


register_modes()
