"""The entry point composes, validates (naming keys) and dry-runs; the trainer subclass installs
the divclip actor loss once, after verl's own on_init_end."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir

from recipe.config_checks import ConfigError, validate_divclip_config
from recipe.main import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
ERC = [
    "actor_rollout_ref.actor.policy_loss.erc_beta_low=0.05",
    "actor_rollout_ref.actor.policy_loss.erc_beta_high=0.05",
]
KL_FULL = ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_full"]


def dry_run(*overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recipe.main", "--dry-run", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def compose_config(*overrides: str) -> Any:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="divclip_trainer", overrides=list(overrides))


def test_dry_run_prints_only_the_resolved_yaml():
    proc = dry_run(
        "actor_rollout_ref.actor.policy_loss.delta=0.05", "actor_rollout_ref.actor.calculate_entropy=true", *ERC
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = yaml.safe_load(proc.stdout)  # stdout is YAML and nothing else
    policy = config["actor_rollout_ref"]["actor"]["policy_loss"]
    assert policy["_target_"] == "verl_ext.config.DivClipPolicyLossConfig"
    assert policy["loss_mode"] == "kl3" and policy["delta"] == 0.05 and policy["erc_beta_low"] == 0.05
    assert config["trainer"]["v1"]["trainer_mode"] == "sync" and config["trainer"]["use_v1"] is True
    assert "${" not in proc.stdout  # resolved


ACTOR_KEY = "actor_rollout_ref.actor"
PACK_OFF = "actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=false"
CALC = "actor_rollout_ref.actor.calculate_entropy=true"
GSPO = "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"
PLAIN_TARGET = "actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig"
DIVCLIP_TARGET = "actor_rollout_ref.actor.policy_loss._target_=verl_ext.config.DivClipPolicyLossConfig"
ERC_BYPASS = (
    "ERC needs pi_old's per-token entropy, which only the old-log-prob recompute produces; "
    "algorithm.rollout_correction.bypass_mode=True skips it. Set it to False or turn ERC off."
)
FUSED = (
    "needs the logits to take pi_old's top-k and pi_theta's log-probs on it; verl's fused kernels never "
    "materialise them: set actor_rollout_ref.model.use_fused_kernels=False"
)


def _unregistered(mode: str) -> str:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    known = sorted(POLICY_LOSS_REGISTRY)
    return f"{ACTOR_KEY}: {ACTOR_KEY}.policy_loss.loss_mode={mode!r} is not a registered policy loss; known: {known}"


#: each refusal and its message, word for word (what the user reads: a change of wording is a change here)
CONFIG_ERRORS = {
    "ERC without the entropy": (
        ERC,
        f"ERC ({ACTOR_KEY}.policy_loss.erc_beta_low/erc_beta_high set) needs the current per-token entropy: "
        f"set {ACTOR_KEY}.calculate_entropy=True",
    ),
    "ERC in bypass mode": ([*ERC, CALC, "algorithm.rollout_correction.bypass_mode=true"], ERC_BYPASS),
    # ERC's own rule, not only the packing's (which refuses bypass_mode with the pass packed)
    "ERC in bypass mode, unpacked": (
        [*ERC, CALC, "algorithm.rollout_correction.bypass_mode=true", PACK_OFF],
        ERC_BYPASS,
    ),
    "ERC with an entropy bonus": (
        [*ERC, CALC, f"{ACTOR_KEY}.entropy_coeff=0.001"],
        f"ERC: {ACTOR_KEY}.entropy_coeff=0.001 adds an entropy bonus, which needs the entropy gradient; the detached "
        "entropy path (verl_ext.engine.request.entropy_as_mask) is only valid with entropy_coeff=0. Leave the loss "
        "function undeclared to keep verl's autograd entropy.",
    ),
    "a divclip knob under verl's config class": (
        [*ERC, CALC, GSPO, PLAIN_TARGET],
        f"{ACTOR_KEY}.policy_loss.erc_beta_high=0.05 is a divclip knob: it needs {DIVCLIP_TARGET} (got "
        "'verl.workers.config.PolicyLossConfig'); verl's modes accept it there too",
    ),
    "dual-clip on a verl mode": (
        [*ERC, CALC, GSPO, f"{ACTOR_KEY}.policy_loss.dual_clip_c=10"],
        f"{ACTOR_KEY}: {ACTOR_KEY}.policy_loss.dual_clip_c is the divclip modes' dual-clip cap; verl's "
        f"loss_mode='gspo' reads its own ({ACTOR_KEY}.clip_ratio_c, which verl's vanilla applies; the other verl "
        "modes have no dual-clip rule): remove dual_clip_c",
    ),
    "an unregistered mode": ([f"{ACTOR_KEY}.policy_loss.loss_mode=kl4"], _unregistered("kl4")),
    # the dataclass's own message, not the wrapping of Hydra's instantiation (its cause chain's root)
    "delta 0": (
        [f"{ACTOR_KEY}.policy_loss.delta=0"],
        f"{ACTOR_KEY}: {ACTOR_KEY}.policy_loss.delta must be a finite number > 0, got 0",
    ),
    "clip_ratio_low 1.5": (
        [f"{ACTOR_KEY}.clip_ratio_low=1.5"],
        f"{ACTOR_KEY}.clip_ratio_low must lie in [0, 1), got 1.5",
    ),
    "a divclip mode under verl's config class": (
        [PLAIN_TARGET],
        f"{ACTOR_KEY}.policy_loss.loss_mode='kl3' needs {DIVCLIP_TARGET} (got 'verl.workers.config.PolicyLossConfig'): "
        "verl's PolicyLossConfig cannot carry the divclip knobs",
    ),
    # kl_full: pi_old's top-k must be stored, k within [1, vocabulary], a known direction
    "kl_full in bypass mode": (
        [*KL_FULL, "algorithm.rollout_correction.bypass_mode=true"],
        f"{ACTOR_KEY}.policy_loss.loss_mode=kl_full needs pi_old's top-k, stored by the old-log-prob recompute; "
        "algorithm.rollout_correction.bypass_mode=True skips it. Set it to False.",
    ),
    "kl_full with fused kernels": (
        [*KL_FULL, "actor_rollout_ref.model.use_fused_kernels=true"],
        f"{ACTOR_KEY}.policy_loss.loss_mode=kl_full {FUSED}",
    ),
    "kl_full with Ulysses": (
        [*KL_FULL, f"{ACTOR_KEY}.fsdp_config.ulysses_sequence_parallel_size=2"],
        f"{ACTOR_KEY}.policy_loss.loss_mode=kl_full takes the top-k from the logits of whole packed sequences; "
        f"Ulysses sequence parallelism shards them: {ACTOR_KEY}.fsdp_config.ulysses_sequence_parallel_size=2 must be 1",
    ),
    "the diagnostic with fused kernels": (
        [f"{ACTOR_KEY}.policy_loss.kl_full_diagnostic=true", "actor_rollout_ref.model.use_fused_kernels=true"],
        f"{ACTOR_KEY}.policy_loss.kl_full_diagnostic=true {FUSED}",
    ),
    "top-k 0": (
        [*KL_FULL, f"{ACTOR_KEY}.policy_loss.kl_full_top_k=0"],
        f"{ACTOR_KEY}: {ACTOR_KEY}.policy_loss.kl_full_top_k must be an integer >= 1, got 0",
    ),
    "top-k null": (
        [*KL_FULL, f"{ACTOR_KEY}.policy_loss.kl_full_top_k=null"],
        f"{ACTOR_KEY}: {ACTOR_KEY}.policy_loss.kl_full_top_k must be an integer >= 1, got None",
    ),
    "an unknown direction": (
        [*KL_FULL, f"{ACTOR_KEY}.policy_loss.kl_full_direction=sideways"],
        f"{ACTOR_KEY}: {ACTOR_KEY}.policy_loss.kl_full_direction must be one of ('forward', 'reverse'), got 'sideways'",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors_name_the_key(case: str) -> None:
    overrides, message = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError) as refused:
        validate_divclip_config(compose_config(*overrides))
    assert str(refused.value) == message


MEGATRON = "actor_rollout_ref.actor.strategy=megatron"


@pytest.mark.parametrize(
    "overrides, keys",
    [
        ([MEGATRON], ["pack_old_log_prob_as_update"]),  # on by default: every mode asks for pack_old_log_prob_as_update
        # verl's own config class: the divclip actor loss still packs the pass as the update
        (
            [MEGATRON, PLAIN_TARGET, "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"],
            ["pack_old_log_prob_as_update"],
        ),
        ([MEGATRON, PACK_OFF, *ERC, "actor_rollout_ref.actor.calculate_entropy=true"], ["erc_beta_low/erc_beta_high"]),
        ([MEGATRON, PACK_OFF, *KL_FULL], ["loss_mode=kl_full"]),
        ([MEGATRON, PACK_OFF, "actor_rollout_ref.actor.policy_loss.kl_full_diagnostic=true"], ["kl_full_diagnostic"]),
        (
            [
                "actor_rollout_ref.actor.strategy=veomni",
                PACK_OFF,
                "actor_rollout_ref.actor.policy_loss.vocab_pass=true",
            ],
            ["vocab_pass"],
        ),
        (
            [
                MEGATRON,
                "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                *ERC,
                "actor_rollout_ref.actor.calculate_entropy=true",
            ],
            ["erc_beta_low/erc_beta_high", "pack_old_log_prob_as_update"],
        ),
    ],
)
def test_a_strategy_the_seam_does_not_cover_is_refused_naming_the_keys(overrides, keys):
    """megatron / veomni / torchtitan get none of the engine features: refused before Ray starts, naming
    the keys that ask for them and the strategies that support them, instead of a silent fallback."""
    with pytest.raises(ConfigError) as error:
        validate_divclip_config(compose_config(*overrides))
    message = str(error.value)
    assert "actor_rollout_ref.actor.strategy=" in message and "['fsdp', 'fsdp2']" in message
    named = ", ".join(f"actor_rollout_ref.actor.policy_loss.{key}" for key in keys)
    assert f"={overrides[0].split('=')[1]!r}: {named} need(s) verl-divclip's engine seam" in message, message


def test_an_uncovered_strategy_with_every_engine_feature_off_is_accepted():
    actor = validate_divclip_config(compose_config(MEGATRON, PACK_OFF))
    assert actor.strategy == "megatron" and actor.policy_loss.pack_old_log_prob_as_update is False


def test_the_configs_resolve_fsdp2_and_keep_fsdp1_selectable():
    assert validate_divclip_config(compose_config()).strategy == "fsdp2"
    assert validate_divclip_config(compose_config("actor_rollout_ref.actor.strategy=fsdp")).strategy == "fsdp"
    config = compose_config()
    assert config.actor_rollout_ref.ref.strategy == "fsdp2"  # the reference policy follows the actor


def test_kl_full_top_k_beyond_the_vocabulary_names_the_key(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 512}')
    model = f"actor_rollout_ref.model.path={tmp_path}"
    validate_divclip_config(compose_config(*KL_FULL, model, "actor_rollout_ref.actor.policy_loss.kl_full_top_k=512"))
    with pytest.raises(
        ConfigError, match=r"policy_loss\.kl_full_top_k=513 must lie in \[1, vocabulary size 512\] \(the model's"
    ):
        validate_divclip_config(
            compose_config(*KL_FULL, model, "actor_rollout_ref.actor.policy_loss.kl_full_top_k=513")
        )


def test_trainer_stores_the_top_k_in_the_old_log_prob_pass_only(monkeypatch):
    """DivClipTrainer._compute_old_log_prob asks verl's pass for pi_old's top-k (kl_full, or the diagnostic)
    and takes the request away again, so the reference pass after it stores nothing."""
    from verl.trainer.ppo.v1 import PPOTrainerSync

    from recipe.trainer import DivClipPPOTrainerSync
    from verl_ext.engine.packing import UPDATE_PACKING_KEY, UpdatePacking
    from verl_ext.engine.topk_capture import CAPTURE_KEY

    seen: list[Any] = []
    monkeypatch.setattr(
        PPOTrainerSync,
        "_compute_old_log_prob",
        lambda self, batch, metrics: seen.append(dict(batch.extra_info)) or batch,
    )
    batch = type("Batch", (), {"extra_info": {"temperature": 1.0}, "tags": []})()
    for overrides, expected in (
        (KL_FULL, 32),
        (
            [
                "actor_rollout_ref.actor.policy_loss.kl_full_diagnostic=true",
                "actor_rollout_ref.actor.policy_loss.kl_full_top_k=8",
            ],
            8,
        ),
        ([], None),
    ):
        trainer = object.__new__(DivClipPPOTrainerSync)
        trainer.config = compose_config(*overrides, "actor_rollout_ref.rollout.calculate_log_probs=false")
        trainer.global_steps = 1
        trainer.local_trigger_step = 0  # what verl's __init__ sets
        assert trainer._compute_old_log_prob(batch, metrics={}) is batch
        assert seen[-1].get(CAPTURE_KEY) == expected
        assert (
            seen[-1][UPDATE_PACKING_KEY]
            == UpdatePacking.from_actor_config(trainer.config.actor_rollout_ref.actor, 1).as_extra_info()[
                UPDATE_PACKING_KEY
            ]
        )
        assert CAPTURE_KEY not in batch.extra_info and UPDATE_PACKING_KEY not in batch.extra_info


def test_misspelt_key_is_rejected_by_hydra_with_its_name():
    """The entry point's composition (the dry run's, in this process) refuses a key the config does not have."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(
        ConfigCompositionException, match=r"Could not override 'actor_rollout_ref\.actor\.policy_loss\.detla'"
    ):
        compose_config("actor_rollout_ref.actor.policy_loss.detla=0.05")


