"""Every verl config key against the divclip path: a rule table, the checks it implies, and the doc it generates.

``python -m recipe.main`` composes ``configs/divclip_trainer.yaml`` -- verl 0.9.1's ``ppo_trainer`` plus the
divclip keys -- so every key of verl's schema reaches the run. :data:`RULES` says, for the keys the divclip
path touches (a key or a key prefix; the longest matching prefix wins, :func:`classify`), what happens to it
(a :class:`recipe.verl_key_checks.KeyRule` of class :class:`~recipe.verl_key_checks.KeyClass`):

* ``verl_reads`` -- no row: verl's own code reads it, the product's never does. Which keys the product reads
  is recorded, not listed: ``python -m recipe.verl_key_reads`` runs the trainer and engine tests with the
  recorder of :mod:`verl_ext.core.key_reads` on and writes ``recipe/verl_keys_read.json``; every key there
  needs an honoured, replaced or refused row (``tests/test_verl_key_reads.py``), or is a field of verl's
  config objects that no schema declares (:data:`NOT_CONFIG_KEYS`);
* ``honoured`` -- the divclip path touches the feature and the named test shows verl's effect;
* ``replaced`` -- the divclip path replaces what the key does: allowed while the key keeps the value the
  replacement uses (verl's default, or the replacing key's value); anything else is refused before Ray
  starts, naming both keys (:func:`check_replaced_keys`);
* ``refused`` -- refused before Ray starts under the stated condition (by :func:`check_refused_keys` or
  the :mod:`verl_ext.config_rules` function the rule names);
* ``no_effect`` -- the key does nothing on this path (the rule says why).

A rule may also carry a conditional refusal (``refused_when``) on top of its class: an honoured feature
refused in one combination, say. The divclip keys themselves (``divclip.*``, the divclip policy-loss knobs,
``rollout.custom.validation``) are the project's, documented in docs/losses.md and checked by their
dataclasses: :func:`is_divclip_key` tells them apart, and only verl's keys need a rule.

``docs/verl_features.md`` is generated from the table::

    python -m recipe.verl_keys --write-doc
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from recipe.verl_key_checks import KeyClass, KeyRule, compose_verl_schema, is_divclip_key, key_under, leaf_keys
from recipe.verl_key_reads import COMMAND as RECORD_COMMAND
from recipe.verl_key_reads import READ_KEYS_PATH, read_keys
from verl_ext.config import ACTOR
from verl_ext.config_rules.policy import CORRECTION, POLICY, REF, ROLLOUT, TRAINER_MODE
from verl_ext.config_rules.verl_keys import (
    ENTROPY_KEYS,
    PACK_KEY,
    check_entropy_keys,
    check_log_prob_packing,
    check_loss_type,
    check_parameter_sync_step,
    check_rollout_correction_needs_log_probs,
)

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "verl_features.md"
READ_KEYS_FILE = READ_KEYS_PATH.relative_to(DOC_PATH.parents[1]).as_posix()


def verl_leaf_keys(config: DictConfig) -> Iterator[str]:
    """:func:`leaf_keys` of ``config`` without the project's own keys: the keys the table must cover."""
    return (key for key in leaf_keys(config) if not is_divclip_key(key))


#: Fields the product reads on verl's config objects that are no key of verl's schema (the recorder sees them
#: as keys): why each is none.
NOT_CONFIG_KEYS = {
    f"{ACTOR}.global_batch_info": "verl's ppo_loss fills it per micro-batch (global batch size, dp size, "
    "loss_scale_factor) for agg_loss; the divclip losses pass it to agg_loss too",
}

VERL_ALONE = "verl reads it; the product's code never does (no recorded run read it)"


def row_of(key: str) -> Optional[KeyRule]:
    """The row whose key is ``key``'s longest dotted prefix, or ``None`` when no row covers it."""
    best: Optional[KeyRule] = None
    for rule in RULES:
        if key_under(key, rule.key) and (best is None or len(rule.key) > len(best.key)):
            best = rule
    return best


def classify(key: str) -> KeyRule:
    """The rule of ``key``: the row whose key is its longest dotted prefix; a key no row covers is verl's
    alone (``verl_reads``: the tests check that no key the product reads is left there)."""
    return row_of(key) or KeyRule(key, KeyClass.VERL_READS, VERL_ALONE)


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------

R, H, P, F, N = KeyClass.VERL_READS, KeyClass.HONOURED, KeyClass.REPLACED, KeyClass.REFUSED, KeyClass.NO_EFFECT

RECIPE_MAIN_TEST = "tests/test_recipe_main.py"
#: the knob declarations' refusal (verl_ext/knobs.py): a value away from verl's default that the loss mode reads not
UNREAD = "away from verl's default where the loss mode and its features read it not (verl_ext/knobs.py)"
PACKING_EVIDENCE = (
    "`tests/test_onpolicy.py::test_verls_own_packing_shows_the_noise_the_alignment_removes`; "
    "refusals: `tests/test_verl_keys.py`"
)

