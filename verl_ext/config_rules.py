"""Every config rule of verl-divclip: each refusal of a combination of config keys, one function per rule.

A *rule* refuses a value of one key given the values of others (``loss_mode`` with ``adaptive_delta_target``,
ERC with ``entropy_coeff``, ``separate_async`` with the rollout pool), or a value the divclip path would drop
without a word (a verl key it replaces or never reads). Every rule is here, each naming the keys it reads in
its error (``ValueError``). Two callers run them: ``recipe.main``'s validation before Ray starts
(:func:`recipe.config_checks.validate_divclip_config`, which reports them as ``ConfigError``), and the loss's
own config check (:func:`check_policy_config`, run by ``DivClipPolicyLossConfig.__post_init__`` once
:mod:`verl_ext.registry` is imported, and by :func:`verl_ext.registry.resolve_policy_config`;
:func:`check_entropy_as_mask`, run by :func:`verl_ext.engine.request.entropy_as_mask`).

Not rules, so not here: a dataclass' checks of its own fields (types, ranges, and which of its own fields
go together), kept in its ``__post_init__`` as verl keeps them (:class:`verl_ext.config.DivClipPolicyLossConfig`,
:func:`verl_ext.config.check_clip_ratios`); the keys of ``rollout.custom.validation``, parsed and refused by
their own feature (:mod:`recipe.validation.length`, which this package may not import); and runtime guards
on what an engine really holds (the seam's).
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.config import PolicyLossConfig

from verl_ext.config import (
    ACTOR,
    CONFIG_TARGET,
    POLICY_LOSS_KEY,
    DivClipPolicyLossConfig,
    actor_clip_ratios,
    register_mode_check,
)
from verl_ext.core.coarsened_kl import check_top_k
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


SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")
"""``actor.strategy`` values whose engine (verl's ``FSDPEngineWithLMHead``) the seam hooks. FSDP2 runs on
the CPU platform and in every CPU test; FSDP1 (``fsdp``) only on GPUs (docs/experiments.md)."""


# ------------------------------------------------------------------------------------------------
# The policy-loss config against the loss-mode registry (the loss's own check)
# ------------------------------------------------------------------------------------------------


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


def check_entropy_as_mask(*, entropy_coeff: float) -> None:
    """The rule of :func:`verl_ext.engine.request.entropy_as_mask` (also run by the recipe's validation before
    Ray, via :func:`check_erc`): ``entropy_coeff`` is ``actor_rollout_ref.actor.entropy_coeff``, and a non-zero
    bonus differentiates the entropy, which the graph-free float32 entropy (ERC's: pi_old's and pi_theta's the
    same number on-policy) cannot."""
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


# ------------------------------------------------------------------------------------------------
# The composed config (recipe.main's validation, before Ray starts)
# ------------------------------------------------------------------------------------------------


def check_policy_target(config: DictConfig) -> None:
    """A divclip ``loss_mode`` needs ``policy_loss._target_`` = the divclip config; with verl's own config class
    every divclip knob must be at its default (those are dropped so verl's dataclass builds)."""
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    mode = policy_loss.get("loss_mode", "vanilla")
    target = policy_loss.get("_target_", None)
    if mode in CONSTRAINTS and target != CONFIG_TARGET:
        raise ValueError(
            f"{ACTOR}.policy_loss.loss_mode={mode!r} needs {ACTOR}.policy_loss._target_={CONFIG_TARGET} (got "
            f"{target!r})"
        )
    if target != CONFIG_TARGET:
        _drop_unset_divclip_keys(policy_loss, target)


def _drop_unset_divclip_keys(policy_loss: DictConfig, target: Any) -> None:
    """With verl's own policy-loss class selected, the divclip knobs (declared in
    configs/divclip_trainer.yaml) must be at their defaults: those are dropped so verl's dataclass
    builds; a set one (ERC on a verl mode, say) is an error naming it, since only
    ``DivClipPolicyLossConfig`` carries it."""
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
PROFILE_DIR = Path(__file__).resolve().parents[1] / "configs" / "profile"


DEFAULT_PROFILE = "paper"


#: The paper whose experiments each profile belongs to (``divclip.paper``, set by the base configs).
PROFILE_PAPER = {"released": "erc"}


def known_profiles() -> list[str]:
    return [DEFAULT_PROFILE, *sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))]


