"""Fail-fast validation of a composed config, before Ray allocates anything.

verl validates its own keys (``verl.utils.config.validate_config``); this adds what the divclip
recipe needs and verl cannot know: the plugin is registered, the policy-loss config is ours
and valid (building it runs the dataclass checks), ERC has both entropies available.
Every error names the config key to change.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig
from verl.utils.config import omega_conf_to_dataclass

from verl_ext.config import CONFIG_TARGET, DivClipPolicyLossConfig, actor_clip_ratios
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
            actor_clip_ratios(actor)
        except ValueError as error:
            raise ConfigError(str(error)) from error
    if isinstance(policy, DivClipPolicyLossConfig) and policy.adaptive_delta_enabled:
        train_prompts = config.data.get("train_batch_size", None)
        on_policy = actor.ppo_epochs == 1 and train_prompts is not None and actor.ppo_mini_batch_size >= train_prompts
        if on_policy:
            raise ConfigError(
                f"{ACTOR}.policy_loss.adaptive_delta_target: with one PPO mini-batch per step "
                f"({ACTOR}.ppo_mini_batch_size={actor.ppo_mini_batch_size} >= data.train_batch_size={train_prompts}) "
                f"and {ACTOR}.ppo_epochs=1 every update is on-policy, its measured KL3 is 0 and the controller "
                "could only widen delta: use a smaller ppo_mini_batch_size or more ppo_epochs, or a static delta"
            )
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


def _root_message(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error)


# verl's own fallback when vLLM's MaxLoRARanks cannot be imported (verl/workers/rollout/vllm_rollout/utils.py).
VERL_FALLBACK_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_VLLM_UTILS = "verl.workers.rollout.vllm_rollout.utils"


def _max_lora_rank_without_vllm(lora_rank: int) -> int:
    """The smallest allowed vLLM LoRA rank >= ``lora_rank``, from verl's fallback list."""
    if lora_rank <= 0:
        raise ValueError(f"actor_rollout_ref.model.lora_rank must be > 0, got {lora_rank}")
    for rank in VERL_FALLBACK_LORA_RANKS:
        if lora_rank <= rank:
            return rank
    raise ValueError(
        f"actor_rollout_ref.model.lora_rank must be <= {VERL_FALLBACK_LORA_RANKS[-1]} for vLLM, got {lora_rank}"
    )


@contextmanager
def lora_rank_check_without_vllm() -> Iterator[None]:
    """Let verl's ``validate_config`` check a vLLM LoRA rank on machines without vLLM.

    For ``lora_rank > 0`` with ``rollout.name=vllm`` verl imports ``vllm_rollout.utils`` -- which
    imports vLLM and fails without it -- only to read vLLM's allowed ranks. Where vLLM is not
    installed (CPU machines, ``--dry-run``) that one module is stood in for, for the duration of
    the check, by verl's own fallback list; with vLLM installed nothing changes.
    """
    if importlib.util.find_spec("vllm") is not None or _VLLM_UTILS in sys.modules:
        yield
        return
    stand_in = types.ModuleType(_VLLM_UTILS)
    stand_in.get_vllm_max_lora_rank = _max_lora_rank_without_vllm  # type: ignore[attr-defined]
    sys.modules[_VLLM_UTILS] = stand_in
    try:
        yield
    finally:
        sys.modules.pop(_VLLM_UTILS, None)