def test_disabled_plugins_fail_fast_before_ray():
    proc = dry_run(env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert proc.returncode != 0
    assert "VERL_USE_EXTERNAL_PLUGINS='none'" in proc.stderr
    assert "ray init" not in proc.stdout + proc.stderr


def test_verl_modes_compose_through_the_same_entry_point():
    config = compose_config("actor_rollout_ref.actor.policy_loss.loss_mode=sapo")
    assert validate_divclip_config(config).policy_loss.loss_mode == "sapo"


def test_erc_on_a_verl_mode_goes_through_the_divclip_config():
    from verl_ext.config import DivClipPolicyLossConfig

    config = compose_config(
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.calculate_entropy=true", *ERC
    )
    policy = validate_divclip_config(config).policy_loss
    assert isinstance(policy, DivClipPolicyLossConfig) and policy.loss_mode == "gspo" and policy.erc_enabled


def test_verls_own_policy_loss_class_still_works_without_divclip_knobs():
    from verl.workers.config import PolicyLossConfig

    config = compose_config(
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig",
    )
    policy = validate_divclip_config(config).policy_loss
    assert type(policy) is PolicyLossConfig and policy.loss_mode == "gspo"
    assert "delta" not in config.actor_rollout_ref.actor.policy_loss  # unset divclip knobs were dropped


class FakeWorkerGroup:
    def __init__(self) -> None:
        self.loss_fns: list[Any] = []

    def set_loss_fn(self, loss_fn: Any) -> None:
        self.loss_fns.append(loss_fn)


@pytest.mark.parametrize("erc", [False, True])
def test_trainer_installs_the_actor_loss_once_after_verl_init(monkeypatch, erc):
    from verl.trainer.ppo.v1 import PPOTrainerSync

    from recipe.trainer import DivClipPPOTrainerSync
    from verl_ext.actor_loss import divclip_actor_loss
    from verl_ext.engine.request import request_of

    overrides = ["actor_rollout_ref.actor.calculate_entropy=true", *ERC] if erc else []
    trainer = object.__new__(DivClipPPOTrainerSync)  # no Ray, no GPUs: only what on_init_end touches
    trainer.config = compose_config(*overrides)
    trainer.actor_rollout_wg = FakeWorkerGroup()
    calls: list[str] = []
    monkeypatch.setattr(
        PPOTrainerSync, "on_init_end", lambda self: calls.append(f"verl:{len(self.actor_rollout_wg.loss_fns)}")
    )
    trainer.on_init_end()
    assert calls == ["verl:0"]  # verl's hook (weight sync) ran first, before the loss was installed
    (loss,) = trainer.actor_rollout_wg.loss_fns
    assert isinstance(loss, functools.partial) and loss.func is divclip_actor_loss
    assert loss.keywords["config"].policy_loss.loss_mode == "kl3"
    assert request_of(loss).entropy_as_mask is erc
    import pickle

    assert pickle.loads(pickle.dumps(loss)).func is divclip_actor_loss  # survives Ray's transport


def test_lora_rank_is_checked_without_vllm():
    """verl's check of a vLLM LoRA rank imports vLLM; without it we use verl's fallback list."""
    import importlib.util
    import sys

    from recipe.config_checks import _VLLM_UTILS, lora_rank_check_without_vllm
    from recipe.main import validate

    assert importlib.util.find_spec("vllm") is None  # the CPU machines this suite runs on
    config = compose_config("actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.rollout.name=vllm")
    validate(config)  # the entry point's validation, ours then verl's: accepted
    assert config.actor_rollout_ref.model.lora_rank == 32
    config = compose_config("actor_rollout_ref.model.lora_rank=1024", "actor_rollout_ref.rollout.name=vllm")
    with pytest.raises(ValueError, match="lora_rank must be <= 512 for vLLM, got 1024"):
        validate(config)
    with lora_rank_check_without_vllm():
        assert sys.modules[_VLLM_UTILS].get_vllm_max_lora_rank(20) == 32
    assert _VLLM_UTILS not in sys.modules  # the stand-in is gone afterwards


def test_the_lora_rank_stand_in_follows_verls_fallback_list() -> None:
    """The stand-in's ranks: the smallest of verl's fallback list at or above the rank; 0, negative or above the
    list's last refused, naming the key."""
    from recipe.config_checks import VERL_FALLBACK_LORA_RANKS, _max_lora_rank_without_vllm

    assert [_max_lora_rank_without_vllm(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    assert VERL_FALLBACK_LORA_RANKS[-1] == 512
    for rank in (0, -4):
        with pytest.raises(ValueError) as refused:
            _max_lora_rank_without_vllm(rank)
        assert str(refused.value) == f"actor_rollout_ref.model.lora_rank must be > 0, got {rank}"
    with pytest.raises(ValueError) as refused:
        _max_lora_rank_without_vllm(513)
    assert str(refused.value) == "actor_rollout_ref.model.lora_rank must be <= 512 for vLLM, got 513"


def test_the_lora_rank_stand_in_is_used_only_where_vllm_is_missing(monkeypatch) -> None:
    """With vLLM installed, or verl's module already imported, nothing is stood in for (and what was imported stays);
    a stand-in the checked code removed itself is no error on the way out."""
    import importlib.util
    import sys
    import types

    from recipe.config_checks import _VLLM_UTILS, lora_rank_check_without_vllm

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a)
    )
    with lora_rank_check_without_vllm():
        assert _VLLM_UTILS not in sys.modules  # vLLM "installed": verl imports its own module
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    loaded = types.ModuleType(_VLLM_UTILS)
    monkeypatch.setitem(sys.modules, _VLLM_UTILS, loaded)
    with lora_rank_check_without_vllm():
        assert sys.modules[_VLLM_UTILS] is loaded
    assert sys.modules[_VLLM_UTILS] is loaded  # kept on the way out
    monkeypatch.delitem(sys.modules, _VLLM_UTILS)
    with lora_rank_check_without_vllm():
        sys.modules.pop(_VLLM_UTILS)
    assert _VLLM_UTILS not in sys.modules


def test_the_ulysses_size_is_the_fsdp_actors_key_or_its_engines_and_1_without_an_fsdp_engine() -> None:
    from verl_ext.config_rules.composed import _ulysses_size

    def size(*overrides: str) -> int:
        return _ulysses_size(compose_config(*overrides).actor_rollout_ref.actor)

    assert size() == 1
    assert size("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2") == 2
    assert size("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4") == 4
    assert size("model_engine=megatron", PACK_OFF) == 1  # Megatron's actor has neither key


def test_a_local_models_dropout_is_read_from_its_folder_only(tmp_path, monkeypatch) -> None:
    """No model path reads no config.json, not even one in the working directory."""
    import json

    from verl_ext.config_rules.composed import _local_dropout

    (tmp_path / "config.json").write_text(json.dumps({"attention_dropout": 0.1}))
    monkeypatch.chdir(tmp_path)
    assert _local_dropout(str(tmp_path)) == "attention_dropout=0.1"  # the control: the folder itself is read
    assert _local_dropout("") is None and _local_dropout(None) is None


@pytest.mark.parametrize(
    "fused, expected",
    [
        (False, "entropy by divclip entropy_fp32 in both passes"),
        (True, "verl's fused kernel (bf16) for log-probs and entropy in both passes"),
    ],
)
def test_trainer_logs_which_entropy_path_is_asked_for(monkeypatch, caplog, fused, expected):
    """The driver's line says what the engine is asked for (the workers' actor/divclip/path/* say what ran)."""
    import logging

    from verl.trainer.ppo.v1 import PPOTrainerSync

    from recipe.trainer import DivClipPPOTrainerSync

    trainer = object.__new__(DivClipPPOTrainerSync)
    trainer.config = compose_config(
        "actor_rollout_ref.actor.calculate_entropy=true", *ERC, f"actor_rollout_ref.model.use_fused_kernels={fused}"
    )
    trainer.actor_rollout_wg = FakeWorkerGroup()
    monkeypatch.setattr(PPOTrainerSync, "on_init_end", lambda self: None)
    with caplog.at_level(logging.INFO, logger="recipe.trainer"):
        trainer.on_init_end()
    assert expected in caplog.text and "old-log-prob pass packed as the update" in caplog.text


# ------------------------------------------------------------------------------------------------
# verl features the divclip path would drop, and the trainer modes: refused before Ray, naming the key
# ------------------------------------------------------------------------------------------------

SEPARATE = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo",
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.n_gpus_per_node=1",
]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["distillation.enabled=true"],
            "distillation.enabled=true: verl's actor would train with distillation_ppo_loss, which verl-divclip "
            "replaces with its own actor loss (every mode, through set_loss_fn), dropping the distillation term. "
            "Distillation is not supported by recipe.main: run verl's main_ppo for it, or set "
            "distillation.enabled=false",
        ),
        (
            ["trainer.use_v1=false"],
            "trainer.use_v1=false selects verl's legacy trainer, which recipe.main does not run (its hooks are the v1"
            " trainer's, in every trainer.v1.trainer_mode): set trainer.use_v1=true",
        ),
        (
            ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
            "actor_rollout_ref.actor.calculate_sum_pi_squared=true has no effect in verl 0.9.1's v1 trainer (it never"
            " asks the engine for the sum of squared probabilities; only the legacy trainer's optimal-token baseline "
            "reads it): set it false",
        ),
        (
            ["trainer.v1.trainer_mode=fully_async"],
            "trainer.v1.trainer_mode='fully_async': Unknown trainer 'fully_async'. Available trainers: "
            "colocate_async, separate_async, sync.",
        ),
        (
            ["trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.rollout.calculate_log_probs=false"],
            "trainer.v1.trainer_mode=colocate_async trains on samples of older policies: "
            "actor_rollout_ref.rollout.calculate_log_probs=true is needed for the behaviour policy's log-probs (the "
            "staleness figures actor/divclip/staleness/* and verl's algorithm.rollout_correction read them)",
        ),
        (
            [*SEPARATE, "data.train_batch_size=12"],
            "trainer.v1.trainer_mode=separate_async trains one mini-batch per weight sync step: "
            "data.train_batch_size=12 must equal trainer.v1.separate_async.parameter_sync_step=4 x "
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.rollout.nnodes=0"],
            "trainer.v1.trainer_mode=separate_async generates on a standalone rollout pool: "
            "actor_rollout_ref.rollout.nnodes must be > 0 (got 0)",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.rollout.n_gpus_per_node=null"],
            "trainer.v1.trainer_mode=separate_async generates on a standalone rollout pool: "
            "actor_rollout_ref.rollout.n_gpus_per_node must be > 0 (got None)",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"],
            "trainer.v1.trainer_mode=separate_async moves weights to the standalone rollout pool with a checkpoint "
            "engine: actor_rollout_ref.rollout.checkpoint_engine.backend=naive only serves colocated rollouts (nccl, "
            "nixl, ... on GPUs; cpu_gloo on the cpu platform)",
        ),
        (
            [*SEPARATE, "trainer.device=cpu", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
            "trainer.v1.trainer_mode=separate_async on the cpu platform (trainer.device=cpu) moves weights with the "
            "cpu_gloo checkpoint engine: actor_rollout_ref.rollout.checkpoint_engine.backend=nccl needs GPUs",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.hybrid_engine=false"],
            "trainer.v1.trainer_mode=separate_async with actor_rollout_ref.hybrid_engine=false fails inside verl "
            "0.9.1's PPOTrainerSeparateAsync._setup (a logger call with flush=True): leave "
            "actor_rollout_ref.hybrid_engine=true",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
            "trainer.v1.trainer_mode=separate_async trains 4 samples per update (data.train_batch_size / "
            "parameter_sync_step x rollout.n) over 1 data-parallel actor ranks; "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3 must divide each rank's 4",
        ),
        (
            [*SEPARATE, "reward.reward_model.enable=true"],
            "trainer.v1.trainer_mode=separate_async never pauses the standalone rollout to free memory for a "
            "colocated reward model: with reward.reward_model.enable=true set "
            "reward.reward_model.enable_resource_pool=true",
        ),
        (
            [
                *SEPARATE,
                "trainer.v1.separate_async.hybrid_rollout.enable_switch=true",
                "actor_rollout_ref.rollout.disaggregation.enabled=true",
            ],
            "trainer.v1.trainer_mode=separate_async: trainer.v1.separate_async.hybrid_rollout.enable_switch=true does"
            " not support actor_rollout_ref.rollout.disaggregation.enabled=true (verl moves paused replicas' queued "
            "requests)",
        ),
        (
            [*SEPARATE, "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
            "trainer.v1.trainer_mode=separate_async trains 4 samples per update (data.train_batch_size / "
            "parameter_sync_step x rollout.n) over 2 data-parallel actor ranks; "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 must divide each rank's 2",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=true"],
            "algorithm.rollout_correction.bypass_mode=true skips the old-log-prob pass (pi_old is the rollout's mu), "
            "so actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=true has no pass to pack as the "
            "update: set it false (a key of "
            "actor_rollout_ref.actor.policy_loss._target_=verl_ext.config.DivClipPolicyLossConfig)",
        ),
        (
            [  # verl's own config class has no pack_old_log_prob_as_update: the divclip actor loss packs the pass
                PLAIN_TARGET,
                "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
                "algorithm.rollout_correction.bypass_mode=true",
            ],
            "algorithm.rollout_correction.bypass_mode=true skips the old-log-prob pass (pi_old is the rollout's mu), "
            "so actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=true has no pass to pack as the "
            "update: set it false (a key of "
            "actor_rollout_ref.actor.policy_loss._target_=verl_ext.config.DivClipPolicyLossConfig)",
        ),
    ],
)
def test_verl_features_the_path_would_drop_are_refused_naming_the_key(overrides: list[str], message: str) -> None:
    """Each refusal, its message word for word (what the user reads)."""
    with pytest.raises(ConfigError) as refused:
        validate_divclip_config(compose_config(*overrides))
    assert str(refused.value) == message