def validate_profile(config: DictConfig) -> None:
    """``divclip.profile`` names a real profile, applied to the experiments it was written for."""
    divclip = config.get("divclip", None) or {}
    profile = divclip.get("profile", DEFAULT_PROFILE)
    if profile not in known_profiles():
        raise ValueError(
            f"divclip.profile={profile!r} is not a profile; known: {known_profiles()} "
            "(select one with +profile=<name>, which also applies its settings)"
        )
    paper = PROFILE_PAPER.get(profile)
    if paper is not None and divclip.get("paper", None) != paper:
        raise ValueError(
            f"+profile={profile} (configs/profile/{profile}.yaml) is for the {paper.upper()} experiments "
            f"(configs/experiments/base/{paper}.yaml), but this config has divclip.paper={divclip.get('paper', None)!r}"
        )


def validate_data_trace(config: DictConfig) -> None:
    """``divclip.data_trace`` (:mod:`recipe.data_trace`) is written by the trainer on whichever Ray node it
    runs: only an absolute path means the same file everywhere."""
    path = (config.get("divclip", None) or {}).get("data_trace", None)
    if path is not None and (not isinstance(path, str) or not Path(path).is_absolute()):
        raise ValueError(f"divclip.data_trace={path!r} must be an absolute path (the trainer writes it on a Ray node)")


def validate_filter_groups(config: DictConfig) -> None:
    """Dynamic sampling keys that verl 0.9.1's v1 trainer would only warn about and ignore."""
    filter_groups = config.algorithm.get("filter_groups", None) or {}
    if not filter_groups.get("enable", False):
        return
    if filter_groups.get("max_num_gen_batches", 0) > 0:
        raise ValueError(
            "algorithm.filter_groups.max_num_gen_batches is ignored by verl 0.9.1's v1 trainer (its replay buffer "
            "refills dropped groups until data.train_batch_size remain); set it to 0 and bound generation with "
            "algorithm.filter_groups.max_inflight_gen_batches (in units of data.train_batch_size)"
        )
    gen_batch_size = config.data.get("gen_batch_size", None)
    if gen_batch_size not in (None, 1):
        raise ValueError(
            f"data.gen_batch_size={gen_batch_size} is replaced by 1 in verl 0.9.1's v1 trainer when "
            "algorithm.filter_groups.enable=true; unset it and use algorithm.filter_groups.max_inflight_gen_batches"
        )


def validate_verl_features(config: DictConfig) -> None:
    """verl features the recipe's path would drop without a word, refused naming the key (the table of every
    verl feature against the divclip path: docs/verl_features.md).

    * ``distillation.enabled``: verl's worker installs ``distillation_ppo_loss``, and the divclip trainer
      replaces every actor loss with its own through ``set_loss_fn``, so the distillation term would vanish.
    * ``trainer.use_v1=false``: ``recipe.main`` always runs verl's v1 trainer (the hooks are v1's).
    * ``actor.calculate_sum_pi_squared``: verl 0.9.1's v1 trainer never asks the engine for the sum of
      squared probabilities (only the legacy trainer's optimal-token baseline reads it), so it does nothing.
    """

    if OmegaConf.select(config, "distillation.enabled", default=False):
        raise ValueError(
            "distillation.enabled=true: verl's actor would train with distillation_ppo_loss, which verl-divclip "
            "replaces with its own actor loss (every mode, through set_loss_fn), dropping the distillation term. "
            "Distillation is not supported by recipe.main: run verl's main_ppo for it, or set "
            "distillation.enabled=false"
        )
    if not OmegaConf.select(config, "trainer.use_v1", default=True):
        raise ValueError(
            "trainer.use_v1=false selects verl's legacy trainer, which recipe.main does not run (its hooks are the v1 "
            "trainer's, in every trainer.v1.trainer_mode): set trainer.use_v1=true"
        )
    if OmegaConf.select(config, f"{ACTOR}.calculate_sum_pi_squared", default=False):
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
        validate_vocab_pass(config, actor)
    if divclip and policy.stores_old_topk:
        validate_old_topk(config, actor, policy)
    if divclip and policy.erc_enabled:
        check_erc(config, actor)
    validate_bypass_mode(config, actor)
    validate_old_log_prob_from_update(config)


