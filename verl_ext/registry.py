"""The divclip modes inside verl: registered with its ``register_policy_loss``, and the config checks that need it.

* Every constraint of :data:`verl_ext.core.region.CONSTRAINTS` is registered with verl as
  ``policy_loss.loss_mode=<name>`` (:func:`register_modes`, run on import -- the ``verl.plugins`` entry
  point imports this module in every process that imports verl). A verl entry of the same name that
  is not the project's own is never overwritten: registering refuses, naming the mode, so a future verl
  ``gppo`` or ``dcpo`` cannot be silently shadowed.
* The registry's loss function for a mode calls the operator
  (:func:`verl_ext.core.surrogate.constrained_policy_loss`) with what verl's ``ppo_loss`` passes (log-probs,
  advantages, mask, IS weights). What that signature lacks -- both entropies for ERC, pi_old's top-k for
  ``kl_full`` -- the actor loss (:mod:`verl_ext.actor_loss`, a thin wrapper around verl's ``ppo_loss``)
  supplies for the duration of one call (:func:`supplying`); the registered function reads it there.
* :data:`ERC_ON_VERL_MODE` is registered too: the actor loss selects it for ERC stacked on one of verl's own
  modes, and it gates the policy term's log-probs (:func:`verl_ext.verl_modes.verl_policy_loss`) before
  calling verl's registered function -- so the KL loss of ``ppo_loss`` keeps its gradient (ERC refuses an
  entropy bonus: ``actor.entropy_coeff`` must be 0, and the current entropy is a detached mask).
* :func:`check_policy_config` checks a ``DivClipPolicyLossConfig`` against the registry (known
  ``loss_mode``, adaptive delta on a KL-budget mode, ERC / dual-clip on verl's own modes), naming the
  key; :func:`resolve_policy_config` finds the config inside an actor config and checks it.

Imports :mod:`verl_ext.config`, :mod:`verl_ext.core` and verl's ``core_algos``: no engine code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

from verl_ext.config import (
    CONFIG_TARGET,
    POLICY_LOSS_KEY,
    DivClipPolicyLossConfig,
    actor_clip_ratios,
    register_mode_check,
)
from verl_ext.core.coarsened_kl import TopKLogMasses
from verl_ext.core.constraints import KL_FULL_NEEDS_TOPK
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.surrogate import constrained_policy_loss


@dataclass(frozen=True)
class LossInputs:
    """What verl's policy-loss signature lacks, for one call of verl's ``ppo_loss`` made by the actor loss.

    Tensors are padded like ``log_prob`` (``(batch, response_length)``; the top-k ``(..., k + 1)``).

    Attributes:
        old_entropy, entropy: pi_old's and pi_theta's per-token entropies (ERC), else None.
        topk: pi_old's stored top-k log-masses and pi_theta's on them (``kl_full``, the diagnostic), else None.
        verl_mode: with ERC on one of verl's own modes, that mode (the actor loss selects
            :data:`ERC_ON_VERL_MODE` in ``ppo_loss`` and this entry calls ``verl_mode``), else None.
        verl_config: the actor config ``verl_mode``'s function receives (``ppo_loss`` got a view selecting
            :data:`ERC_ON_VERL_MODE`).
    """

    old_entropy: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    topk: Optional[TopKLogMasses] = None
    verl_mode: Optional[str] = None
    verl_config: Any = None


_LOSS_INPUTS: ContextVar[Optional[LossInputs]] = ContextVar("divclip_loss_inputs", default=None)

ERC_ON_VERL_MODE = "divclip_erc_on_verl_mode"
"""The registry entry the actor loss selects for ERC stacked on one of verl's own modes (never a user's
``loss_mode``: :func:`check_policy_config` refuses it)."""

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
    if isinstance(policy, Mapping) and policy.get("_target_") == CONFIG_TARGET:
        fields = {k: v for k, v in policy.items() if k != "_target_"}
        return DivClipPolicyLossConfig(**fields)  # __post_init__ runs check_policy_config
    raise TypeError(
        f"loss_mode={policy.get('loss_mode')!r} is a divclip mode and needs "
        f"actor_rollout_ref.actor.policy_loss._target_={CONFIG_TARGET} (got {type(policy).__name__}); "
        "verl's PolicyLossConfig cannot carry delta / dual_clip_c / ERC knobs"
    )


NOT_COMPOSABLE = frozenset({"bypass_mode"})
"""verl modes ERC cannot stack on: bypass mode skips the old-log-prob pass that yields H(pi_old)."""


@register_mode_check
def check_policy_config(policy: DivClipPolicyLossConfig, prefix: str = POLICY_LOSS_KEY) -> None:
    """Raise ``ValueError`` naming the key where ``policy`` does not fit its ``loss_mode``: the mode
    is registered (a divclip constraint or verl's own), ``adaptive_delta_target`` is set only on a
    KL-budget mode, and on verl's modes ERC can apply and dual-clip is not set (:func:`check_verl_mode_options`).

    The config dataclass checks its values alone (:mod:`verl_ext.config` does not import this
    module); this is the half that needs the registry. Registered with
    :func:`verl_ext.config.register_mode_check`, so it also runs in ``__post_init__`` of every
    config built once this module is imported; consumers (:func:`resolve_policy_config`, the
    actor loss, ``recipe.config_checks``, the adaptive-delta controller) call it as well.
    """
    mode = policy.loss_mode
    if mode == ERC_ON_VERL_MODE:
        raise ValueError(f"{prefix}.loss_mode={mode!r} is internal to the divclip actor loss: name a loss mode")
    if mode not in CONSTRAINTS and mode not in POLICY_LOSS_REGISTRY:
        known = sorted(set(POLICY_LOSS_REGISTRY) | set(CONSTRAINTS))
        raise ValueError(f"{prefix}.loss_mode={mode!r} is not a registered policy loss; known: {known}")
    if policy.adaptive_delta_enabled and not (mode in CONSTRAINTS and CONSTRAINTS[mode].delta_budget):
        budget_modes = sorted(name for name, spec in CONSTRAINTS.items() if spec.delta_budget)
        raise ValueError(
            f"{prefix}.adaptive_delta_target adapts the KL budget delta, which loss_mode={mode!r} "
            f"does not have; the KL-budget modes are {budget_modes}"
        )
    if policy.kl_full_diagnostic and mode not in CONSTRAINTS:
        raise ValueError(
            f"{prefix}.kl_full_diagnostic compares a divclip mode's clip decisions with the full-KL rule; "
            f"verl's loss_mode={mode!r} makes none through the divclip operator: set it to false"
        )
    if mode not in CONSTRAINTS:  # verl's own mode: ERC composes with it, the divclip dual-clip is refused
        check_verl_mode_options(policy, prefix)


def check_verl_mode_options(policy: DivClipPolicyLossConfig, prefix: str = POLICY_LOSS_KEY) -> None:
    """Raise ``ValueError`` naming the key if ``policy``'s ERC knobs cannot apply to its verl ``loss_mode``
    (``verl_ext.verl_modes`` composes them), or ``dual_clip_c`` is set (verl's modes read ``actor.clip_ratio_c``).
    Part of :func:`check_policy_config`, for every non-divclip mode."""
    mode = policy.loss_mode
    if mode not in POLICY_LOSS_REGISTRY:
        return  # check_policy_config reports unknown modes
    if policy.erc_enabled and mode in NOT_COMPOSABLE:
        raise ValueError(
            f"{prefix}.erc_beta_low/erc_beta_high (ERC) cannot stack on loss_mode={mode!r}: it skips the "
            "old-log-prob pass that gives pi_old's entropy"
        )
    if policy.dual_clip_c is not None:
        raise ValueError(
            f"{prefix}.dual_clip_c is the divclip modes' dual-clip cap; verl's loss_mode={mode!r} reads its own "
            "(actor_rollout_ref.actor.clip_ratio_c, which verl's vanilla applies; the other verl modes have no "
            "dual-clip rule): remove dual_clip_c"
        )


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