VERL_TRAINERS = {
    "sync": "PPOTrainerSync",
    "colocate_async": "PPOTrainerColocateAsync",
    "separate_async": "PPOTrainerSeparateAsync",
}


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_every_trainer_mode_validates_and_selects_verls_class_with_the_divclip_features(mode: str) -> None:
    """For verl's own mode name, a subclass of verl's class for the mode with the divclip piece first in its MRO
    (its hooks wrap verl's through super()); the TaskRunner puts it in verl's registry
    (test_the_task_runner_registers_the_divclip_trainers_before_verls_run)."""
    import verl.trainer.ppo.v1 as v1

    from recipe.trainer import DIVCLIP_TRAINERS, DivClipTrainer

    overrides = SEPARATE if mode == "separate_async" else [f"trainer.v1.trainer_mode={mode}"]
    validate_divclip_config(compose_config(*overrides))
    cls = DIVCLIP_TRAINERS[mode]
    assert cls.__bases__ == (DivClipTrainer, getattr(v1, VERL_TRAINERS[mode])) and cls.__mro__[1] is DivClipTrainer
    assert getattr(sys.modules["recipe.trainer"], cls.__name__) is cls


def test_the_task_runner_registers_the_divclip_trainers_before_verls_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """recipe.main hands verl's run_ppo a Ray actor class of verl's TaskRunnerV1 whose run() puts the divclip
    classes in verl's registry, in its own process, before verl's run() builds the trainer; importing
    recipe.trainer leaves verl's registry as it is (the process probe of test_smoke_cpu.py checks every process of a
    run)."""
    import verl.trainer.ppo.v1 as v1
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from recipe.trainer import DIVCLIP_TRAINERS, DivClipTaskRunner, DivClipTaskRunnerV1

    verl_runner = TaskRunnerV1.__ray_metadata__.modified_class.__ray_actor_class__
    assert DivClipTaskRunner.__bases__ == (verl_runner,)
    assert DivClipTaskRunnerV1.__ray_metadata__.modified_class.__ray_actor_class__ is DivClipTaskRunner
    for mode, name in VERL_TRAINERS.items():  # verl's, as a process that imported recipe.trainer has them
        monkeypatch.setitem(TRAINER_REGISTRY, mode, getattr(v1, name))
    built: dict[str, Any] = {}
    monkeypatch.setattr(
        verl_runner, "run", lambda self, config: built.update({m: get_trainer_cls(m) for m in VERL_TRAINERS})
    )
    DivClipTaskRunner().run(compose_config())
    assert built == DIVCLIP_TRAINERS