def check_adaptive_delta_updates(config: DictConfig, actor: Any) -> None:
    """``policy_loss.adaptive_delta_target`` needs one update a step (``parameter_sync_step=1``) that is not
    on-policy (more than one PPO mini-batch or epoch): the controller reads each update's KL3 from its pi_old."""
    train_prompts = config.data.get("train_batch_size", None)
    on_policy = actor.ppo_epochs == 1 and train_prompts is not None and actor.ppo_mini_batch_size >= train_prompts
    trainer_mode = OmegaConf.select(config, TRAINER_MODE, default="sync")
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
    rollout_correction = config.algorithm.get("rollout_correction", None) or {}
    if rollout_correction.get("bypass_mode", False):
        raise ValueError(
            "ERC needs pi_old's per-token entropy, which only the old-log-prob recompute produces; "
            "algorithm.rollout_correction.bypass_mode=True skips it. Set it to False or turn ERC off."
        )


def requested_features(policy: Any) -> dict[str, bool]:
    """Config key -> whether the policy-loss config ``policy`` (a ``DivClipPolicyLossConfig``, or ``None`` for
    verl's plain config, which the divclip actor loss packs as the update) turns on a feature only the seam
    provides."""
    if policy is None:
        return {f"{POLICY_LOSS_KEY}.pack_old_log_prob_as_update": True}
    get = policy.get if hasattr(policy, "get") else (lambda key, default=None: getattr(policy, key, default))
    return {
        f"{POLICY_LOSS_KEY}.erc_beta_low/erc_beta_high": get("erc_beta_low", None) is not None,
        f"{POLICY_LOSS_KEY}.vocab_pass": bool(get("vocab_pass", False)),
        f"{POLICY_LOSS_KEY}.loss_mode=kl_full": get("loss_mode", None) == "kl_full",
        f"{POLICY_LOSS_KEY}.kl_full_diagnostic": bool(get("kl_full_diagnostic", False)),
        f"{POLICY_LOSS_KEY}.pack_old_log_prob_as_update": bool(get("pack_old_log_prob_as_update", True)),
    }


