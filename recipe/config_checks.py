"""Fail-fast validation of a composed config before Ray allocates anything (:func:`validate_divclip_config`): the
plugin, the policy-loss config, every rule of :mod:`verl_ext.config_rules` (as a :class:`ConfigError`), the
validation lengths and the verl keys of :mod:`recipe.verl_keys`. Every error names the config key to change.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig, OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from verl_ext.config import ACTOR
from verl_ext.config_rules import composed as rules
from verl_ext.core import key_reads
from verl_ext.plugin import require_registered


def actor_strategy(model_engine: str) -> str:
    """``actor.strategy`` for verl's ``model_engine`` when the user sets none (configs/divclip_trainer.yaml): FSDP2
    for ``dp`` (verl's ``dp_actor`` says ``fsdp``, FSDP1), else the engine's own name (``megatron``, ...), so the
    strategy checks see what the user chose."""
    return "fsdp2" if model_engine == "dp" else str(model_engine)


OmegaConf.register_new_resolver("divclip.actor_strategy", actor_strategy, replace=True)


class ConfigError(ValueError):
    """A config value the recipe cannot run with; the message names the key."""


@contextmanager
def _reported() -> Iterator[None]:
    """A config rule's ``ValueError`` as a :class:`ConfigError` (same message)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from error


def build_actor_config(config: DictConfig) -> Any:
    """verl's actor dataclass (with our ``DivClipPolicyLossConfig`` inside), or a ConfigError."""
    try:
        return key_reads.bind(omega_conf_to_dataclass(config.actor_rollout_ref.actor), ACTOR)
    except Exception as error:  # hydra wraps the dataclass' ValueError in InstantiationException
        raise ConfigError(f"{ACTOR}: {_root_message(error)}") from error


def validate_divclip_config(config: DictConfig) -> Any:
    """Validate and return the built actor config. Raises ConfigError naming the key."""
    require_registered()
    with _reported():
        rules.check_policy_target(config)
        rules.validate_profile(config)
        rules.validate_data_trace(config)
        rules.validate_filter_groups(config)
    validate_validation_length(config)
    with _reported():
        rules.validate_verl_features(config)
    actor = build_actor_config(config)
    with _reported():
        rules.check_actor_config(config, actor)
        validate_verl_keys(config)
    return actor


def validate_verl_keys(config: DictConfig) -> None:
    """The rule table of every verl key (:mod:`recipe.verl_keys`, docs/verl_features.md): a ``replaced`` key
    holding a value the divclip path would not use, and the table's own refusals (rules of
    :mod:`verl_ext.config_rules`), raise ``ValueError`` naming the keys."""
    from recipe.verl_keys import check_refused_keys, check_replaced_keys

    check_replaced_keys(config)
    check_refused_keys(config)


def validate_validation_length(config: DictConfig) -> None:
    """Per-benchmark validation lengths (``actor_rollout_ref.rollout.custom.validation``) that the
    run can serve: :func:`recipe.validation.length.check_validation_length`."""
    from recipe.validation.length import ValidationLengthError, check_validation_length

    try:
        check_validation_length(config)
    except ValidationLengthError as error:
        raise ConfigError(str(error)) from error


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
    """Let verl's ``validate_config`` check a vLLM LoRA rank without vLLM: verl imports ``vllm_rollout.utils``
    (which imports vLLM) only to read the allowed ranks, so where vLLM is missing that module is stood in for,
    during the check, by verl's own fallback list."""
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