# a table, one rule per entry: kept as written, not formatted
# fmt: off
RULES: tuple[KeyRule, ...] = (
    # --- the reference worker: no entropy asked for -----------------------------------------------------
    *(KeyRule(f"{REF}.{name}", N, "the reference pass asks for no entropy (verl's _compute_ref_log_prob)")
      for name in ("entropy_checkpointing", "entropy_from_logits_with_chunking", "fsdp_config.entropy_checkpointing",
                   "fsdp_config.entropy_from_logits_with_chunking")),
    # --- the trainer -------------------------------------------------------------------------------------------
    KeyRule("trainer.use_v1", F, "recipe.main always runs verl's v1 trainer (the divclip hooks are v1's)",
            refused_when="false", check="validate_verl_features"),
    KeyRule(TRAINER_MODE, H, "sync, colocate_async and separate_async: verl's TaskRunnerV1 builds the divclip "
                             "subclass of verl's class for the mode (recipe.trainer.DIVCLIP_TRAINERS, in verl's "
                             "trainer registry); an unknown mode is refused",
            evidence=f"`{RECIPE_MAIN_TEST}::test_every_trainer_mode_validates_and_selects_verls_class_with_the_divclip_"
                     "features`; end to end: `tests/test_trainer_modes_cpu.py`",
            refused_when="an unregistered mode", check="check_trainer_mode_registered"),
    KeyRule("trainer.v1.separate_async.parameter_sync_step", H,
            "verl's Decoupled PPO: pi_old is the cycle's first weights, so only the cycle's first update starts "
            "on-policy and carries the gauge",
            evidence=f"`{RECIPE_MAIN_TEST}` (refusal); `tests/test_trainer_modes_cpu.py` (separate_async)",
            refused_when="separate_async with data.train_batch_size != parameter_sync_step x actor.ppo_mini_batch_size "
                         "(verl asserts it after Ray starts)", check="check_separate_async_batch"),
    KeyRule("trainer.v1.sync.parameter_sync_step", F,
            "verl's base trainer reads trainer.v1.<mode>.parameter_sync_step in every mode: local updates whose pi_old "
            "is recomputed each time, which the divclip on-policy flag treats as off-policy (only separate_async's "
            "Decoupled PPO is supported)",
            refused_when="a value other than 1", check=check_parameter_sync_step,
            read_in="trainer/ppo/v1/trainer_base.py"),
    KeyRule("trainer.v1.colocate_async.parameter_sync_step", F,
            "as trainer.v1.sync.parameter_sync_step, for colocate_async",
            refused_when="a value other than 1", check=check_parameter_sync_step,
            read_in="trainer/ppo/v1/trainer_base.py"),
    KeyRule("trainer.v1.separate_async.hybrid_rollout.enable_switch", F,
            "verl's hybrid rollout switch of separate_async",
            refused_when="with actor_rollout_ref.rollout.disaggregation.enabled=true (verl asserts it after Ray "
                         "starts)",
            check="check_separate_async_switch"),
    KeyRule("trainer.resume_mode", H, "only complete checkpoints are resumed (recipe/checkpoints.py); sync resume "
                                      "across two nodes, async resume with TransferQueue's state",
            evidence="`tests/test_two_nodes_ray.py`, `tests/test_trainer_modes_cpu.py`"),
    KeyRule("trainer.resume_from_path", H, "as trainer.resume_mode",
            evidence="`tests/test_two_nodes_ray.py`, `tests/test_trainer_modes_cpu.py`"),
    KeyRule("distillation", N, "read only with distillation.enabled, which is refused"),
    KeyRule("distillation.enabled", F, "verl's worker would train with distillation_ppo_loss, which the divclip actor "
                                       "loss replaces (set_loss_fn), dropping the distillation term",
            refused_when="true", check="validate_verl_features"),
    # --- the rollout and its pool ---------------------------------------------------------------------------------
    KeyRule(f"{ROLLOUT}.calculate_log_probs", H,
            "mu's log-probs feed the staleness figures and verl's rollout correction",
            evidence=f"`{RECIPE_MAIN_TEST}`; `tests/test_verl_keys.py`",
            refused_when="false in the async modes, or with rollout_correction.rollout_is / rollout_rs set",
            check="check_async_behaviour_log_probs"),
    KeyRule(f"{ROLLOUT}.nnodes", H, "separate_async's standalone rollout pool",
            evidence=f"`{RECIPE_MAIN_TEST}`; `tests/test_trainer_modes_cpu.py`",
            refused_when="0 in separate_async", check="check_separate_async_rollout_pool"),
    KeyRule(f"{ROLLOUT}.n_gpus_per_node", H, "separate_async's standalone rollout pool",
            evidence=f"`{RECIPE_MAIN_TEST}`; `tests/test_trainer_modes_cpu.py`",
            refused_when="0 in separate_async", check="check_separate_async_rollout_pool"),
    KeyRule(f"{ROLLOUT}.checkpoint_engine.backend", H,
            "separate_async's weight transfer (cpu_gloo on the cpu platform)",
            evidence=f"`{RECIPE_MAIN_TEST}`; `tests/test_cpu_checkpoint_engine.py`; `tests/test_trainer_modes_cpu.py`",
            refused_when="naive in separate_async (or not cpu_gloo on the cpu platform)",
            check="check_separate_async_weight_transfer"),
    KeyRule("reward.reward_model.enable_resource_pool", F, "verl's reward-model placement",
            refused_when="false with reward.reward_model.enable=true in separate_async (the standalone rollout never "
                         "pauses to free memory for a colocated reward model)",
            check="check_separate_async_reward_pool"),
    KeyRule("actor_rollout_ref.hybrid_engine", F, "verl's hybrid engine",
            refused_when="false in separate_async (fails inside verl 0.9.1)",
            check="check_separate_async_hybrid_engine"),
    KeyRule("data.train_batch_size", F, "verl's prompts a step, against which the adaptive-delta controller and "
                                        "separate_async's split are checked",
            refused_when="with adaptive_delta_target, ppo_mini_batch_size >= it and one epoch (every update on-policy: "
                         "the controller measures nothing); in separate_async, != parameter_sync_step x "
                         "ppo_mini_batch_size", check="check_adaptive_delta_updates"),
    KeyRule("reward.reward_model.enable", F, "verl's reward model",
            refused_when="true with reward.reward_model.enable_resource_pool=false in separate_async",
            check="check_separate_async_reward_pool"),
    KeyRule("trainer.device", F, "verl's device; on the cpu platform separate_async moves weights with cpu_gloo",
            refused_when="cpu with a checkpoint engine other than cpu_gloo in separate_async",
            check="check_separate_async_weight_transfer"),
    *(KeyRule(f"trainer.{name}", F, "verl's trainer pool: the data-parallel ranks a separate_async update is split "
                                    "over",
              refused_when="in separate_async without dynamic batching, an update whose samples do not split evenly "
                           "into the ranks' micro-batches", check="check_separate_async_micro_batches")
      for name in ("nnodes", "n_gpus_per_node")),
    KeyRule(f"{ROLLOUT}.disaggregation.enabled", F, "verl's disaggregated rollout",
            refused_when="true with trainer.v1.separate_async.hybrid_rollout.enable_switch=true",
            check="check_separate_async_switch"),
    KeyRule(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", P,
            "with pack_old_log_prob_as_update the old-log-prob pass is packed as the update (its first epoch's "
            "micro-batches)",
            replaced_by=f"{ACTOR}.ppo_micro_batch_size_per_gpu",
            refused_when=f"{PACK_KEY}=true (the default; always with verl's plain policy-loss config), "
                         f"{ACTOR}.use_dynamic_bsz=false, and a value other than verl's default (null) or the "
                         "replacing key's (the value the pass uses, so existing configs that set both alike validate)",
            check=check_log_prob_packing),
    KeyRule(f"{ROLLOUT}.log_prob_max_token_len_per_gpu", P,
            "with pack_old_log_prob_as_update the old-log-prob pass is packed as the update (its token budget per "
            "micro-batch)",
            replaced_by=f"{ACTOR}.ppo_max_token_len_per_gpu",
            refused_when=f"{PACK_KEY}=true, {ACTOR}.use_dynamic_bsz=true, and a value other than the replacing key's "
                         "(verl's default interpolates it)",
            check=check_log_prob_packing),
    KeyRule(f"{ROLLOUT}.log_prob_use_dynamic_bsz", P,
            "with pack_old_log_prob_as_update the old-log-prob pass is packed as the update (verl also asserts the two "
            "agree)",
            replaced_by=f"{ACTOR}.use_dynamic_bsz",
            refused_when=f"{PACK_KEY}=true and a value other than the replacing key's (verl's default interpolates it)",
            check=check_log_prob_packing),
    KeyRule(f"{ROLLOUT}.log_prob_micro_batch_size", P,
            "verl's deprecated global micro-batch size of the old-log-prob pass; with pack_old_log_prob_as_update the "
            "pass is packed as the update",
            replaced_by=f"{ACTOR}.ppo_micro_batch_size_per_gpu",
            refused_when=f"{PACK_KEY}=true and a value other than null", check=check_log_prob_packing),
    # --- the actor loss --------------------------------------------------------------------------------------------
    KeyRule(f"{POLICY}", H, "verl's modes get the same config through verl's registry function, bit-identical to "
                            "ppo_loss; the divclip modes need the divclip _target_",
            evidence="`tests/test_ppo_loss_parity.py` (12 modes x 36 cases)",
            refused_when="a divclip loss_mode without the divclip _target_, an unregistered loss_mode",
            check="check_policy_target"),
    KeyRule(f"{ACTOR}.clip_ratio", H, "verl's modes read it as in ppo_loss; the divclip ratio modes read the same key",
            evidence="`tests/test_ppo_loss_parity.py`, `tests/test_losses.py`; refusals: `tests/test_knobs.py`",
            refused_when=UNREAD, check="check_knobs_read"),
    *(KeyRule(f"{ACTOR}.{name}", H, "as actor.clip_ratio",
              evidence="`tests/test_ppo_loss_parity.py`, `tests/test_losses.py`; refusals: `tests/test_knobs.py`",
              refused_when=f"outside its range for a divclip mode; {UNREAD}", check="check_knobs_read")
      for name in ("clip_ratio_low", "clip_ratio_high")),
    *(KeyRule(f"{ACTOR}.{name}", H, "verl's sapo mode reads it as in ppo_loss",
              evidence="`tests/test_ppo_loss_parity.py`; refusals: `tests/test_knobs.py`",
              refused_when=UNREAD, check="check_knobs_read")
      for name in ("tau_pos", "tau_neg")),
    KeyRule(f"{ACTOR}.clip_ratio_c", P,
            "verl's dual-clip constant: the divclip modes take their dual clip from policy_loss.dual_clip_c alone "
            "(null = off); verl's own modes read it in ppo_loss (and refuse dual_clip_c)",
            replaced_by=f"{POLICY}.dual_clip_c",
            refused_when="a value other than verl's default 3.0 or dual_clip_c's under a loss_mode not reading it",
            check="check_knobs_read"),
    KeyRule(f"{ACTOR}.grad_clip", N, "verl's legacy actor key: the v1 engine clips with actor.optim.clip_grad"),
    KeyRule(f"{ACTOR}.use_kl_loss", H, "verl's kl_penalty and agg_loss, bit-identical for all 14 KL types",
            evidence="`tests/test_ppo_loss_parity.py`"),
    KeyRule(f"{ACTOR}.kl_loss_type", H, "as actor.use_kl_loss", evidence="`tests/test_ppo_loss_parity.py`"),
    KeyRule(f"{ACTOR}.kl_loss_coef", H, "as actor.use_kl_loss", evidence="`tests/test_ppo_loss_parity.py`"),
    KeyRule(f"{ACTOR}.entropy_coeff", H, "the entropy bonus, bit-identical; with ERC it must be 0 (ERC's entropy is a "
                                         "graph-free mask)",
            evidence=f"`tests/test_ppo_loss_parity.py`; `{RECIPE_MAIN_TEST}::test_config_errors_name_the_key`",
            refused_when="non-zero with ERC", check="check_erc"),
    KeyRule(f"{ACTOR}.loss_agg_mode", H, "bit-identical for every aggregation mode and with data parallelism",
            evidence="`tests/test_ppo_loss_parity.py`"),
    KeyRule(f"{ACTOR}.loss_scale_factor", H, "as actor.loss_agg_mode", evidence="`tests/test_ppo_loss_parity.py`"),
    KeyRule(f"{ACTOR}.calculate_sum_pi_squared", F, "verl 0.9.1's v1 trainer never asks the engine for it (only the "
                                                    "legacy trainer's optimal-token baseline reads it)",
            refused_when="true", check="validate_verl_features"),
    KeyRule(f"{ACTOR}.calculate_entropy", H, "verl's entropy of both passes; ERC needs it",
            evidence=f"`{RECIPE_MAIN_TEST}`", refused_when="false with ERC", check="check_erc"),
    KeyRule(f"{ACTOR}.ppo_epochs", H, "the first epoch is packed as the old pass and checked; later epochs are "
                                      "off-policy by definition", evidence="`tests/test_onpolicy.py` (two epochs)"),
    KeyRule(f"{ACTOR}.ppo_mini_batch_size", H, "the old pass is packed with the update's split, and the update "
                                               "checks it against the record of what the pass packed",
            evidence="`tests/test_onpolicy.py::test_the_update_checks_its_packing_against_the_old_pass_record`; bf16 "
                     "trainer runs in `tests/test_smoke_cpu.py`"),
    KeyRule(f"{ACTOR}.shuffle", H, "as actor.ppo_mini_batch_size",
            evidence="`tests/test_onpolicy.py::test_the_update_checks_its_packing_against_the_old_pass_record`"),
    KeyRule(f"{ACTOR}.data_loader_seed", H, "as actor.ppo_mini_batch_size",
            evidence="`tests/test_onpolicy.py::test_the_update_checks_its_packing_against_the_old_pass_record`"),
    KeyRule(f"{ACTOR}.use_dynamic_bsz", H, "the update's micro-batch settings pack the old pass too (exact on-policy "
                                           "ratios); pack_old_log_prob_as_update=false gives verl's packing back",
            evidence=PACKING_EVIDENCE),
    KeyRule(f"{ACTOR}.ppo_max_token_len_per_gpu", H, "as actor.use_dynamic_bsz", evidence=PACKING_EVIDENCE),
    KeyRule(f"{ACTOR}.ppo_micro_batch_size_per_gpu", H, "as actor.use_dynamic_bsz", evidence=PACKING_EVIDENCE,
            refused_when="not dividing a rank's share of a separate_async update",
            check="check_separate_async_micro_batches"),
    KeyRule(f"{ACTOR}.ulysses_sequence_parallel_size", H, "a 2-rank Ulysses group is exactly on-policy; the top-k of "
                                                          "kl_full / the diagnostic needs whole sequences",
            evidence=f"`tests/test_onpolicy.py::test_two_ranks_are_exactly_on_policy`, `{RECIPE_MAIN_TEST}`",
            refused_when="> 1 with kl_full or kl_full_diagnostic", check="validate_old_topk"),
    KeyRule(f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size", H, "as actor.ulysses_sequence_parallel_size",
            evidence=f"`tests/test_onpolicy.py::test_two_ranks_are_exactly_on_policy`, `{RECIPE_MAIN_TEST}`",
            refused_when="> 1 with kl_full or kl_full_diagnostic", check="validate_old_topk"),
    KeyRule(f"{ACTOR}.strategy", H, "fsdp (FSDP1, GPU) and fsdp2, the engine the seam covers",
            evidence=f"`{RECIPE_MAIN_TEST}`",
            refused_when="megatron / veomni / torchtitan while any seam feature is on (pack_old_log_prob_as_update "
                         "is on by default)", check="validate_strategy"),
    KeyRule("model_engine", H, "dp resolves fsdp2; megatron / veomni / torchtitan resolve their own strategy",
            evidence=f"`{RECIPE_MAIN_TEST}::test_model_engine_resolves_its_own_strategy_and_is_refused_with_the_seams_"
                     "features`",
            refused_when="another engine than dp while any seam feature is on", check="validate_strategy"),
    *(KeyRule(f"{prefix}.{name}", P,
              "the divclip path computes the entropy its own way: under ERC one graph-free float32 function in both "
              "passes (the seam swaps verl's, chunked or not, and turns checkpointing off), under the vocabulary "
              "pass its own chunks" + ("" if prefix.endswith("fsdp_config") else "; the engine key follows it"),
              replaced_by=f"{POLICY}.erc_beta_low/erc_beta_high, {POLICY}.vocab_pass",
              refused_when="a value other than verl's default (false) with ERC or the vocabulary pass",
              check=check_entropy_keys)
      for name in ENTROPY_KEYS for prefix in (ACTOR, f"{ACTOR}.fsdp_config")),
    KeyRule(f"{ACTOR}.fsdp_config.use_torch_compile", H,
            "the seam's fp32 entropy (ERC, the vocabulary pass) is compiled where verl's engine compiles (on CUDA)",
            evidence="`tests/test_verl_key_reads.py::test_the_fp32_entropy_is_compiled_where_the_engine_compiles`"),
    KeyRule(f"{ROLLOUT}.temperature", H,
            "verl hands the rollout temperature to every micro-batch; the vocabulary pass (and pi_old's top-k under "
            "it) divides the logits by it as verl's materialised path does",
            evidence="`tests/test_vocab_pass_engine.py` (`fp32/temperature`: the vocabulary pass equals verl's path at "
                     "temperature 0.7)"),
    KeyRule(f"{ROLLOUT}.n", H, "the old-log-prob pass is packed with the update's split: ppo_mini_batch_size x "
                               "rollout.n sequences a mini-batch (as verl's _update_actor)",
            evidence="`tests/test_smoke_cpu.py` (rollout.n=8; the update checks its packing against the old pass's "
                     "record, and every step is exactly on-policy)"),
    KeyRule("trainer.default_local_dir", H, "incomplete checkpoints are set aside before verl resumes; the "
                                            "adaptive-delta state is saved in verl's step folder",
            evidence="`tests/test_adaptive_delta.py`; resume: `tests/test_trainer_modes_cpu.py`"),
    # --- per-benchmark validation lengths (recipe.validation.length) ------------------------------------------------
    *(KeyRule(f"{ROLLOUT}.{name}", H, f"verl's training {what}; per-benchmark validation (rollout.custom.validation) "
                                      "takes it for every validation set it does not name",
              evidence="`tests/test_validation_length.py::test_fields_left_out_take_the_defaults`")
      for name, what in (("response_length", "response length"), ("val_kwargs.n", "validation sample count"))),
    KeyRule(f"{ROLLOUT}.multi_turn.enable", F, "per-benchmark validation runs single-turn validation only",
            refused_when="true with rollout.custom.validation set", check="validate_validation_length"),
    KeyRule(f"{ROLLOUT}.agent.default_agent_loop", F, "per-benchmark validation replaces verl's single_turn_agent on "
                                                      "validation rows",
            refused_when="another agent loop with rollout.custom.validation set", check="validate_validation_length"),
    KeyRule(f"{ROLLOUT}.agent.agent_loop_manager_class", F,
            "per-benchmark validation brings its own agent-loop manager",
            refused_when="set with rollout.custom.validation set", check="validate_validation_length",
            read_in="trainer/ppo/ray_trainer.py"),
    KeyRule(f"{ROLLOUT}.name", F, "verl's rollout server; per-benchmark validation needs one that honours a request's "
                                  "max_tokens (hf_cpu, vllm, sglang)",
            refused_when="another server with rollout.custom.validation set", check="validate_validation_length"),
    *(KeyRule(f"{ROLLOUT}.{name}", F, "verl's context and prompt lengths, against which the validation lengths are "
                                      "checked",
              refused_when="prompt_length + a validation length (+ 1 on SGLang) > max_model_len with "
                           "rollout.custom.validation set", check="validate_validation_length")
      for name in ("max_model_len", "prompt_length")),
    *(KeyRule(f"actor_rollout_ref.model.{name}", H, "with rollout.max_model_len null, the model config's "
                                                    "max_position_embeddings is the context the validation lengths "
                                                    "are checked against (read with the model's path and "
                                                    "trust_remote_code)",
              evidence="`tests/test_validation_length.py::test_refused_before_ray_naming_the_key` (max_model_len=null)")
      for name in ("path", "trust_remote_code")),
    KeyRule("data.val_files", F, "verl's validation files; each benchmark rollout.custom.validation names must be in "
                                 "one",
            refused_when="a benchmark of rollout.custom.validation.benchmarks in none of the files",
            check="validate_validation_length"),
    # --- the model -------------------------------------------------------------------------------------------------
    KeyRule("actor_rollout_ref.model.use_remove_padding", H, "the padded path of every feature (false)",
            evidence="`tests/test_entropy_numerics.py` (`bf16/padded`), `tests/test_full_kl_engine.py`, "
                     "`tests/test_vocab_pass_engine.py`"),
    KeyRule(f"{ACTOR}.use_remove_padding", H, "follows actor_rollout_ref.model.use_remove_padding",
            evidence="`tests/test_entropy_numerics.py` (`bf16/padded`), `tests/test_full_kl_engine.py`"),
    KeyRule("actor_rollout_ref.model.lora_rank", H, "bit-identical to verl's ppo_loss with LoRA, exactly on-policy "
                                                    "under bf16; the reference pass (adapter off) keeps the packing "
                                                    "record",
            evidence="`tests/test_verl_features_engine.py`",
            refused_when="an lm_head adapter with the vocabulary pass", check="validate_vocab_pass"),
    *(KeyRule(f"actor_rollout_ref.model.{name}", F, "verl's LoRA adapter (as model.lora_rank); the vocabulary pass "
                                                    "reads the LM head's own weight",
              refused_when="an adapter on lm_head (target_modules) with the vocabulary pass",
              check="validate_vocab_pass")
      for name in ("lora_adapter_path", "target_modules")),
    KeyRule("actor_rollout_ref.model.use_fused_kernels", H,
            "verl's fused entropy serves both passes (bit-identical to ppo_loss, exactly on-policy); verl's own fused "
            "path fails under FSDP2 with an untied output head (outside the divclip path)",
            evidence=f"`tests/test_verl_features_engine.py`, `{RECIPE_MAIN_TEST}`",
            refused_when="true with the vocabulary pass, kl_full or the diagnostic (no logits)",
            check="validate_vocab_pass"),
    KeyRule(f"{ACTOR}.use_fused_kernels", H, "follows actor_rollout_ref.model.use_fused_kernels",
            evidence="`tests/test_verl_features_engine.py`"),
    # --- the critic ------------------------------------------------------------------------------------------------
    KeyRule("critic", H, "the critic's engine (a subclass of the one the seam wraps) computes bit-identically with "
                         "and without the seam", evidence="`tests/test_verl_features_engine.py`"),
    KeyRule("algorithm.adv_estimator", H, "gae with the critic, as critic.*; the GRPO family on the driver (verl's)",
            evidence="`tests/test_verl_features_engine.py`"),
    KeyRule("algorithm.use_kl_in_reward", H,
            "verl's KL penalty in the reward (apply_kl_penalty) reads pi_old before the update, so the old-log-prob "
            "pass is not skipped with it (policy_loss.old_log_prob_from_update=true is then refused)",
            evidence="`tests/test_old_pass_skip.py::test_where_it_is_not_exact_it_is_not_taken`, "
                     "`tests/test_old_pass_skip.py::test_asked_where_it_is_not_exact_is_refused_naming_the_key`"),
    # --- rollout correction ----------------------------------------------------------------------------------------
    *(KeyRule(f"{CORRECTION}.{name}", H,
              "verl computes the weights and the rejection mask on the driver; every divclip mode multiplies each "
              "token's surrogate by its weight as verl's losses do, its constraint still on pi_theta/pi_old",
              evidence="`tests/test_rollout_correction.py`; through the trainer in an async mode: "
                       "`tests/test_trainer_modes_cpu.py`",
              **({"refused_when": "set with actor_rollout_ref.rollout.calculate_log_probs=false (verl then skips the "
                                  "correction silently)", "check": check_rollout_correction_needs_log_probs}
                 if name in ("rollout_is", "rollout_rs") else {}))
      for name in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                   "rollout_rs_threshold")),
    KeyRule(f"{CORRECTION}.bypass_mode", H,
            "pi_old := mu for the ratio modes with pack_old_log_prob_as_update=false (the trust region is around the "
            "behaviour policy)",
            evidence=f"`{RECIPE_MAIN_TEST}`, `tests/test_verl_modes.py::test_erc_is_refused_on_bypass_mode`; kl3 in "
                     "bypass mode through the trainer (colocate_async): `tests/test_trainer_modes_cpu.py`",
            refused_when="with ERC, kl_full or the diagnostic (they need the old pass's entropy or top-k) and with the "
                         "pack_old_log_prob_as_update (no old pass to pack)", check="validate_bypass_mode"),
    KeyRule(f"{CORRECTION}.loss_type", F,
            "read only by verl's legacy trainer (apply_bypass_mode switches the loss to loss_mode=bypass_mode); verl "
            "0.9.1's v1 trainer, which recipe.main runs, never reads it -- nor its bypass presets' reinforce loss",
            refused_when="a value other than verl's default ppo_clip", check=check_loss_type),
    # --- dynamic sampling ------------------------------------------------------------------------------------------
    KeyRule("algorithm.filter_groups", H, "DAPO dynamic sampling through verl's replay buffer",
            evidence="`tests/test_smoke_cpu.py`"),
    KeyRule("algorithm.filter_groups.max_num_gen_batches", F, "ignored by verl 0.9.1's v1 trainer (its replay buffer "
                                                              "refills dropped groups)",
            refused_when="> 0 with filter_groups.enable=true", check="validate_filter_groups"),
    KeyRule("data.gen_batch_size", F, "replaced by 1 in verl 0.9.1's v1 trainer under dynamic sampling",
            refused_when="a value other than null or 1 with algorithm.filter_groups.enable=true",
            check="validate_filter_groups"),
)
# fmt: on

