"""The verl keys the divclip path replaces or never reads: the refusals of :mod:`recipe.verl_keys`' table."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl_ext.config import (
    ACTOR,
    CONFIG_TARGET,
)
from verl_ext.config_rules.policy import (
    CORRECTION,
    POLICY,
    ROLLOUT,
    TRAINER_MODE,
)

# ------------------------------------------------------------------------------------------------
# verl's keys the divclip path replaces or never reads (the refusals of recipe.verl_keys' table)
# ------------------------------------------------------------------------------------------------


def verl_config_dir() -> Path:
    """verl's installed config directory (``verl/trainer/config``)."""
    import verl.trainer.config as verl_config

    return Path(verl_config.__file__).resolve().parent


@lru_cache(maxsize=1)
def verl_schema() -> DictConfig:
    """verl's ``ppo_trainer`` config as verl ships it flattened (``_generated_ppo_trainer.yaml``), read without
    Hydra so that it works inside ``recipe.main``'s own Hydra app."""
    path = verl_config_dir() / "_generated_ppo_trainer.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"verl's flattened ppo_trainer config is missing: {path}")
    schema = OmegaConf.load(path)
    assert isinstance(schema, DictConfig)
    return schema


_MISSING = object()


def verl_default(key: str) -> Any:
    """The value verl's schema gives the leaf ``key`` (interpolations resolved within verl's schema). Raises
    ``KeyError`` naming the key if verl's schema has no such key."""
    value = OmegaConf.select(verl_schema(), key, default=_MISSING)
    if value is _MISSING:
        raise KeyError(f"{key} is not a key of verl's ppo_trainer schema")
    return value


