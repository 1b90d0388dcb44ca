"""The rules of a composed config, run by ``recipe.main``'s validation before Ray starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from verl.workers.config import PolicyLossConfig

from verl_ext.config import (
    ACTOR,
    CONFIG_TARGET,
    POLICY_LOSS_KEY,
    DivClipPolicyLossConfig,
    actor_clip_ratios,
)
from verl_ext.config_rules.policy import (
    ASYNC_MODES,
    ROLLOUT,
    TRAINER_MODE,
    VOCAB_PASS,
    check_divclip_target,
    check_entropy_as_mask,
    check_knobs_read,
    check_policy_config,
)
from verl_ext.core.coarsened_kl import check_top_k
from verl_ext.core.region import CONSTRAINTS
from verl_ext.engine.request import SUPPORTED_STRATEGIES

# ------------------------------------------------------------------------------------------------
# The composed config (recipe.main's validation, before Ray starts)
# ------------------------------------------------------------------------------------------------


def check_policy_target(config: DictConfig) -> None:
    """A divclip ``loss_mode`` needs ``policy_loss._target_`` = the divclip config; with verl's own config class
    every divclip knob must be at its default (those are dropped so verl's dataclass builds)."""
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    mode, target = policy_loss.loss_mode, policy_loss["_target_"]
    if mode in CONSTRAINTS:
        check_divclip_target(mode, target)
    if target != CONFIG_TARGET:
        _drop_unset_divclip_keys(policy_loss, target)


def _drop_unset_divclip_keys(policy_loss: DictConfig, target: Any) -> None:
    """:func:`check_policy_target`'s second half: drop the divclip knobs at their defaults
    (configs/divclip_trainer.yaml); a set one is an error naming it."""
    from omegaconf import open_dict

    defaults = {f.name: f.default for f in dataclasses.fields(DivClipPolicyLossConfig)}
    ours = set(defaults) - {f.name for f in dataclasses.fields(PolicyLossConfig)}
    for key in sorted(ours & set(policy_loss.keys())):
        if policy_loss[key] != defaults[key]:
            raise ValueError(
                f"{ACTOR}.policy_loss.{key}={policy_loss[key]!r} is a divclip knob: it needs "
                f"{ACTOR}.policy_loss._target_={CONFIG_TARGET} (got {target!r}); verl's modes accept it there too"
            )
    with open_dict(policy_loss):
        for key in ours & set(policy_loss.keys()):
            del policy_loss[key]


#: ``+profile=<name>`` options: configs/profile/<name>.yaml; ``paper`` (the paper text) is the default.
PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "profile"


DEFAULT_PROFILE = "paper"


#: The paper whose experiments each profile belongs to (``divclip.paper``, set by the base configs).
PROFILE_PAPER = {"released": "erc"}


def known_profiles() -> list[str]:
    return [DEFAULT_PROFILE, *sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))]


def validate_profile(config: DictConfig) -> None:
    """``divclip.profile`` names a real profile, applied to the experiments it was written for."""
    divclip = config.divclip
    profile = divclip.profile
    if profile not in known_profiles():
        raise ValueError(
            f"divclip.profile={profile!r} is not a profile; known: {known_profiles()} "
            "(select one with +profile=<name>, which also applies its settings)"
        )
    paper = PROFILE_PAPER.get(profile)
    if paper is not None and divclip.paper != paper:
        raise ValueError(
            f"+profile={profile} (configs/profile/{profile}.yaml) is for the {paper.upper()} experiments "
            f"(configs/experiments/base/{paper}.yaml), but this config has divclip.paper={divclip.paper!r}"
        )


def validate_data_trace(config: DictConfig) -> None:
    """``divclip.data_trace`` (:mod:`recipe.data_trace`) is written by the trainer on whichever Ray node it
    runs: only an absolute path means the same file everywhere."""
    path = config.divclip.data_trace
    if path is not None and (not isinstance(path, str) or not Path(path).is_absolute()):
        raise ValueError(f"divclip.data_trace={path!r} must be an absolute path (the trainer writes it on a Ray node)")