def validate_strategy(actor: Any, policy: DivClipPolicyLossConfig | None) -> None:
    """Every feature the recipe adds inside verl's actor engine (ERC's fp32 entropy, the vocabulary pass,
    pi_old's top-k, pack_old_log_prob_as_update) lives in the engine seam, which covers verl's FSDP engine only
    (:data:`verl_ext.engine.request.SUPPORTED_STRATEGIES`). Another ``actor.strategy`` with any of them
    on is refused here, naming the keys -- it would otherwise run silently without them. ``policy`` is
    None for verl's plain policy-loss config, whose actor loss still packs the old pass as the update."""
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
    (``recipe.trainer.DIVCLIP_TRAINERS``). What verl itself would only assert after Ray has started,
    and what the async modes need from the recipe, is checked here, naming the keys:

    * a known mode (verl's registry);
    * async modes: ``rollout.calculate_log_probs=true`` -- the behaviour policy's log-probs, from which the
      staleness figures (mu against pi_old) and verl's rollout correction are computed;
    * ``separate_async``: ``data.train_batch_size == parameter_sync_step * actor.ppo_mini_batch_size``, a
      standalone rollout pool (``rollout.nnodes`` and ``rollout.n_gpus_per_node`` > 0), a weight-transfer
      backend other than ``naive`` (``rollout.checkpoint_engine.backend``; on the cpu platform ``cpu_gloo``),
      verl's hybrid engine on (``hybrid_engine=false`` fails inside verl 0.9.1), a reward model (if any) in its
      own resource pool, no rollout disaggregation with the hybrid switch, and fixed micro-batches that divide
      each data-parallel rank's share of an update's samples (one update per ``parameter_sync_step``).
    """
    from verl.trainer.ppo.v1 import get_trainer_cls

    mode = OmegaConf.select(config, TRAINER_MODE, default="sync")
    try:
        get_trainer_cls(mode)
    except ValueError as error:
        raise ValueError(f"{TRAINER_MODE}={mode!r}: {error}") from error
    if mode not in ASYNC_MODES:
        return
    rollout = config.actor_rollout_ref.rollout
    if not rollout.get("calculate_log_probs", False):
        raise ValueError(
            f"{TRAINER_MODE}={mode} trains on samples of older policies: {ROLLOUT}.calculate_log_probs=true is needed "
            "for the behaviour policy's log-probs (the staleness figures actor/divclip/staleness/* and verl's "
            "algorithm.rollout_correction read them)"
        )
    if mode != "separate_async":
        return
    separate = config.trainer.v1.separate_async
    sync_step = int(separate.get("parameter_sync_step", 1))
    train_batch_size = int(config.data.train_batch_size)
    if train_batch_size != sync_step * int(actor.ppo_mini_batch_size):
        raise ValueError(
            f"{TRAINER_MODE}=separate_async trains one mini-batch per weight sync step: data.train_batch_size="
            f"{train_batch_size} must equal trainer.v1.separate_async.parameter_sync_step={sync_step} x "
            f"{ACTOR}.ppo_mini_batch_size={actor.ppo_mini_batch_size}"
        )
    for key in ("nnodes", "n_gpus_per_node"):
        if int(rollout.get(key, 0) or 0) <= 0:
            raise ValueError(
                f"{TRAINER_MODE}=separate_async generates on a standalone rollout pool: {ROLLOUT}.{key} must be > 0 "
                f"(got {rollout.get(key, None)})"
            )
    backend = rollout.checkpoint_engine.backend
    if backend == "naive":
        raise ValueError(
            f"{TRAINER_MODE}=separate_async moves weights to the standalone rollout pool with a checkpoint engine: "
            f"{ROLLOUT}.checkpoint_engine.backend=naive only serves colocated rollouts (nccl, nixl, ... on GPUs; "
            "cpu_gloo on the cpu platform)"
        )
    if config.trainer.get("device", None) == "cpu" and backend != "cpu_gloo":
        raise ValueError(
            f"{TRAINER_MODE}=separate_async on the cpu platform (trainer.device=cpu) moves weights with the cpu_gloo "
            f"checkpoint engine: {ROLLOUT}.checkpoint_engine.backend={backend} needs GPUs"
        )
    if not config.actor_rollout_ref.get("hybrid_engine", True):
        raise ValueError(
            f"{TRAINER_MODE}=separate_async with actor_rollout_ref.hybrid_engine=false fails inside verl 0.9.1's "
            "PPOTrainerSeparateAsync._setup (a logger call with flush=True): leave actor_rollout_ref.hybrid_engine=true"
        )
    if OmegaConf.select(config, "reward.reward_model.enable", default=False) and not OmegaConf.select(
        config, "reward.reward_model.enable_resource_pool", default=False
    ):
        raise ValueError(
            f"{TRAINER_MODE}=separate_async never pauses the standalone rollout to free memory for a colocated reward "
            "model: with reward.reward_model.enable=true set reward.reward_model.enable_resource_pool=true"
        )
    if (
        OmegaConf.select(separate, "hybrid_rollout.enable_switch", default=False)
        and config.actor_rollout_ref.get("hybrid_engine", True)
        and OmegaConf.select(rollout, "disaggregation.enabled", default=False)
    ):
        raise ValueError(
            f"{TRAINER_MODE}=separate_async: trainer.v1.separate_async.hybrid_rollout.enable_switch=true does not "
            f"support {ROLLOUT}.disaggregation.enabled=true (verl moves paused replicas' queued requests)"
        )
    if not actor.use_dynamic_bsz:
        # data-parallel ranks: Ulysses sequence parallelism shares each sample among sp ranks
        ranks = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node) // _ulysses_size(actor)
        rows = train_batch_size // sync_step * int(rollout.n)
        for key, size in (
            (f"{ACTOR}.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
            (f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", rollout.get("log_prob_micro_batch_size_per_gpu")),
        ):
            if size and (rows % ranks or (rows // ranks) % int(size)):
                raise ValueError(
                    f"{TRAINER_MODE}=separate_async trains {rows} samples per update (data.train_batch_size / "
                    f"parameter_sync_step x rollout.n) over {ranks} data-parallel actor ranks; {key}={size} must "
                    f"divide each rank's {rows / ranks:g}"
                )


def _ulysses_size(actor: Any) -> int:
    """The actor's Ulysses sequence-parallel size (the actor's key or its engine's, whichever is set)."""
    engine = getattr(actor, "fsdp_config", None)
    return max(
        int(getattr(actor, "ulysses_sequence_parallel_size", 1) or 1),
        int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1),
    )