#: The checks of this module, run by :func:`check_replaced_keys` / :func:`check_refused_keys`.
REPLACED_CHECKS: tuple[Callable[[DictConfig], None], ...] = tuple(
    dict.fromkeys(rule.check for rule in RULES if rule.key_class is KeyClass.REPLACED and callable(rule.check))
)
REFUSED_CHECKS: tuple[Callable[[DictConfig], None], ...] = tuple(
    dict.fromkeys(
        rule.check
        for rule in RULES
        if rule.key_class is not KeyClass.REPLACED and callable(rule.check) and rule.check not in REPLACED_CHECKS
    )
)


def check_replaced_keys(config: DictConfig) -> None:
    """Refuse, naming both keys, every ``replaced`` key that does not hold what the divclip path uses instead
    (only under the condition its rule states). Raises ``ValueError``."""
    for check in REPLACED_CHECKS:
        check(config)


def check_refused_keys(config: DictConfig) -> None:
    """The refusals this table adds (the others are run by ``recipe.config_checks``). Raises ``ValueError``."""
    for check in REFUSED_CHECKS:
        check(config)


# ------------------------------------------------------------------------------------------------
# The doc
# ------------------------------------------------------------------------------------------------

CLASS_ORDER = (KeyClass.HONOURED, KeyClass.REPLACED, KeyClass.REFUSED, KeyClass.NO_EFFECT, KeyClass.VERL_READS)
CLASS_TITLE = {
    KeyClass.HONOURED: "honoured: the divclip path touches the feature, the test shows verl's effect",
    KeyClass.REPLACED: "replaced: the divclip path uses another key; a value it would not use is refused before Ray",
    KeyClass.REFUSED: "refused before Ray starts (the condition)",
    KeyClass.NO_EFFECT: "no effect on this path",
    KeyClass.VERL_READS: "verl reads it, the product's code never does",
}