def validate_filter_groups(config: DictConfig) -> None:
    """Dynamic sampling keys that verl 0.9.1's v1 trainer would only warn about and ignore."""
    filter_groups = config.algorithm.filter_groups
    if not filter_groups.enable:
        return
    if filter_groups.max_num_gen_batches > 0:
        raise ValueError(
            "algorithm.filter_groups.max_num_gen_batches is ignored by verl 0.9.1's v1 trainer (its replay buffer "
            "refills dropped groups until data.train_batch_size remain); set it to 0 and bound generation with "
            "algorithm.filter_groups.max_inflight_gen_batches (in units of data.train_batch_size)"
        )
    gen_batch_size = config.data.gen_batch_size
    if gen_batch_size not in (None, 1):
        raise ValueError(
            f"data.gen_batch_size={gen_batch_size} is replaced by 1 in verl 0.9.1's v1 trainer when "
            "algorithm.filter_groups.enable=true; unset it and use algorithm.filter_groups.max_inflight_gen_batches"
        )


def validate_verl_features(config: DictConfig) -> None:
    """verl features the recipe's path would drop without a word, refused naming the key (docs/verl_features.md):
    ``distillation.enabled`` (the divclip actor loss replaces verl's ``distillation_ppo_loss``),
    ``trainer.use_v1=false`` (``recipe.main`` runs verl's v1 trainer) and ``actor.calculate_sum_pi_squared``
    (only verl's legacy trainer reads it)."""

    if config.distillation.enabled:
        raise ValueError(
            "distillation.enabled=true: verl's actor would train with distillation_ppo_loss, which verl-divclip "
            "replaces with its own actor loss (every mode, through set_loss_fn), dropping the distillation term. "
            "Distillation is not supported by recipe.main: run verl's main_ppo for it, or set "
            "distillation.enabled=false"
        )
    if not config.trainer.use_v1:
        raise ValueError(
            "trainer.use_v1=false selects verl's legacy trainer, which recipe.main does not run (its hooks are the v1 "
            "trainer's, in every trainer.v1.trainer_mode): set trainer.use_v1=true"
        )
    if config.actor_rollout_ref.actor.calculate_sum_pi_squared:
        raise ValueError(
            f"{ACTOR}.calculate_sum_pi_squared=true has no effect in verl 0.9.1's v1 trainer (it never asks the engine "
            "for the sum of squared probabilities; only the legacy trainer's optimal-token baseline reads it): set it "
            "false"
        )


def check_actor_config(config: DictConfig, actor: Any) -> None:
    """The rules on the built actor config ``actor`` (verl's dataclass) and the rest of ``config``, in order."""
    policy = actor.policy_loss
    divclip = isinstance(policy, DivClipPolicyLossConfig)
    if divclip:  # loss_mode known, adaptive delta on a KL-budget mode, ERC / dual-clip on verl's modes
        check_policy_config(policy)
    if policy.loss_mode in CONSTRAINTS:
        actor_clip_ratios(actor)
    check_knobs_read(actor)
    if divclip and policy.adaptive_delta_enabled:
        check_adaptive_delta_updates(config, actor)
    validate_strategy(actor, policy if divclip else None)
    validate_trainer_mode(config, actor)
    if divclip and policy.vocab_pass:
        validate_vocab_pass(config)
    if divclip and policy.stores_old_topk:
        validate_old_topk(config, actor, policy)
    if divclip and policy.erc_enabled:
        check_erc(config, actor)
    validate_bypass_mode(config, actor)
    validate_old_log_prob_from_update(config)


