"""The rule table of every verl config key (recipe/verl_keys.py): it covers every leaf of the resolved config,
names only keys verl's schema has, lands the keys reviews found in their true class, refuses what the divclip
path replaces or drops (naming both keys) while accepting the values it uses, and generates
docs/verl_features.md."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from recipe import verl_keys
from recipe.config_checks import ConfigError, validate_divclip_config
from recipe.verl_key_checks import compose_verl_schema, leaf_keys
from recipe.verl_keys import KeyClass, classify, verl_leaf_keys
from tests.test_recipe_main import ERC, KL_FULL, PACK_OFF, SEPARATE, compose_config
from verl_ext.config_rules.verl_keys import verl_config_dir, verl_default, verl_schema

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
POLICY = f"{ACTOR}.policy_loss"
CORRECTION = "algorithm.rollout_correction"
ERC_ON = [*ERC, f"{ACTOR}.calculate_entropy=true"]
DYNAMIC = [f"{ACTOR}.use_dynamic_bsz=true", f"{ROLLOUT}.log_prob_use_dynamic_bsz=true"]
VERL_GSPO = [f"{POLICY}.loss_mode=gspo", f"{POLICY}._target_=verl.workers.config.PolicyLossConfig"]

#: Configs whose optional subtrees differ: the default, kl3 with ERC, kl_full, separate_async, verl's own class.
CONFIGS = {
    "default": [],
    "kl3+erc": [f"{POLICY}.loss_mode=kl3", *ERC_ON],
    "kl_full": KL_FULL,
    "separate_async": SEPARATE,
    "verl_policy_class": VERL_GSPO,
}


@pytest.fixture(scope="module")
def verl_schema_leaves() -> set[str]:
    return set(leaf_keys(compose_verl_schema()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_leaf_of_the_resolved_config_has_a_rule(name: str, verl_schema_leaves: set[str]) -> None:
    config = compose_config(*CONFIGS[name])
    validate_divclip_config(config)  # a config the recipe runs
    leaves = list(leaf_keys(config))
    assert len(leaves) > 900
    for key in verl_leaf_keys(config):
        classify(key)  # KeyError names the uncovered key
    # only the project's own keys are left out, and none of them is verl's
    own = [key for key in leaves if verl_keys.is_divclip_key(key)]
    assert own and not set(own) & verl_schema_leaves
    assert {key for key in verl_leaf_keys(config)} <= verl_schema_leaves, "a verl key outside verl's schema"


def test_every_rule_names_a_key_of_verls_schema(verl_schema_leaves: set[str]) -> None:
    schema = compose_verl_schema()
    for rule in verl_keys.RULES:
        if rule.read_in is not None:  # read by verl's code, declared by no schema (set with '+')
            assert OmegaConf.select(schema, rule.key, default=None) is None, rule.key
            assert rule.key.rsplit(".", 1)[-1] in (verl_config_dir().parents[1] / rule.read_in).read_text(), rule
            continue
        assert any(leaf == rule.key or leaf.startswith(rule.key + ".") for leaf in verl_schema_leaves), (
            f"{rule.key} is not a key of verl's ppo_trainer schema"
        )
    keys = [rule.key for rule in verl_keys.RULES]
    assert len(keys) == len(set(keys)), "two rows for one key"


def test_a_rule_naming_a_key_verl_lacks_fails_the_check(verl_schema_leaves: set[str]) -> None:
    missing = "actor_rollout_ref.actor.clip_ratio_d"
    assert not any(leaf == missing or leaf.startswith(missing + ".") for leaf in verl_schema_leaves)
    with pytest.raises(KeyError, match=r"clip_ratio_d is not a key of verl's ppo_trainer schema"):
        verl_default(missing)


def test_the_flattened_schema_the_checks_read_is_verls_composed_config() -> None:
    composed = OmegaConf.to_container(compose_verl_schema(), resolve=False)
    flattened = OmegaConf.to_container(verl_schema(), resolve=False)
    composed.pop("model_engine")  # the one key verl's generator leaves out (a defaults-list choice)
    assert composed == flattened


def test_every_rule_that_refuses_has_its_check() -> None:
    import recipe.config_checks as config_checks
    from verl_ext.config_rules import composed, policy

    for rule in verl_keys.RULES:
        if rule.refused_when is None:
            continue
        named = [getattr(module, str(rule.check), None) for module in (composed, policy, config_checks)]
        check = rule.check if callable(rule.check) else next((f for f in named if f is not None), None)
        assert callable(check), rule
        if rule.key_class is KeyClass.REPLACED and callable(rule.check):
            assert rule.check in verl_keys.REPLACED_CHECKS, rule


@pytest.mark.parametrize(
    "key, key_class",
    [
        (f"{ACTOR}.clip_ratio_c", KeyClass.REPLACED),
        (f"{CORRECTION}.rollout_is", KeyClass.HONOURED),
        (f"{CORRECTION}.rollout_rs", KeyClass.HONOURED),
        (f"{CORRECTION}.loss_type", KeyClass.REFUSED),
        ("trainer.v1.sync.parameter_sync_step", KeyClass.REFUSED),
        ("trainer.v1.colocate_async.parameter_sync_step", KeyClass.REFUSED),
        ("trainer.v1.separate_async.parameter_sync_step", KeyClass.HONOURED),
        (f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", KeyClass.REPLACED),
        (f"{ROLLOUT}.log_prob_max_token_len_per_gpu", KeyClass.REPLACED),
        (f"{ROLLOUT}.log_prob_use_dynamic_bsz", KeyClass.REPLACED),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", KeyClass.VERL_READS),
        (f"{ACTOR}.fsdp_config.entropy_checkpointing", KeyClass.REPLACED),
        (f"{ACTOR}.fsdp_config.entropy_from_logits_with_chunking", KeyClass.REPLACED),
        (f"{ACTOR}.entropy_checkpointing", KeyClass.REPLACED),
        ("actor_rollout_ref.ref.fsdp_config.entropy_checkpointing", KeyClass.NO_EFFECT),
        ("data.gen_batch_size", KeyClass.REFUSED),
        ("data.train_files", KeyClass.VERL_READS),
        ("critic.optim.lr", KeyClass.HONOURED),
        ("trainer.logger", KeyClass.VERL_READS),
    ],
)
def test_keys_land_in_their_class(key: str, key_class: KeyClass) -> None:
    assert classify(key).key_class is key_class


def test_replaced_rows_name_the_replacing_key() -> None:
    assert classify(f"{ACTOR}.clip_ratio_c").replaced_by == f"{POLICY}.dual_clip_c"
    assert classify(f"{ROLLOUT}.log_prob_max_token_len_per_gpu").replaced_by == f"{ACTOR}.ppo_max_token_len_per_gpu"


REFUSED = [
    # clip_ratio_c on a divclip mode: its dual clip is policy_loss.dual_clip_c alone
    ([f"{ACTOR}.clip_ratio_c=2.0"], [f"{ACTOR}.clip_ratio_c=2.0", f"{POLICY}.dual_clip_c"]),
    (
        [f"{ACTOR}.clip_ratio_c=2.0", f"{POLICY}.dual_clip_c=5.0"],
        [f"{ACTOR}.clip_ratio_c=2.0", f"{POLICY}.dual_clip_c"],
    ),
    # rollout correction without the rollout's log-probs: verl skips it silently
    (
        [f"{CORRECTION}.rollout_is=token", f"{ROLLOUT}.calculate_log_probs=false"],
        [f"{CORRECTION}.rollout_is='token'", f"{ROLLOUT}.calculate_log_probs=false"],
    ),
    (
        [f"{CORRECTION}.rollout_rs=seq_mean_k1", f"{ROLLOUT}.calculate_log_probs=false"],
        [f"{CORRECTION}.rollout_rs='seq_mean_k1'", f"{ROLLOUT}.calculate_log_probs=false"],
    ),
    # loss_type: read only by verl's legacy trainer
    ([f"{CORRECTION}.loss_type=reinforce"], [f"{CORRECTION}.loss_type='reinforce'", f"{POLICY}.loss_mode"]),
    # parameter_sync_step outside separate_async
    (
        ["+trainer.v1.sync.parameter_sync_step=2"],
        ["trainer.v1.sync.parameter_sync_step=2", "trainer.v1.separate_async.parameter_sync_step", "honours it"],
    ),
    (
        ["trainer.v1.trainer_mode=colocate_async", "+trainer.v1.colocate_async.parameter_sync_step=2"],
        ["trainer.v1.colocate_async.parameter_sync_step=2", "trainer.v1.separate_async.parameter_sync_step"],
    ),
    # the old-log-prob pass's packing, replaced by the update's
    (
        [f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8"],
        [
            f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8",
            f"{ACTOR}.ppo_micro_batch_size_per_gpu=4",
            "pack_old_log_prob_as_update=false",
        ],
    ),
    (
        [*VERL_GSPO, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8"],  # verl's plain policy-loss config packs too
        [f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8", f"{ACTOR}.ppo_micro_batch_size_per_gpu=4"],
    ),
    (
        [*DYNAMIC, f"{ROLLOUT}.log_prob_max_token_len_per_gpu=32768"],
        [
            f"{ROLLOUT}.log_prob_max_token_len_per_gpu=32768",
            f"{ACTOR}.ppo_max_token_len_per_gpu=16384",
            "pack_old_log_prob_as_update=false",
        ],
    ),
    (
        [f"{ROLLOUT}.log_prob_use_dynamic_bsz=true"],
        [f"{ROLLOUT}.log_prob_use_dynamic_bsz=True", f"{ACTOR}.use_dynamic_bsz=False"],
    ),
    (  # verl's default interpolates the actor's flag: false set by hand is no default
        [f"{ACTOR}.use_dynamic_bsz=true", f"{ROLLOUT}.log_prob_use_dynamic_bsz=false"],
        [f"{ROLLOUT}.log_prob_use_dynamic_bsz=False", f"{ACTOR}.use_dynamic_bsz=True"],
    ),
    (
        [f"{ROLLOUT}.log_prob_micro_batch_size=8"],
        [f"{ROLLOUT}.log_prob_micro_batch_size=8", f"{ACTOR}.ppo_micro_batch_size_per_gpu"],
    ),
    # verl's entropy settings under ERC / the vocabulary pass
    (
        [*ERC_ON, f"{ACTOR}.fsdp_config.entropy_checkpointing=true"],
        [f"{ACTOR}.fsdp_config.entropy_checkpointing=True", f"{POLICY}.erc_beta_low/erc_beta_high"],
    ),
    (
        [*ERC_ON, f"{ACTOR}.entropy_from_logits_with_chunking=true"],
        [f"{ACTOR}.entropy_from_logits_with_chunking=True", f"{POLICY}.erc_beta_low/erc_beta_high"],
    ),
    (
        [f"{POLICY}.vocab_pass=true", f"{ACTOR}.fsdp_config.entropy_from_logits_with_chunking=true"],
        [f"{ACTOR}.fsdp_config.entropy_from_logits_with_chunking=True", f"{POLICY}.vocab_pass=true"],
    ),
    # dynamic sampling's generation batch, replaced by 1 in verl's v1 trainer
    (
        ["algorithm.filter_groups.enable=true", "data.gen_batch_size=8"],
        [
            "data.gen_batch_size=8",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_inflight_gen_batches",
        ],
    ),
]


@pytest.mark.parametrize("overrides, names", REFUSED, ids=[o[-1] for o, _ in REFUSED])
def test_a_replaced_or_dropped_key_is_refused_naming_both_keys(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        validate_divclip_config(compose_config(*overrides))
    message = str(error.value)
    for name in names:
        assert name in message, (name, message)


ACCEPTED = [
    [],  # every key at the project's defaults
    [f"{ACTOR}.clip_ratio_c=3.0"],  # verl's default
    [f"{ACTOR}.clip_ratio_c=10.0", f"{POLICY}.dual_clip_c=10.0"],  # both keys say the same c (released ERC profile)
    [f"{POLICY}.loss_mode=vanilla", f"{ACTOR}.clip_ratio_c=2.0"],  # verl's own mode reads it
    [f"{ROLLOUT}.calculate_log_probs=false"],  # no rollout correction asked for
    [f"{CORRECTION}.rollout_is=token", f"{ROLLOUT}.calculate_log_probs=true"],
    [f"{CORRECTION}.loss_type=ppo_clip"],
    ["+trainer.v1.sync.parameter_sync_step=1"],
    [*SEPARATE, "trainer.v1.separate_async.parameter_sync_step=4"],
    [f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=null"],  # verl's default
    [f"{ACTOR}.ppo_micro_batch_size_per_gpu=8", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8"],  # the value used
    [PACK_OFF, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8"],  # verl's packing: verl reads it
    [*DYNAMIC],  # verl's default interpolates the actor's token budget
    [*DYNAMIC, f"{ROLLOUT}.log_prob_max_token_len_per_gpu=16384"],
    [*DYNAMIC, PACK_OFF, f"{ROLLOUT}.log_prob_max_token_len_per_gpu=32768"],
    [*DYNAMIC, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8"],  # no micro-batch size under dynamic batching
    [f"{ACTOR}.fsdp_config.entropy_checkpointing=true"],  # verl's entropy: verl reads it
    [*ERC_ON, f"{ACTOR}.fsdp_config.entropy_checkpointing=false"],
    ["algorithm.filter_groups.enable=true", "data.gen_batch_size=1"],
    ["data.gen_batch_size=8"],  # without dynamic sampling verl's v1 trainer reads it
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) or "defaults" for o in ACCEPTED])
def test_keys_at_the_value_the_divclip_path_uses_are_accepted(overrides: list[str]) -> None:
    validate_divclip_config(compose_config(*overrides))


SYNC_STEP_TAIL = (
    "Leave it at 1, or use trainer.v1.trainer_mode=separate_async with trainer.v1.separate_async.parameter_sync_step "
    "(Decoupled PPO, supported)"
)
#: refusals whose message a user reads, word for word: (id, overrides, message)
REFUSED_WORD_FOR_WORD = [
    # verl 0.9.1's v1 replay buffer refills without a cap (max_num_gen_batches is read by the legacy trainer only):
    # any cap, 1 included, is refused, naming the key that bounds generation instead
    (
        "max_num_gen_batches",
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1"],
        "algorithm.filter_groups.max_num_gen_batches is ignored by verl 0.9.1's v1 trainer (its replay buffer "
        "refills dropped groups until data.train_batch_size remain); set it to 0 and bound generation with "
        "algorithm.filter_groups.max_inflight_gen_batches (in units of data.train_batch_size)",
    ),
    # so is a generation batch other than 1, which that trainer replaces by 1
    (
        "gen_batch_size",
        ["algorithm.filter_groups.enable=true", "data.gen_batch_size=8"],
        "data.gen_batch_size=8 is replaced by 1 in verl 0.9.1's v1 trainer when algorithm.filter_groups.enable=true; "
        "unset it and use algorithm.filter_groups.max_inflight_gen_batches",
    ),
    # verl's entropy settings, naming what replaces them
    (
        "erc",
        [*ERC_ON, f"{ACTOR}.fsdp_config.entropy_checkpointing=true"],
        f"{ACTOR}.fsdp_config.entropy_checkpointing=True is replaced by {POLICY}.erc_beta_low/erc_beta_high (ERC): "
        "the divclip path computes the entropy its own way (one graph-free float32 function in both passes), so "
        "verl's entropy_checkpointing does nothing. Leave it at verl's default False",
    ),
    (
        "vocab_pass",
        [f"{POLICY}.vocab_pass=true", f"{ACTOR}.entropy_from_logits_with_chunking=true"],
        f"{ACTOR}.entropy_from_logits_with_chunking=True is replaced by {POLICY}.vocab_pass=true: the divclip "
        "path computes the entropy its own way (the chunked vocabulary pass), so verl's "
        "entropy_from_logits_with_chunking does nothing. Leave it at verl's default False",
    ),
    # parameter_sync_step, saying whether verl reads it
    (
        "sync-step-active-mode",
        ["+trainer.v1.sync.parameter_sync_step=3"],  # the active mode's: verl honours it, the gauge would not
        "trainer.v1.sync.parameter_sync_step=3: verl's base trainer honours it in trainer.v1.trainer_mode=sync "
        "(each step trains 3 local updates, each on data.train_batch_size / 3 samples of the step's rollouts, "
        "pi_old recomputed before each), but the divclip on-policy flag treats every later local update as "
        "off-policy, so its on-policy gauge and packing check never see them. " + SYNC_STEP_TAIL,
    ),
    (
        "sync-step-inactive-mode",
        ["+trainer.v1.colocate_async.parameter_sync_step=2"],  # another mode's: verl never reads it
        "trainer.v1.colocate_async.parameter_sync_step=2: verl reads only trainer.v1.sync.* in "
        "trainer.v1.trainer_mode=sync: it has no effect. " + SYNC_STEP_TAIL,
    ),
]


@pytest.mark.parametrize(
    "overrides, message", [row[1:] for row in REFUSED_WORD_FOR_WORD], ids=[row[0] for row in REFUSED_WORD_FOR_WORD]
)
def test_refusals_read_word_for_word(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate_divclip_config(compose_config(*overrides))
    assert str(error.value) == message


def test_an_interpolated_verl_default_is_no_exemption() -> None:
    """verl's ``rollout.log_prob_max_token_len_per_gpu`` interpolates the actor's token budget: 16384, the value it
    takes in verl's schema, is not its default once the actor's budget is 8192, so writing 16384 is refused (the
    pass is packed with 8192); a key verl sets to a plain value may be left at it."""
    budget = [*DYNAMIC, f"{ACTOR}.ppo_max_token_len_per_gpu=8192"]
    validate_divclip_config(compose_config(*budget))  # the interpolation follows the actor: accepted
    assert verl_default(f"{ROLLOUT}.log_prob_max_token_len_per_gpu") == 16384
    with pytest.raises(ConfigError) as error:
        validate_divclip_config(compose_config(*budget, f"{ROLLOUT}.log_prob_max_token_len_per_gpu=16384"))
    assert str(error.value).startswith(
        f"{ROLLOUT}.log_prob_max_token_len_per_gpu=16384 is not used: with {POLICY}.pack_old_log_prob_as_update=true "
        f"(the default) the old-log-prob pass is packed exactly as the update, with {ACTOR}.ppo_max_token_len_per_gpu"
        "=8192. "
    ), str(error.value)


def test_a_missing_verl_schema_file_is_named(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_ext.config_rules import verl_keys as rules

    monkeypatch.setattr(rules, "verl_config_dir", lambda: tmp_path)
    rules.verl_schema.cache_clear()
    try:
        with pytest.raises(FileNotFoundError) as error:
            rules.verl_schema()
        assert str(error.value) == (
            f"verl's flattened ppo_trainer config is missing: {tmp_path / '_generated_ppo_trainer.yaml'}"
        )
    finally:
        rules.verl_schema.cache_clear()


def test_the_doc_is_the_table() -> None:
    """docs/verl_features.md is generated from the table (python -m recipe.verl_keys --write-doc)."""
    text = verl_keys.DOC_PATH.read_text()
    assert text == verl_keys.render_doc(), "docs/verl_features.md is stale: run python -m recipe.verl_keys --write-doc"
    head = text.split("## ", 1)[0]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| `(\w+)` \| (\d+) \|", head, re.M)}
    assert set(counts) == {cls.value for cls in KeyClass}
    assert sum(counts.values()) == len(list(verl_leaf_keys(compose_verl_schema())))
    for rule in verl_keys.RULES:
        assert f"`{rule.key}`" in text, rule.key
        if rule.evidence is not None:
            assert rule.evidence in text