def test_the_registry_patch_replaces_only_verls_own_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one patch of verl's trainer registry: idempotent, and refused, naming the mode, where the entry is not
    verl's class that the divclip class is built on (another plugin's, or a verl whose class moved)."""
    from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSync
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from recipe.trainer import DIVCLIP_TRAINERS, register_divclip_trainers

    monkeypatch.setitem(TRAINER_REGISTRY, "sync", PPOTrainerSync)  # verl's, as a plain verl process has it
    register_divclip_trainers()
    register_divclip_trainers()
    assert {mode: TRAINER_REGISTRY[mode] for mode in DIVCLIP_TRAINERS} == DIVCLIP_TRAINERS
    monkeypatch.setitem(TRAINER_REGISTRY, "sync", PPOTrainerColocateAsync)
    with pytest.raises(
        RuntimeError,
        match=r"trainer\.v1\.trainer_mode='sync': verl's trainer registry holds .*"
        r"PPOTrainerColocateAsync.*not verl's .*PPOTrainerSync",
    ):
        register_divclip_trainers()
    monkeypatch.delitem(TRAINER_REGISTRY, "sync")
    with pytest.raises(RuntimeError, match=r"trainer_mode='sync': verl's trainer registry holds None"):
        register_divclip_trainers()


def test_separate_async_refuses_the_rollout_switch_only_with_disaggregation_and_the_hybrid_engine() -> None:
    """The refusal above needs all three; each alone is accepted."""
    for alone in (
        "actor_rollout_ref.rollout.disaggregation.enabled=true",
        "trainer.v1.separate_async.hybrid_rollout.enable_switch=true",
    ):
        validate_divclip_config(compose_config(*SEPARATE, alone))


def test_separate_async_takes_cpu_gloo_on_the_cpu_platform_and_nccl_off_it() -> None:
    """The weight-transfer refusals above leave the two backends that serve each platform."""
    backend = "actor_rollout_ref.rollout.checkpoint_engine.backend"
    for device, name in (("cpu", "cpu_gloo"), ("cuda", "nccl")):
        validate_divclip_config(compose_config(*SEPARATE, f"trainer.device={device}", f"{backend}={name}"))


def test_separate_async_takes_a_reward_model_in_its_own_pool() -> None:
    """The reward-model refusal above is lifted by the model's own resource pool."""
    validate_divclip_config(
        compose_config(*SEPARATE, "reward.reward_model.enable=true", "reward.reward_model.enable_resource_pool=true")
    )