def check_adaptive_delta_updates(config: DictConfig, actor: Any) -> None:
    """``policy_loss.adaptive_delta_target`` needs one update a step (``parameter_sync_step=1``) that is not
    on-policy (more than one PPO mini-batch or epoch): the controller reads each update's KL3 from its pi_old."""
    train_prompts = config.data.train_batch_size
    on_policy = actor.ppo_epochs == 1 and train_prompts is not None and actor.ppo_mini_batch_size >= train_prompts
    trainer_mode = _trainer_mode(config)
    sync_step = OmegaConf.select(config, f"trainer.v1.{trainer_mode}.parameter_sync_step", default=1)
    if sync_step != 1:
        # the controller reads one update a step, its KL3 against the pi_old it started from; in a Decoupled-PPO
        # cycle every update but the first starts away from pi_old (the cycle's first weights)
        raise ValueError(
            f"{ACTOR}.policy_loss.adaptive_delta_target: {TRAINER_MODE}={trainer_mode} with "
            f"trainer.v1.{trainer_mode}.parameter_sync_step={sync_step} trains {sync_step} updates per step "
            "against the cycle's first weights as pi_old, so no update but the first measures its own KL3 from the "
            "pi_old it started at: use parameter_sync_step=1 (one update a step) or a static delta"
        )
    if on_policy:
        raise ValueError(
            f"{ACTOR}.policy_loss.adaptive_delta_target: with one PPO mini-batch per step "
            f"({ACTOR}.ppo_mini_batch_size={actor.ppo_mini_batch_size} >= data.train_batch_size={train_prompts}) "
            f"and {ACTOR}.ppo_epochs=1 every update is on-policy, its measured KL3 is 0 and the controller "
            "could only widen delta: use a smaller ppo_mini_batch_size or more ppo_epochs, or a static delta"
        )


def bypass_mode(config: DictConfig) -> bool:
    """``algorithm.rollout_correction.bypass_mode`` (pi_old := mu, no old-log-prob pass); verl reads a null
    ``rollout_correction`` as no rollout correction at all."""
    rollout_correction = config.algorithm.rollout_correction
    return rollout_correction is not None and bool(rollout_correction.bypass_mode)


def check_erc(config: DictConfig, actor: Any) -> None:
    """ERC needs both entropies: the current one (``actor.calculate_entropy``, no entropy bonus) and pi_old's,
    which only the old-log-prob recompute gives (not ``rollout_correction.bypass_mode``)."""
    if not actor.calculate_entropy:
        raise ValueError(
            f"ERC ({ACTOR}.policy_loss.erc_beta_low/erc_beta_high set) needs the current per-token entropy: "
            f"set {ACTOR}.calculate_entropy=True"
        )
    try:
        check_entropy_as_mask(entropy_coeff=actor.entropy_coeff)
    except ValueError as error:
        raise ValueError(f"ERC: {error}") from error
    if bypass_mode(config):
        raise ValueError(
            "ERC needs pi_old's per-token entropy, which only the old-log-prob recompute produces; "
            "algorithm.rollout_correction.bypass_mode=True skips it. Set it to False or turn ERC off."
        )


def requested_features(policy: DivClipPolicyLossConfig | None) -> dict[str, bool]:
    """Config key -> whether the policy-loss config ``policy`` (``None`` for verl's plain config, which the
    divclip actor loss packs as the update) turns on a feature only the seam provides."""
    if policy is None:
        return {f"{POLICY_LOSS_KEY}.pack_old_log_prob_as_update": True}
    return {
        f"{POLICY_LOSS_KEY}.erc_beta_low/erc_beta_high": policy.erc_enabled,
        f"{POLICY_LOSS_KEY}.vocab_pass": bool(policy.vocab_pass),
        f"{POLICY_LOSS_KEY}.loss_mode=kl_full": policy.loss_mode == "kl_full",
        f"{POLICY_LOSS_KEY}.kl_full_diagnostic": bool(policy.kl_full_diagnostic),
        f"{POLICY_LOSS_KEY}.pack_old_log_prob_as_update": bool(policy.pack_old_log_prob_as_update),
    }


def validate_strategy(actor: Any, policy: DivClipPolicyLossConfig | None) -> None:
    """The engine seam, where every feature the recipe adds inside verl's actor engine lives, covers verl's FSDP
    engine only (:data:`verl_ext.engine.request.SUPPORTED_STRATEGIES`): another ``actor.strategy`` with any of
    them on would run silently without them, so it is refused naming the keys (:func:`requested_features`)."""
    strategy = actor.strategy
    if strategy in SUPPORTED_STRATEGIES:
        return
    needed = [key for key, on in requested_features(policy).items() if on]
    if needed:
        raise ValueError(
            f"{ACTOR}.strategy={strategy!r}: {', '.join(needed)} need(s) verl-divclip's engine seam, which covers "
            f"strategies {list(SUPPORTED_STRATEGIES)} only (verl's FSDP engine); with {strategy!r} the run would "
            f"silently use verl's own entropy and packing. Use {ACTOR}.strategy=fsdp2 (or fsdp), or turn these keys "
            f"off ({ACTOR}.policy_loss.pack_old_log_prob_as_update=false needs "
            f"{ACTOR}.policy_loss._target_={CONFIG_TARGET})"
        )


