"""Fail-fast validation of a composed config, before Ray allocates anything.

verl validates its own keys (``verl.utils.config.validate_config``); this adds what the divclip
recipe needs and verl cannot know: the plugin is registered, the policy-loss config is ours
and valid (building it runs the dataclass checks), ERC has both entropies available.
Every error names the config key to change.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from verl.utils.config import omega_conf_to_dataclass

from verl_ext.config import CONFIG_TARGET, DivClipPolicyLossConfig, check_clip_ratios
from verl_ext.losses import CONSTRAINTS
from verl_ext.plugin import require_registered

ACTOR = "actor_rollout_ref.actor"


class ConfigError(ValueError):
    """A config value the recipe cannot run with; the message names the key."""


def build_actor_config(config: DictConfig) -> Any:
    """verl's actor dataclass (with our ``DivClipPolicyLossConfig`` inside), or a ConfigError."""
    try:
        return omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    except Exception as error:  # hydra wraps the dataclass' ValueError in InstantiationException
        raise ConfigError(f"{ACTOR}: {_root_message(error)}") from error


def validate_divclip_config(config: DictConfig) -> Any:
    """Validate and return the built actor config. Raises ConfigError naming the key."""
    require_registered()
    actor_cfg = config.actor_rollout_ref.actor
    mode = actor_cfg.policy_loss.get("loss_mode", "vanilla")
    target = actor_cfg.policy_loss.get("_target_", None)
    if mode in CONSTRAINTS and target != CONFIG_TARGET:
        raise ConfigError(
            f"{ACTOR}.policy_loss.loss_mode={mode!r} needs {ACTOR}.policy_loss._target_={CONFIG_TARGET} (got {target!r})"
        )
    actor = build_actor_config(config)
    policy = actor.policy_loss
    if mode in CONSTRAINTS:
        try:
            check_clip_ratios(*_clip_ratios(actor))
        except ValueError as error:
            raise ConfigError(str(error)) from error
    if isinstance(policy, DivClipPolicyLossConfig) and policy.erc_enabled:
        if not actor.calculate_entropy:
            raise ConfigError(
                f"ERC ({ACTOR}.policy_loss.erc_beta_low/erc_beta_high set) needs the current per-token entropy: "
                f"set {ACTOR}.calculate_entropy=True"
            )
        rollout_correction = config.algorithm.get("rollout_correction", None) or {}
        if rollout_correction.get("bypass_mode", False):
            raise ConfigError(
                "ERC needs pi_old's per-token entropy, which only the old-log-prob recompute produces; "
                "algorithm.rollout_correction.bypass_mode=True skips it. Set it to False or turn ERC off."
            )
    return actor


def _clip_ratios(actor: Any) -> tuple[float, float]:
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    return low, high


def _root_message(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error)