def _interpolated_in_verl(key: str) -> bool:
    """Whether verl's schema gives ``key`` an interpolation (its default then is another key's value)."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(verl_schema(), parent)  # the root for a top-level key ('' selects it)
    return isinstance(node, DictConfig) and OmegaConf.is_interpolation(node, name)


def _value(config: DictConfig, key: str) -> Any:
    """The leaf ``key``'s resolved value in the composed config; a key missing there takes verl's default (the
    composed config is verl's schema plus overrides, so only a key deleted on purpose is missing)."""
    value = OmegaConf.select(config, key, default=_MISSING)
    return verl_default(key) if value is _MISSING else value


def _divclip_policy(config: DictConfig) -> bool:
    return OmegaConf.select(config, f"{POLICY}._target_") == CONFIG_TARGET


def _policy_knob(config: DictConfig, knob: str) -> Any:
    """A divclip policy-loss knob (configs/divclip_trainer.yaml declares each one; a deleted one raises
    ``ConfigKeyError`` naming it)."""
    return OmegaConf.select(config, POLICY)[knob]


def _packs_as_update(config: DictConfig) -> bool:
    """Whether the old-log-prob pass is packed as the update: ``pack_old_log_prob_as_update`` (default true)
    with the divclip policy-loss config, always with verl's plain one (``verl_ext.actor_loss.build_actor_loss``).
    ``bypass_mode``, which skips the pass, needs it false (``composed.validate_bypass_mode`` runs first)."""
    return bool(_policy_knob(config, "pack_old_log_prob_as_update")) if _divclip_policy(config) else True


PACK_KEY = f"{POLICY}.pack_old_log_prob_as_update"


PACK_HINT = f"{PACK_KEY}=false gives verl's packing of the old-log-prob pass back"


def check_log_prob_packing(config: DictConfig) -> None:
    """With pack_old_log_prob_as_update the old-log-prob pass is packed with the update's micro-batch settings
    (``verl_ext.engine.packing.infer_as_update``): ``rollout.log_prob_*`` must say what it uses, or be left at a
    default of verl's own (one that interpolates the actor's key follows it, so it is never exempt)."""
    if not _packs_as_update(config):
        return
    pairs = [(f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{ACTOR}.use_dynamic_bsz")]
    if _value(config, f"{ACTOR}.use_dynamic_bsz"):
        pairs.append((f"{ROLLOUT}.log_prob_max_token_len_per_gpu", f"{ACTOR}.ppo_max_token_len_per_gpu"))
    else:
        pairs.append((f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", f"{ACTOR}.ppo_micro_batch_size_per_gpu"))
    for key, replacing in pairs:
        value, used = _value(config, key), _value(config, replacing)
        if value == used or (not _interpolated_in_verl(key) and value == verl_default(key)):
            continue
        raise ValueError(
            f"{key}={value} is not used: with {PACK_KEY}=true (the default) the old-log-prob "
            f"pass is packed exactly as the update, with {replacing}={used}. Set {key}={used} or leave verl's default; "
            f"{PACK_HINT}"
        )
    legacy = f"{ROLLOUT}.log_prob_micro_batch_size"
    if _value(config, legacy) is not None:
        raise ValueError(
            f"{legacy}={_value(config, legacy)} is not used: with {PACK_KEY}=true (the default) "
            f"the old-log-prob pass is packed exactly as the update ({ACTOR}.ppo_micro_batch_size_per_gpu / "
            f"ppo_max_token_len_per_gpu). Leave it null; {PACK_HINT}"
        )


ENTROPY_KEYS = ("entropy_checkpointing", "entropy_from_logits_with_chunking")


def check_entropy_keys(config: DictConfig) -> None:
    """Under ERC both passes compute the entropy with the one graph-free float32 function (the seam swaps
    verl's, chunked or not, and turns ``entropy_checkpointing`` off); the vocabulary pass computes it in its
    own chunks. verl's entropy settings then do nothing: a set one is refused."""
    if not _divclip_policy(config):
        return
    erc = _policy_knob(config, "erc_beta_low") is not None  # set with erc_beta_high (DivClipPolicyLossConfig)
    vocab_pass = bool(_policy_knob(config, "vocab_pass"))
    if not (erc or vocab_pass):
        return
    feature = f"{POLICY}.erc_beta_low/erc_beta_high (ERC)" if erc else f"{POLICY}.vocab_pass=true"
    for name in ENTROPY_KEYS:
        for key in (f"{ACTOR}.{name}", f"{ACTOR}.fsdp_config.{name}"):
            value, default = _value(config, key), verl_default(key)
            if value != default:
                raise ValueError(
                    f"{key}={value} is replaced by {feature}: the divclip path computes the entropy its own way "
                    f"({'one graph-free float32 function in both passes' if erc else 'the chunked vocabulary pass'}), "
                    f"so verl's {name} does nothing. Leave it at verl's default {default}"
                )


def check_rollout_correction_needs_log_probs(config: DictConfig) -> None:
    """verl's v1 trainer computes the rollout-correction weights and rejection mask only when the rollout's
    log-probs are in the batch (``PPOTrainer._compute_advantage``): without them it trains uncorrected."""
    if _value(config, f"{ROLLOUT}.calculate_log_probs"):
        return
    for name in ("rollout_is", "rollout_rs"):
        value = _value(config, f"{CORRECTION}.{name}")
        if value is not None:
            raise ValueError(
                f"{CORRECTION}.{name}={value!r} needs the rollout's log-probs, but "
                f"{ROLLOUT}.calculate_log_probs=false: verl 0.9.1's trainer then computes no rollout correction and "
                f"trains without it, silently. Set {ROLLOUT}.calculate_log_probs=true or {CORRECTION}.{name}=null"
            )


def check_parameter_sync_step(config: DictConfig) -> None:
    """verl's base trainer reads ``trainer.v1.<trainer_mode>.parameter_sync_step`` in every mode
    (``PPOTrainer.step``), training that many local updates a step, each recomputing pi_old first; only
    separate_async's (Decoupled PPO: pi_old is the cycle's first weights) is supported here."""
    active = _value(config, TRAINER_MODE)
    for mode in ("sync", "colocate_async"):
        key = f"trainer.v1.{mode}.parameter_sync_step"
        value = OmegaConf.select(config, key)  # None where no one set the key (verl's schema lacks it)
        if value is None or value == 1:
            continue
        what = (
            f"verl's base trainer honours it in {TRAINER_MODE}={mode} (each step trains {value} local updates, each "
            f"on data.train_batch_size / {value} samples of the step's rollouts, pi_old recomputed before each), but "
            "the divclip on-policy flag treats every later local update as off-policy, so its on-policy gauge and "
            "packing check never see them"
            if active == mode
            else f"verl reads only trainer.v1.{active}.* in {TRAINER_MODE}={active}: it has no effect"
        )
        raise ValueError(
            f"{key}={value}: {what}. Leave it at 1, or use {TRAINER_MODE}=separate_async with "
            "trainer.v1.separate_async.parameter_sync_step (Decoupled PPO, supported)"
        )


def check_loss_type(config: DictConfig) -> None:
    """``rollout_correction.loss_type`` is read only by verl's legacy trainer (``apply_bypass_mode`` switches
    the actor to ``loss_mode=bypass_mode``, which reads it); verl 0.9.1's v1 trainer never does."""
    key = f"{CORRECTION}.loss_type"
    value, default = _value(config, key), verl_default(key)
    if value != default:
        raise ValueError(
            f"{key}={value!r} has no effect: only verl's legacy trainer reads it (its apply_bypass_mode switches the "
            f"actor loss to loss_mode=bypass_mode), and recipe.main runs verl's v1 trainer, whose {CORRECTION}."
            f"bypass_mode keeps {POLICY}.loss_mode. Leave it at verl's default {default!r}; choose the loss with "
            f"{POLICY}.loss_mode"
        )