def validate_trainer_mode(config: DictConfig, actor: Any) -> None:
    """``trainer.v1.trainer_mode`` selects verl's trainer class, with the divclip features on top in every mode
    (``recipe.trainer.DIVCLIP_TRAINERS``). What verl itself would only assert after Ray has started, and what
    the async modes need from the recipe: :data:`TRAINER_MODE_RULES`, in order, each naming its keys."""
    for rule in TRAINER_MODE_RULES:
        rule(config, actor)


def _trainer_mode(config: DictConfig) -> str:
    return config.trainer.v1.trainer_mode


def check_trainer_mode_registered(config: DictConfig, actor: Any) -> None:
    """A mode of verl's trainer registry."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    mode = _trainer_mode(config)
    try:
        get_trainer_cls(mode)
    except ValueError as error:
        raise ValueError(f"{TRAINER_MODE}={mode!r}: {error}") from error


def check_async_behaviour_log_probs(config: DictConfig, actor: Any) -> None:
    """Async modes: ``rollout.calculate_log_probs=true`` -- the behaviour policy's log-probs, from which the
    staleness figures (mu against pi_old) and verl's rollout correction are computed."""
    mode = _trainer_mode(config)
    if mode in ASYNC_MODES and not config.actor_rollout_ref.rollout.calculate_log_probs:
        raise ValueError(
            f"{TRAINER_MODE}={mode} trains on samples of older policies: {ROLLOUT}.calculate_log_probs=true is needed "
            "for the behaviour policy's log-probs (the staleness figures actor/divclip/staleness/* and verl's "
            "algorithm.rollout_correction read them)"
        )


def _sync_step(config: DictConfig) -> int:
    return int(config.trainer.v1.separate_async.parameter_sync_step)


def check_separate_async_batch(config: DictConfig, actor: Any) -> None:
    """``separate_async``: ``data.train_batch_size == parameter_sync_step * actor.ppo_mini_batch_size``."""
    if _trainer_mode(config) != "separate_async":
        return
    sync_step, train_batch_size = _sync_step(config), int(config.data.train_batch_size)
    if train_batch_size != sync_step * int(actor.ppo_mini_batch_size):
        raise ValueError(
            f"{TRAINER_MODE}=separate_async trains one mini-batch per weight sync step: data.train_batch_size="
            f"{train_batch_size} must equal trainer.v1.separate_async.parameter_sync_step={sync_step} x "
            f"{ACTOR}.ppo_mini_batch_size={actor.ppo_mini_batch_size}"
        )


def check_separate_async_rollout_pool(config: DictConfig, actor: Any) -> None:
    """``separate_async``: a standalone rollout pool (``rollout.nnodes`` and ``rollout.n_gpus_per_node`` > 0)."""
    if _trainer_mode(config) != "separate_async":
        return
    rollout = config.actor_rollout_ref.rollout
    for key in ("nnodes", "n_gpus_per_node"):
        value = rollout[key]
        if value is None or int(value) <= 0:
            raise ValueError(
                f"{TRAINER_MODE}=separate_async generates on a standalone rollout pool: {ROLLOUT}.{key} must be > 0 "
                f"(got {value})"
            )