def test_separate_async_divides_an_update_among_data_parallel_ranks_not_ulysses_ranks() -> None:
    """Two ranks in one Ulysses group are one data-parallel rank: its 4 samples fit micro-batches of 4 (refused
    above without sequence parallelism, where each of the two ranks holds 2)."""
    validate_divclip_config(
        compose_config(
            *SEPARATE,
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        )
    )


def test_bypass_mode_runs_non_entropy_modes_with_verls_packing() -> None:
    """bypass_mode (pi_old := mu): the KL-budget modes run (a trust region around the behaviour policy) once the
    pack_old_log_prob_as_update, which has no old pass to pack, is off; ERC and kl_full stay refused (tested above)."""
    actor = validate_divclip_config(compose_config("algorithm.rollout_correction.bypass_mode=true", PACK_OFF))
    assert actor.policy_loss.loss_mode == "kl3"


def test_model_engine_resolves_its_own_strategy_and_is_refused_with_the_seams_features() -> None:
    """verl's model_engine switch selects the engine's own actor config; the recipe's FSDP2 default applies to
    verl's ``dp`` engine only, so model_engine=megatron resolves strategy=megatron and meets the strategy check."""
    assert compose_config().actor_rollout_ref.actor.strategy == "fsdp2"
    with pytest.raises(
        ConfigError, match=r"actor_rollout_ref\.actor\.strategy='megatron'.*pack_old_log_prob_as_update"
    ):
        validate_divclip_config(compose_config("model_engine=megatron"))
    config = compose_config("model_engine=megatron", PACK_OFF)
    assert config.actor_rollout_ref.actor.strategy == "megatron" and config.actor_rollout_ref.ref.strategy == "megatron"