def validate_bypass_mode(config: DictConfig, actor: Any) -> None:
    """``algorithm.rollout_correction.bypass_mode=true`` skips the old-log-prob pass (pi_old := mu, the rollout's
    log-probs), so there is no pass to pack as the update: ``pack_old_log_prob_as_update`` must be false."""
    rollout_correction = config.algorithm.get("rollout_correction", None) or {}
    policy = actor.policy_loss
    if rollout_correction.get("bypass_mode", False) and bool(getattr(policy, "pack_old_log_prob_as_update", True)):
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
    rollout_correction = config.algorithm.get("rollout_correction", None) or {}
    trainer_mode = OmegaConf.select(config, TRAINER_MODE, default="sync")
    if not bool(policy.get("pack_old_log_prob_as_update", True)):
        return f"{ACTOR}.policy_loss.pack_old_log_prob_as_update=false (the pass is not packed as the update)"
    if rollout_correction.get("bypass_mode", False):
        return "algorithm.rollout_correction.bypass_mode=true (there is no old-log-prob pass)"
    if config.algorithm.get("use_kl_in_reward", False):
        return "algorithm.use_kl_in_reward=true (verl's apply_kl_penalty reads pi_old before the update)"
    if config.actor_rollout_ref.rollout.get("calculate_log_probs", False) and (
        rollout_correction.get("rollout_is", None) is not None or rollout_correction.get("rollout_rs", None) is not None
    ):
        return (
            "algorithm.rollout_correction.rollout_is / rollout_rs (their weights and rejection read pi_old before the "
            "update)"
        )
    if config.algorithm.get("adv_estimator", None) in _ESTIMATORS_READING_PI_OLD:
        return f"algorithm.adv_estimator={config.algorithm.adv_estimator} (the estimator reads pi_old)"
    if trainer_mode == "separate_async":
        return f"{TRAINER_MODE}=separate_async (a Decoupled-PPO cycle's pi_old is its first weights, not the update's)"
    if _ulysses_size(actor) > 1:
        return f"{ACTOR}.ulysses_sequence_parallel_size > 1 (one rank returns the group's outputs)"
    dropout = _local_dropout(config.actor_rollout_ref.model.get("path", None))
    if dropout is not None:
        return f"the model's {dropout} (a train-mode forward is not the eval-mode pass)"
    return None


def validate_old_log_prob_from_update(config: DictConfig) -> None:
    """``policy_loss.old_log_prob_from_update=true`` where it is not exact is refused, naming the reason."""
    if config.actor_rollout_ref.actor.policy_loss.get("old_log_prob_from_update", None) is not True:
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


def validate_vocab_pass(config: DictConfig, actor: Any) -> None:
    """``policy_loss.vocab_pass=true`` never builds the logits and runs inside verl's FSDP actor
    engine: refuse what needs the logits or another forward (named keys), before Ray starts.
    Per-sample temperatures need nothing: the pass takes one temperature per token. (The other consumers of
    the logits, ``calculate_sum_pi_squared`` and distillation, are refused for every run:
    :func:`validate_verl_features`.)"""
    model = config.actor_rollout_ref.model
    if model.get("use_fused_kernels", False):
        raise ValueError(
            f"{VOCAB_PASS}=true and actor_rollout_ref.model.use_fused_kernels=true both replace the LM head's logits "
            "(verl's fused forward reads lm_head.weight outside the head and fails under FSDP2): set one of them false"
        )
    lora_rank = model.get("lora_rank", 0) or 0
    if lora_rank > 0 or model.get("lora_adapter_path", None):
        targets = model.get("target_modules", None)
        names = [targets] if isinstance(targets, str) else list(targets or [])
        if any("lm_head" in str(name) for name in names):
            raise ValueError(
                f"{VOCAB_PASS}=true reads the LM head's own weight; actor_rollout_ref.model.target_modules={names} "
                "puts a LoRA adapter on lm_head: drop lm_head from target_modules or set the vocabulary pass false"
            )