def check_separate_async_weight_transfer(config: DictConfig, actor: Any) -> None:
    """``separate_async``: a weight-transfer backend other than ``naive`` (``rollout.checkpoint_engine.backend``;
    ``cpu_gloo`` on the cpu platform)."""
    if _trainer_mode(config) != "separate_async":
        return
    backend = config.actor_rollout_ref.rollout.checkpoint_engine.backend
    if backend == "naive":
        raise ValueError(
            f"{TRAINER_MODE}=separate_async moves weights to the standalone rollout pool with a checkpoint engine: "
            f"{ROLLOUT}.checkpoint_engine.backend=naive only serves colocated rollouts (nccl, nixl, ... on GPUs; "
            "cpu_gloo on the cpu platform)"
        )
    if config.trainer.device == "cpu" and backend != "cpu_gloo":
        raise ValueError(
            f"{TRAINER_MODE}=separate_async on the cpu platform (trainer.device=cpu) moves weights with the cpu_gloo "
            f"checkpoint engine: {ROLLOUT}.checkpoint_engine.backend={backend} needs GPUs"
        )


def check_separate_async_hybrid_engine(config: DictConfig, actor: Any) -> None:
    """``separate_async``: verl's hybrid engine on (``hybrid_engine=false`` fails inside verl 0.9.1)."""
    if _trainer_mode(config) == "separate_async" and not config.actor_rollout_ref.hybrid_engine:
        raise ValueError(
            f"{TRAINER_MODE}=separate_async with actor_rollout_ref.hybrid_engine=false fails inside verl 0.9.1's "
            "PPOTrainerSeparateAsync._setup (a logger call with flush=True): leave actor_rollout_ref.hybrid_engine=true"
        )


def check_separate_async_reward_pool(config: DictConfig, actor: Any) -> None:
    """``separate_async``: a reward model (if any) in its own resource pool."""
    if (
        _trainer_mode(config) == "separate_async"
        and config.reward.reward_model.enable
        and not config.reward.reward_model.enable_resource_pool
    ):
        raise ValueError(
            f"{TRAINER_MODE}=separate_async never pauses the standalone rollout to free memory for a colocated reward "
            "model: with reward.reward_model.enable=true set reward.reward_model.enable_resource_pool=true"
        )


def check_separate_async_switch(config: DictConfig, actor: Any) -> None:
    """``separate_async``: no rollout disaggregation with the hybrid rollout switch."""
    if (
        _trainer_mode(config) == "separate_async"
        and config.trainer.v1.separate_async.hybrid_rollout.enable_switch
        and config.actor_rollout_ref.hybrid_engine
        and config.actor_rollout_ref.rollout.disaggregation.enabled
    ):
        raise ValueError(
            f"{TRAINER_MODE}=separate_async: trainer.v1.separate_async.hybrid_rollout.enable_switch=true does not "
            f"support {ROLLOUT}.disaggregation.enabled=true (verl moves paused replicas' queued requests)"
        )


