"""The config keys the rules name, and the policy-loss config against the loss-mode registry: the loss's own
check (:func:`check_policy_config`, which ``DivClipPolicyLossConfig.__post_init__`` runs once this is imported).
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from verl_ext.config import (
    ACTOR,
    CONFIG_TARGET,
    POLICY_LOSS_KEY,
    DivClipPolicyLossConfig,
    register_mode_check,
)
from verl_ext.core.region import CONSTRAINTS
from verl_ext.knobs import unread_knobs

POLICY = POLICY_LOSS_KEY
ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"
CORRECTION = "algorithm.rollout_correction"
TRAINER_MODE = "trainer.v1.trainer_mode"
VOCAB_PASS = f"{POLICY}.vocab_pass"
ASYNC_MODES = ("colocate_async", "separate_async")

ERC_ON_VERL_MODE = "divclip_erc_on_verl_mode"
"""The registry entry the actor loss selects for ERC stacked on one of verl's own modes (never a user's
``loss_mode``: :func:`check_policy_config` refuses it)."""


NOT_COMPOSABLE = frozenset({"bypass_mode"})
"""verl modes ERC cannot stack on: bypass mode skips the old-log-prob pass that yields H(pi_old)."""


# ------------------------------------------------------------------------------------------------
# The policy-loss config against the loss-mode registry (the loss's own check)
# ------------------------------------------------------------------------------------------------


@register_mode_check
def check_policy_config(policy: DivClipPolicyLossConfig) -> None:
    """Raise ``ValueError`` naming the key where ``policy`` does not fit its ``loss_mode``: the mode is registered,
    ``adaptive_delta_target`` is set only on a KL-budget mode, and on verl's modes ERC can apply and dual-clip is
    not set. The half of the config's checks that needs the registry: it runs in every ``__post_init__`` once this
    module is imported (:func:`verl_ext.config.register_mode_check`), and every consumer of a config calls it too.
    """
    mode = policy.loss_mode
    if mode == ERC_ON_VERL_MODE:
        raise ValueError(f"{POLICY}.loss_mode={mode!r} is internal to the divclip actor loss: name a loss mode")
    if mode not in CONSTRAINTS and mode not in POLICY_LOSS_REGISTRY:
        known = sorted(set(POLICY_LOSS_REGISTRY) | set(CONSTRAINTS))
        raise ValueError(f"{POLICY}.loss_mode={mode!r} is not a registered policy loss; known: {known}")
    if policy.adaptive_delta_enabled and not (mode in CONSTRAINTS and CONSTRAINTS[mode].delta_budget):
        budget_modes = sorted(name for name, spec in CONSTRAINTS.items() if spec.delta_budget)
        raise ValueError(
            f"{POLICY}.adaptive_delta_target adapts the KL budget delta, which loss_mode={mode!r} "
            f"does not have; the KL-budget modes are {budget_modes}"
        )
    if policy.kl_full_diagnostic and mode not in CONSTRAINTS:
        raise ValueError(
            f"{POLICY}.kl_full_diagnostic compares a divclip mode's clip decisions with the full-KL rule; "
            f"verl's loss_mode={mode!r} makes none through the divclip operator: set it to false"
        )
    if mode not in CONSTRAINTS:  # verl's own mode: ERC composes with it, the divclip dual-clip is refused
        check_verl_mode_options(policy)


def check_verl_mode_options(policy: DivClipPolicyLossConfig) -> None:
    """Raise ``ValueError`` naming the key if ``policy``'s ERC knobs cannot apply to its verl ``loss_mode``
    (``verl_ext.verl_modes`` composes them), or ``dual_clip_c`` is set (verl's modes read ``actor.clip_ratio_c``).
    Part of :func:`check_policy_config`, for every non-divclip mode."""
    mode = policy.loss_mode
    if mode not in POLICY_LOSS_REGISTRY:
        return  # check_policy_config reports unknown modes
    if policy.erc_enabled and mode in NOT_COMPOSABLE:
        raise ValueError(
            f"{POLICY}.erc_beta_low/erc_beta_high (ERC) cannot stack on loss_mode={mode!r}: it skips the "
            "old-log-prob pass that gives pi_old's entropy"
        )
    if policy.dual_clip_c is not None:
        raise ValueError(
            f"{POLICY}.dual_clip_c is the divclip modes' dual-clip cap; verl's loss_mode={mode!r} reads its own "
            "(actor_rollout_ref.actor.clip_ratio_c, which verl's vanilla applies; the other verl modes have no "
            "dual-clip rule): remove dual_clip_c"
        )


def check_divclip_target(mode: Any, target: Any) -> None:
    """A divclip ``loss_mode`` runs only with ``policy_loss._target_`` = the divclip config (verl's
    ``PolicyLossConfig`` cannot carry its knobs); ``target``: the configured ``_target_`` or the config's class."""
    if target != CONFIG_TARGET:
        raise ValueError(
            f"{ACTOR}.policy_loss.loss_mode={mode!r} needs {ACTOR}.policy_loss._target_={CONFIG_TARGET} (got "
            f"{target!r}): verl's PolicyLossConfig cannot carry the divclip knobs"
        )


def check_entropy_as_mask(*, entropy_coeff: float) -> None:
    """The rule of :func:`verl_ext.engine.request.entropy_as_mask` (and of :func:`check_erc` before Ray): a
    non-zero ``actor_rollout_ref.actor.entropy_coeff`` differentiates the entropy, which ERC's graph-free float32
    entropy cannot."""
    if entropy_coeff != 0:
        raise ValueError(
            f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff} adds an entropy bonus, which needs the "
            "entropy gradient; the detached entropy path (verl_ext.engine.request.entropy_as_mask) is only valid "
            "with entropy_coeff=0. Leave the loss function undeclared to keep verl's autograd entropy."
        )


def check_knobs_read(actor: Any) -> None:
    """Raise ``ValueError`` listing every knob :func:`unread_knobs` finds (the first names the knob and the mode)."""
    problems = unread_knobs(actor)
    if problems:
        raise ValueError("; ".join(problems))