def validate_old_topk(config: DictConfig, actor: Any, policy: DivClipPolicyLossConfig) -> None:
    """``kl_full`` / ``kl_full_diagnostic`` need pi_old's top-k, stored by the old-log-prob pass from the
    logits (materialised, or the vocabulary pass's slices) of an unsharded sequence: refuse what skips
    that pass or those logits, and a k larger than the model's vocabulary (read from a local
    checkpoint's config.json)."""
    what = (
        f"{ACTOR}.policy_loss.loss_mode=kl_full"
        if policy.loss_mode == "kl_full"
        else f"{ACTOR}.policy_loss.kl_full_diagnostic=true"
    )
    rollout_correction = config.algorithm.get("rollout_correction", None) or {}
    if rollout_correction.get("bypass_mode", False):
        raise ValueError(
            f"{what} needs pi_old's top-k, stored by the old-log-prob recompute; "
            "algorithm.rollout_correction.bypass_mode=True skips it. Set it to False."
        )
    model = config.actor_rollout_ref.model
    if model.get("use_fused_kernels", False):
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
    vocab = _local_vocab_size(model.get("path", None))
    if vocab is not None:
        try:
            check_top_k(policy.kl_full_top_k, vocab)  # the one check of a top-k against a vocabulary
        except ValueError as error:
            raise ValueError(f"{error} (the model's, from {model.path}/config.json)") from error


def _local_vocab_size(model_path: Any) -> int | None:
    """``vocab_size`` of a local Hugging Face checkpoint (its config.json); None when the path is not a
    local directory (a hub id: the engine checks k against the logits when it runs)."""
    vocab = _local_model_config(model_path).get("vocab_size", None)
    return int(vocab) if isinstance(vocab, int) else None


# ------------------------------------------------------------------------------------------------
# verl's keys the divclip path replaces or never reads (the refusals of recipe.verl_keys' table)
# ------------------------------------------------------------------------------------------------


def verl_config_dir() -> Path:
    """verl's installed config directory (``verl/trainer/config``)."""
    import verl.trainer.config as verl_config

    return Path(verl_config.__file__).resolve().parent


@lru_cache(maxsize=1)
def verl_schema() -> DictConfig:
    """verl's ``ppo_trainer`` config as verl ships it flattened (``_generated_ppo_trainer.yaml``, which verl
    generates from ``ppo_trainer.yaml``; the table's test checks it against a fresh composition). Read
    without Hydra, so it works inside ``recipe.main``'s own Hydra app."""
    path = verl_config_dir() / "_generated_ppo_trainer.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"verl's flattened ppo_trainer config is missing: {path}")
    schema = OmegaConf.load(path)
    assert isinstance(schema, DictConfig)
    return schema


_MISSING = object()