def check_separate_async_micro_batches(config: DictConfig, actor: Any) -> None:
    """``separate_async`` with fixed micro-batches: they divide each data-parallel rank's share of an update's
    samples (one update per ``parameter_sync_step``)."""
    if _trainer_mode(config) != "separate_async" or actor.use_dynamic_bsz:
        return
    rollout = config.actor_rollout_ref.rollout
    # data-parallel ranks: Ulysses sequence parallelism shares each sample among sp ranks
    ranks = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node) // _ulysses_size(actor)
    rows = int(config.data.train_batch_size) // _sync_step(config) * int(rollout.n)
    for key, size in (
        (f"{ACTOR}.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        (f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu),
    ):
        if size and (rows % ranks or (rows // ranks) % int(size)):
            raise ValueError(
                f"{TRAINER_MODE}=separate_async trains {rows} samples per update (data.train_batch_size / "
                f"parameter_sync_step x rollout.n) over {ranks} data-parallel actor ranks; {key}={size} must "
                f"divide each rank's {rows / ranks:g}"
            )


#: :func:`validate_trainer_mode`'s rules, in the order they are checked
TRAINER_MODE_RULES = (
    check_trainer_mode_registered,
    check_async_behaviour_log_probs,
    check_separate_async_batch,
    check_separate_async_rollout_pool,
    check_separate_async_weight_transfer,
    check_separate_async_hybrid_engine,
    check_separate_async_reward_pool,
    check_separate_async_switch,
    check_separate_async_micro_batches,
)


def _ulysses_size(actor: Any) -> int:
    """The actor's Ulysses sequence-parallel size: the FSDP actor's key or its engine's, whichever is set (verl's
    ``FSDPActorConfig`` has both); 1 for an actor without an FSDP engine (Megatron's has neither key)."""
    if "fsdp_config" not in actor:
        return 1
    return max(int(actor.ulysses_sequence_parallel_size), int(actor.fsdp_config.ulysses_sequence_parallel_size))


def validate_bypass_mode(config: DictConfig, actor: Any) -> None:
    """``algorithm.rollout_correction.bypass_mode=true`` skips the old-log-prob pass (pi_old := mu, the rollout's
    log-probs), so there is no pass to pack as the update: ``pack_old_log_prob_as_update`` must be false."""
    policy = actor.policy_loss
    if bypass_mode(config) and bool(getattr(policy, "pack_old_log_prob_as_update", True)):
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode=true skips the old-log-prob pass (pi_old is the rollout's mu), "
            f"so {ACTOR}.policy_loss.pack_old_log_prob_as_update=true has no pass to pack as the update: set it false "
            f"(a key of {ACTOR}.policy_loss._target_={CONFIG_TARGET})"
        )


OLD_FROM_UPDATE_KEY = f"{ACTOR}.policy_loss.old_log_prob_from_update"


#: advantage estimators that read old_log_probs before the update (verl's compute_advantage)
_ESTIMATORS_READING_PI_OLD = ("optimal_token_baseline", "tir_optimal_token_baseline")


def old_log_prob_from_update_blocker(config: DictConfig) -> str | None:
    """Why the update's first forward is not pi_old, or verl needs pi_old before the update, for this config
    (None: ``policy_loss.old_log_prob_from_update`` is exact; :mod:`verl_ext.engine.old_from_update`). Every read
    of ``old_log_probs`` / ``entropy`` in verl 0.9.1's v1 trainer before ``_update_actor``: ``_compute_old_log_prob``
    (metrics, recomputed after the update), ``_compute_advantage`` (KL in the reward, rollout-correction weights and
    rejection, the optimal-token-baseline estimators); the worker checks its model for dropout itself."""
    actor = config.actor_rollout_ref.actor
    policy = actor.policy_loss
    rollout_correction = config.algorithm.rollout_correction
    trainer_mode = _trainer_mode(config)
    if not policy.pack_old_log_prob_as_update:
        return f"{ACTOR}.policy_loss.pack_old_log_prob_as_update=false (the pass is not packed as the update)"
    if bypass_mode(config):
        return "algorithm.rollout_correction.bypass_mode=true (there is no old-log-prob pass)"
    if config.algorithm.use_kl_in_reward:
        return "algorithm.use_kl_in_reward=true (verl's apply_kl_penalty reads pi_old before the update)"
    if config.actor_rollout_ref.rollout.calculate_log_probs and (
        rollout_correction is not None
        and (rollout_correction.rollout_is is not None or rollout_correction.rollout_rs is not None)
    ):
        return (
            "algorithm.rollout_correction.rollout_is / rollout_rs (their weights and rejection read pi_old before the "
            "update)"
        )
    if config.algorithm.adv_estimator in _ESTIMATORS_READING_PI_OLD:
        return f"algorithm.adv_estimator={config.algorithm.adv_estimator} (the estimator reads pi_old)"
    if trainer_mode == "separate_async":
        return f"{TRAINER_MODE}=separate_async (a Decoupled-PPO cycle's pi_old is its first weights, not the update's)"
    if _ulysses_size(actor) > 1:
        return f"{ACTOR}.ulysses_sequence_parallel_size > 1 (one rank returns the group's outputs)"
    dropout = _local_dropout(config.actor_rollout_ref.model.path)
    if dropout is not None:
        return f"the model's {dropout} (a train-mode forward is not the eval-mode pass)"
    return None


def validate_old_log_prob_from_update(config: DictConfig) -> None:
    """``policy_loss.old_log_prob_from_update=true`` where it is not exact is refused, naming the reason."""
    # verl's own PolicyLossConfig has no such key: nothing asked
    if config.actor_rollout_ref.actor.policy_loss.get("old_log_prob_from_update") is not True:
        return
    blocker = old_log_prob_from_update_blocker(config)
    if blocker is not None:
        raise ValueError(
            f"{OLD_FROM_UPDATE_KEY}=true, but the update's first forward is not pi_old here: {blocker}. "
            "Leave it null (taken only where exact) or set it false"
        )


def _local_model_config(model_path: Any) -> dict[str, Any]:
    """A local Hugging Face checkpoint's config.json; empty when the path is not a local directory (a hub id)."""
    config_file = Path(str(model_path)).expanduser() / "config.json" if model_path else None
    return json.loads(config_file.read_text()) if config_file is not None and config_file.is_file() else {}


def _local_dropout(model_path: Any) -> str | None:
    """``key=value`` of a positive dropout in a local Hugging Face checkpoint's config.json, or None."""
    for key, value in _local_model_config(model_path).items():
        if "dropout" in key and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return f"{key}={value}"
    return None


def validate_vocab_pass(config: DictConfig) -> None:
    """``policy_loss.vocab_pass=true`` never builds the logits: refuse what needs them or another forward,
    naming the keys (per-sample temperatures are fine: one temperature per token; ``calculate_sum_pi_squared``
    and distillation are refused for every run by :func:`validate_verl_features`)."""
    model = config.actor_rollout_ref.model
    if model.use_fused_kernels:
        raise ValueError(
            f"{VOCAB_PASS}=true and actor_rollout_ref.model.use_fused_kernels=true both replace the LM head's logits "
            "(verl's fused forward reads lm_head.weight outside the head and fails under FSDP2): set one of them false"
        )
    if model.lora_rank > 0 or model.lora_adapter_path:
        targets = model.target_modules
        names = [targets] if isinstance(targets, str) else list(targets or [])
        if any("lm_head" in str(name) for name in names):
            raise ValueError(
                f"{VOCAB_PASS}=true reads the LM head's own weight; actor_rollout_ref.model.target_modules={names} "
                "puts a LoRA adapter on lm_head: drop lm_head from target_modules or set the vocabulary pass false"
            )


def validate_old_topk(config: DictConfig, actor: Any, policy: DivClipPolicyLossConfig) -> None:
    """``kl_full`` / ``kl_full_diagnostic`` need pi_old's top-k from the old-log-prob pass's logits of an unsharded
    sequence: refuse what skips that pass or those logits, and a k above a local checkpoint's vocabulary."""
    what = (
        f"{ACTOR}.policy_loss.loss_mode=kl_full"
        if policy.loss_mode == "kl_full"
        else f"{ACTOR}.policy_loss.kl_full_diagnostic=true"
    )
    if bypass_mode(config):
        raise ValueError(
            f"{what} needs pi_old's top-k, stored by the old-log-prob recompute; "
            "algorithm.rollout_correction.bypass_mode=True skips it. Set it to False."
        )
    model = config.actor_rollout_ref.model
    if model.use_fused_kernels:
        raise ValueError(
            f"{what} needs the logits to take pi_old's top-k and pi_theta's log-probs on it; verl's fused kernels "
            "never materialise them: set actor_rollout_ref.model.use_fused_kernels=False"
        )
    sp_size = _ulysses_size(actor)
    if sp_size > 1:
        raise ValueError(
            f"{what} takes the top-k from the logits of whole packed sequences; Ulysses sequence parallelism shards "
            f"them: {ACTOR}.fsdp_config.ulysses_sequence_parallel_size={sp_size} must be 1"
        )
    vocab = _local_vocab_size(model.path)
    if vocab is not None:
        try:
            check_top_k(policy.kl_full_top_k, vocab)  # the one check of a top-k against a vocabulary
        except ValueError as error:
            raise ValueError(f"{error} (the model's, from {model.path}/config.json)") from error


def _local_vocab_size(model_path: Any) -> int | None:
    """``vocab_size`` of a local Hugging Face checkpoint (its config.json); None when the path is not a
    local directory (a hub id: the engine checks k against the logits when it runs)."""
    vocab = _local_model_config(model_path).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) else None