def _leaf_counts() -> Counter[KeyClass]:
    return Counter(classify(key).key_class for key in verl_leaf_keys(compose_verl_schema()))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_doc() -> str:
    """docs/verl_features.md: the table, grouped by class, with the count of verl's leaf keys per class."""
    counts = _leaf_counts()
    total = sum(counts.values())
    reads, reads_date = read_keys(), json.loads(READ_KEYS_PATH.read_text())["date"]
    lines = [
        "# verl 0.9.1's config keys against the divclip path",
        "",
        "<!-- generated by `python -m recipe.verl_keys --write-doc` from recipe/verl_keys.py; tests/test_verl_keys.py "
        "checks it -->",
        "",
        f"Each of the {total} leaf keys of verl 0.9.1's `ppo_trainer` schema falls under the row below naming its "
        "longest prefix, or under none: then verl reads it and the product's code never does. Which keys the product "
        "reads is "
        f"recorded, not listed by hand: `{RECORD_COMMAND}` runs the suite's trainer and engine runs and the config "
        "checks with the recorder of `verl_ext/core/key_reads.py` on, and writes what the product's code read "
        f"(`{READ_KEYS_FILE}`, {len(reads)} verl keys, {reads_date}); every one of them has an honoured, replaced or "
        "refused row (`tests/test_verl_key_reads.py`). The divclip keys themselves (`divclip.*`, the divclip "
        "`policy_loss` knobs, `rollout.custom.validation`) are the project's ([losses](losses.md)). Leaf keys of "
        "verl's schema per class:",
        "",
        "| class | leaf keys | rows |",
        "| --- | --- | --- |",
        *(
            f"| `{cls.value}` | {counts.get(cls, 0)} | {sum(r.key_class is cls for r in RULES)} |"
            for cls in CLASS_ORDER
        ),
        "",
        "`python -m recipe.main` runs verl's v1 trainer with the divclip actor loss installed on every actor worker "
        "(`set_loss_fn`, every loss mode, verl's own included) and the engine seam wrapped around verl's FSDP actor "
        "engine ([engine](engine.md)). A **replaced** key may keep the value the divclip path uses (verl's default, or "
        "the replacing key's value); any other value is refused by `verl_ext/config_rules.py` before Ray starts, with "
        "a message naming both keys. A condition under *refused when* is refused the same way, naming the key. Nothing "
        "verl reads is dropped silently.",
        "",
    ]
    for cls in CLASS_ORDER:
        rows = sorted((r for r in RULES if r.key_class is cls), key=lambda r: r.key)
        lines += [f"## `{cls.value}` -- {CLASS_TITLE[cls]}", ""]
        if cls is KeyClass.VERL_READS:
            lines += [
                f"Every key no row above covers ({counts.get(cls, 0)} leaf keys of verl's schema): {VERL_ALONE}.",
                "",
            ]
            continue
        if cls is KeyClass.HONOURED:
            lines += [
                "| verl key (or prefix) | on the divclip path | refused when | evidence |",
                "| --- | --- | --- | --- |",
            ]
            lines += [f"| `{r.key}` | {_cell(r.reason)} | {_cell(r.refused_when or '')} | {r.evidence} |" for r in rows]
        elif cls is KeyClass.REPLACED:
            lines += ["| verl key | replaced by | why | refused when |", "| --- | --- | --- | --- |"]
            lines += [
                f"| `{r.key}` | `{r.replaced_by}` | {_cell(r.reason)} | {_cell(r.refused_when or '')} |" for r in rows
            ]
        elif cls is KeyClass.REFUSED:
            lines += ["| verl key | refused when | why |", "| --- | --- | --- |"]
            lines += [f"| `{r.key}` | {_cell(r.refused_when or '')} | {_cell(r.reason)} |" for r in rows]
        else:
            lines += ["| verl key (or prefix) | why | refused when |", "| --- | --- | --- |"]
            lines += [f"| `{r.key}` | {_cell(r.reason)} | {_cell(r.refused_when or '')} |" for r in rows]
        lines.append("")
    lines += [
        f"## What the product reads ({len(reads)} verl keys, `{RECORD_COMMAND}`, {reads_date})",
        "",
        "| verl key | its row | class | read by |",
        "| --- | --- | --- | --- |",
        *(
            f"| `{key}` | {f'`{row.key}`' if row else NOT_CONFIG_KEYS.get(key, '-')} | "
            f"{f'`{row.key_class.value}`' if row else '(no config key)' if key in NOT_CONFIG_KEYS else '`verl_reads`'} "
            f"| {', '.join(f'`{m}`' for m in modules)} |"
            for key, modules in reads.items()
            for row in (row_of(key),)
        ),
        "",
    ]
    lines += [
        "The guard of the engine seam checks, at install, the verl symbols, keys and attributes this table relies on "
        "inside the engine ([engine](engine.md)), and refuses a verl other than 0.9.1 unless "
        "`DIVCLIP_ALLOW_UNSUPPORTED_VERL=1`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m recipe.verl_keys --write-doc | --check-doc``."""
    parser = argparse.ArgumentParser(prog="python -m recipe.verl_keys", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-doc", action="store_true", help=f"write {DOC_PATH}")
    group.add_argument("--check-doc", action="store_true", help=f"exit 1 if {DOC_PATH} differs from the table")
    args = parser.parse_args(argv)
    text = render_doc()
    if args.write_doc:
        DOC_PATH.write_text(text)
        return 0
    if DOC_PATH.read_text() != text:
        print(f"{DOC_PATH} is stale: run python -m recipe.verl_keys --write-doc", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