def verl_default(key: str) -> Any:
    """The value verl's schema gives ``key`` (interpolations resolved within verl's schema). Raises
    ``KeyError`` naming the key if verl's schema has no such key."""
    value = OmegaConf.select(verl_schema(), key, default=_MISSING)
    if value is _MISSING:
        raise KeyError(f"{key} is not a key of verl's ppo_trainer schema")
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def _interpolated_in_verl(key: str) -> bool:
    """Whether verl's schema gives ``key`` an interpolation (its default then is another key's value)."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(verl_schema(), parent) if parent else verl_schema()
    return isinstance(node, DictConfig) and OmegaConf.is_interpolation(node, name)


def _value(config: DictConfig, key: str) -> Any:
    """``key``'s resolved value in the composed config; a key missing there takes verl's default (the
    composed config is verl's schema plus overrides, so only a key deleted on purpose is missing)."""
    value = OmegaConf.select(config, key, default=_MISSING)
    if value is _MISSING:
        return verl_default(key)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def _divclip_policy(config: DictConfig) -> bool:
    return OmegaConf.select(config, f"{POLICY}._target_", default=None) == CONFIG_TARGET


def _policy_knob(config: DictConfig, knob: str) -> Any:
    """A divclip policy-loss knob: the config's value, else the dataclass' own default."""
    value = OmegaConf.select(config, f"{POLICY}.{knob}", default=_MISSING)
    if value is _MISSING:
        return {f.name: f.default for f in dataclasses.fields(DivClipPolicyLossConfig)}[knob]
    return value


def _packs_as_update(config: DictConfig) -> bool:
    """Whether the old-log-prob pass is packed as the update: ``pack_old_log_prob_as_update`` (default true)
    with the divclip policy-loss config, always with verl's plain one (``verl_ext.actor_loss.build_actor_loss``);
    never in ``bypass_mode``, which skips the pass (and refuses pack_old_log_prob_as_update)."""
    if _value(config, f"{CORRECTION}.bypass_mode"):
        return False
    return bool(_policy_knob(config, "pack_old_log_prob_as_update")) if _divclip_policy(config) else True


def _loss_mode(config: DictConfig) -> str:
    return str(_value(config, f"{POLICY}.loss_mode"))


PACK_KEY = f"{POLICY}.pack_old_log_prob_as_update"


PACK_HINT = f"{PACK_KEY}=false gives verl's packing of the old-log-prob pass back"


def check_clip_ratio_c(config: DictConfig) -> None:
    """``actor.clip_ratio_c`` is verl's dual-clip constant; a divclip mode's dual clip is
    ``policy_loss.dual_clip_c`` alone (verl's own modes read ``clip_ratio_c`` and refuse ``dual_clip_c``)."""
    key, replacing = f"{ACTOR}.clip_ratio_c", f"{POLICY}.dual_clip_c"
    mode, value, default = (
        _loss_mode(config),
        _value(config, f"{ACTOR}.clip_ratio_c"),
        verl_default(f"{ACTOR}.clip_ratio_c"),
    )
    if value == default:
        return
    dual_clip_c = _policy_knob(config, "dual_clip_c") if _divclip_policy(config) else None
    if dual_clip_c is not None and float(value) == float(dual_clip_c):
        return  # both keys say the same c (the released ERC profile sets both)
    if mode in CONSTRAINTS:
        raise ValueError(
            f"{key}={value} is not read by {POLICY}.loss_mode={mode!r} (a divclip mode): its dual clip comes from "
            f"{replacing} alone (null = off, got {dual_clip_c!r}). Set {replacing}={value} and leave {key} at verl's "
            f"default {default}"
        )


def check_log_prob_packing(config: DictConfig) -> None:
    """With pack_old_log_prob_as_update the old-log-prob pass is packed with the update's micro-batch settings
    (``verl_ext.engine.packing.infer_as_update``): ``rollout.log_prob_*`` must say what it uses."""
    if not _packs_as_update(config):
        return
    dynamic = bool(_value(config, f"{ACTOR}.use_dynamic_bsz"))
    pairs = [(f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{ACTOR}.use_dynamic_bsz", True)]
    if dynamic:
        pairs.append((f"{ROLLOUT}.log_prob_max_token_len_per_gpu", f"{ACTOR}.ppo_max_token_len_per_gpu", False))
    else:
        pairs.append((f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", f"{ACTOR}.ppo_micro_batch_size_per_gpu", False))
    for key, replacing, strict in pairs:
        value, used = _value(config, key), _value(config, replacing)
        if value == used or (not strict and not _interpolated_in_verl(key) and value == verl_default(key)):
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
    erc = _policy_knob(config, "erc_beta_low") is not None or _policy_knob(config, "erc_beta_high") is not None
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
    (``PPOTrainer.step``): each step then trains that many local updates, each on train_batch_size /
    parameter_sync_step samples of the step's rollouts, recomputing pi_old with the current weights before
    each. Only separate_async's (Decoupled PPO: pi_old is the cycle's first weights) is supported here."""
    active = _value(config, TRAINER_MODE)
    for mode in ("sync", "colocate_async"):
        key = f"trainer.v1.{mode}.parameter_sync_step"
        value = OmegaConf.select(config, key, default=None)
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
