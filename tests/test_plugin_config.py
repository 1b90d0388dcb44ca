"""Registration through the verl.plugins entry point and config composition via _target_."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException
from verl.utils.config import omega_conf_to_dataclass

import verl_ext.registry  # noqa: F401  (registers the loss modes' construction-time check)
from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.core.region import CONSTRAINTS

TARGET = "actor_rollout_ref.actor.policy_loss._target_=verl_ext.config.DivClipPolicyLossConfig"


def test_plain_import_verl_registers_modes_in_a_fresh_process():
    """A Ray worker only runs `import verl`; the entry point must register every mode."""
    code = (
        "import verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "import sys\n"
        "print(','.join(sorted(POLICY_LOSS_REGISTRY)))\n"
        "assert 'verl_ext.registry' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert set(CONSTRAINTS) <= set(out.strip().split(","))


def test_require_registered_is_loud_when_plugins_are_disabled():
    code = (
        "import verl\n"
        "from verl_ext.plugin import require_registered\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "for name in ('kl3', 'clip'): POLICY_LOSS_REGISTRY.pop(name)\n"
        "require_registered()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "not registered with verl" in proc.stderr and "['clip', 'kl3']" in proc.stderr


def compose_actor(*overrides: str):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=list(overrides))
    return cfg


def test_config_composes_with_target_into_the_actor_dataclass():
    cfg = compose_actor(
        TARGET,
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl3",
        "+actor_rollout_ref.actor.policy_loss.delta=0.05",
        "+actor_rollout_ref.actor.policy_loss.erc_beta_low=0.05",
        "+actor_rollout_ref.actor.policy_loss.erc_beta_high=0.05",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, DivClipPolicyLossConfig)
    assert actor.policy_loss.loss_mode == "kl3" and actor.policy_loss.delta == 0.05
    assert actor.policy_loss.erc_enabled


def test_misspelt_key_fails_naming_it():
    cfg = compose_actor(
        TARGET,
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl3",
        "+actor_rollout_ref.actor.policy_loss.detla=0.05",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    )
    with pytest.raises(InstantiationException, match="detla"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_invalid_value_fails_at_construction_naming_it():
    cfg = compose_actor(
        TARGET,
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl3",
        "+actor_rollout_ref.actor.policy_loss.delta=-0.1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    )
    with pytest.raises(InstantiationException, match=r"policy_loss\.delta must be"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_a_registered_mode_check_runs_once_at_every_construction():
    """``register_mode_check`` is how the loss-mode registry's check reaches ``__post_init__`` (the config module
    imports no other verl_ext module): a check registered twice is kept once and runs on each config built."""
    from verl_ext import config

    seen: list[str] = []

    def check(policy: DivClipPolicyLossConfig) -> None:
        seen.append(policy.loss_mode)

    try:
        assert config.register_mode_check(check) is check
        config.register_mode_check(check)
        DivClipPolicyLossConfig(loss_mode="kl3")
        assert seen == ["kl3"]
    finally:
        config._MODE_CHECKS.remove(check)
    assert check not in config._MODE_CHECKS


def test_adaptive_delta_on_a_mode_without_a_kl_budget_names_the_budget_modes():
    with pytest.raises(ValueError) as error:
        DivClipPolicyLossConfig(loss_mode="clip", adaptive_delta_target=0.01)
    assert str(error.value) == (
        "actor_rollout_ref.actor.policy_loss.adaptive_delta_target adapts the KL budget delta, which "
        "loss_mode='clip' does not have; the KL-budget modes are "
        "['is_kl3', 'kl1', 'kl2', 'kl3', 'kl_full', 'seq_kl3', 'trgppo']"
    )


P = "actor_rollout_ref.actor.policy_loss"
INF, NAN = float("inf"), float("nan")
#: each refusal of ``DivClipPolicyLossConfig.__post_init__`` at the first value past its bound (and the non-numbers
#: it refuses), with its message word for word, under ``loss_mode="kl3"`` unless the row names another; the id names
#: the knob and the value
REFUSED_AT_CONSTRUCTION: list[tuple[dict, str]] = [
    ({"delta": 0}, f"{P}.delta must be a finite number > 0, got 0"),
    ({"delta": INF}, f"{P}.delta must be a finite number > 0, got inf"),
    ({"delta": True}, f"{P}.delta must be a finite number > 0, got True"),
    (
        {"adaptive_delta_target": 0},
        f"{P}.adaptive_delta_target must be a finite number > 0 (or null for a static delta), got 0",
    ),
    (
        {"adaptive_delta_target": NAN},
        f"{P}.adaptive_delta_target must be a finite number > 0 (or null for a static delta), got nan",
    ),
    ({"adaptive_delta_tolerance": 0.99}, f"{P}.adaptive_delta_tolerance must be a finite number >= 1, got 0.99"),
    ({"adaptive_delta_tolerance": INF}, f"{P}.adaptive_delta_tolerance must be a finite number >= 1, got inf"),
    ({"adaptive_delta_rate": 1}, f"{P}.adaptive_delta_rate must be a finite number > 1, got 1"),
    ({"adaptive_delta_rate": NAN}, f"{P}.adaptive_delta_rate must be a finite number > 1, got nan"),
    ({"adaptive_delta_min": 0}, f"{P}.adaptive_delta_min must be a finite number > 0, got 0"),
    ({"adaptive_delta_max": INF}, f"{P}.adaptive_delta_max must be a finite number > 0, got inf"),
    (
        {"adaptive_delta_min": 0.2, "adaptive_delta_max": 0.1},
        f"{P}.adaptive_delta_min (0.2) must not exceed adaptive_delta_max (0.1)",
    ),
    (
        {"adaptive_delta_target": 0.01, "delta": 0.6},
        f"{P}.delta=0.6 (the adaptive controller's initial delta) must lie within "
        "[adaptive_delta_min, adaptive_delta_max] = [0.005, 0.5]",
    ),
    (
        {"adaptive_delta_target": 0.01, "delta": 0.004},
        f"{P}.delta=0.004 (the adaptive controller's initial delta) must lie within "
        "[adaptive_delta_min, adaptive_delta_max] = [0.005, 0.5]",
    ),
    ({"dual_clip_c": 1}, f"{P}.dual_clip_c must be > 1 (or null to disable dual-clip), got 1"),
    ({"dual_clip_c": INF}, f"{P}.dual_clip_c must be > 1 (or null to disable dual-clip), got inf"),
    ({"gppo_beta_low": -0.1}, f"{P}.gppo_beta_low must be a finite number >= 0, got -0.1"),
    ({"gppo_beta_high": NAN}, f"{P}.gppo_beta_high must be a finite number >= 0, got nan"),
    ({"dcpo_cap": 1}, f"{P}.dcpo_cap must be > 1, got 1"),
    ({"dcpo_cap": INF}, f"{P}.dcpo_cap must be > 1, got inf"),
    ({"kl_full_top_k": 0}, f"{P}.kl_full_top_k must be an integer >= 1, got 0"),
    ({"kl_full_top_k": True}, f"{P}.kl_full_top_k must be an integer >= 1, got True"),
    ({"kl_full_top_k": 2.0}, f"{P}.kl_full_top_k must be an integer >= 1, got 2.0"),
    ({"kl_full_top_k": 2.5}, f"{P}.kl_full_top_k must be an integer >= 1, got 2.5"),
    ({"kl_full_top_k": -3}, f"{P}.kl_full_top_k must be an integer >= 1, got -3"),
    ({"kl_full_top_k": None}, f"{P}.kl_full_top_k must be an integer >= 1, got None"),
    ({"kl_full_direction": "both"}, f"{P}.kl_full_direction must be one of ('forward', 'reverse'), got 'both'"),
    ({"kl_full_diagnostic": 1}, f"{P}.kl_full_diagnostic must be true or false, got 1"),
    ({"kl_full_diagnostic": "yes"}, f"{P}.kl_full_diagnostic must be true or false, got 'yes'"),
    (
        {"loss_mode": "vanilla", "kl_full_diagnostic": True},
        f"{P}.kl_full_diagnostic compares a divclip mode's clip decisions with the full-KL rule; verl's "
        "loss_mode='vanilla' makes none through the divclip operator: set it to false",
    ),
    (
        {"erc_beta_low": 0.05},
        f"{P}.erc_beta_high is null while the other ERC band is set: set both erc_beta_low and erc_beta_high "
        "(ERC on) or neither (ERC off)",
    ),
    (
        {"erc_beta_high": 0.05},
        f"{P}.erc_beta_low is null while the other ERC band is set: set both erc_beta_low and erc_beta_high "
        "(ERC on) or neither (ERC off)",
    ),
    ({"erc_beta_low": 0, "erc_beta_high": 0.05}, f"{P}.erc_beta_low must lie in (0, 1), got 0"),
    ({"erc_beta_low": 1, "erc_beta_high": 0.05}, f"{P}.erc_beta_low must lie in (0, 1), got 1"),
    ({"erc_beta_low": NAN, "erc_beta_high": 0.05}, f"{P}.erc_beta_low must lie in (0, 1), got nan"),
    ({"erc_beta_low": 0.05, "erc_beta_high": 0}, f"{P}.erc_beta_high must be > 0, got 0"),
    ({"erc_beta_low": 0.05, "erc_beta_high": INF}, f"{P}.erc_beta_high must be > 0, got inf"),
    ({"erc_eps": 0}, f"{P}.erc_eps must be a finite number > 0, got 0"),
    ({"erc_eps": INF}, f"{P}.erc_eps must be a finite number > 0, got inf"),
    ({"correct_nll_coef": -0.1}, f"{P}.correct_nll_coef must be a finite number >= 0, got -0.1"),
    ({"correct_nll_coef": INF}, f"{P}.correct_nll_coef must be a finite number >= 0, got inf"),
    ({"correct_reward": NAN}, f"{P}.correct_reward must be a finite number, got nan"),
    ({"correct_nll_norm": "token"}, f"{P}.correct_nll_norm must be one of ('global', 'micro_batch'), got 'token'"),
    ({"token_dump_every_n_steps": 0}, f"{P}.token_dump_every_n_steps must be an integer >= 1, got 0"),
    ({"token_dump_max_tokens": True}, f"{P}.token_dump_max_tokens must be an integer >= 1, got True"),
    (
        {"token_dump_path": "dump"},
        f"{P}.token_dump_path dumps ERC's per-token entropy ratios: set erc_beta_low/erc_beta_high too",
    ),
    ({"vocab_pass": 1}, f"{P}.vocab_pass must be true or false, got 1"),
    ({"pack_old_log_prob_as_update": "yes"}, f"{P}.pack_old_log_prob_as_update must be true or false, got 'yes'"),
    ({"old_log_prob_from_update": 0}, f"{P}.old_log_prob_from_update must be true, false or null, got 0"),
]
#: each bound's own value (or the closest to it that the rule allows), accepted and kept as given
ACCEPTED_AT_CONSTRUCTION: list[dict] = [
    {"delta": 1e-9},
    {"delta": 1},
    {"adaptive_delta_tolerance": 1},
    {"adaptive_delta_rate": 1.000001},
    {"adaptive_delta_target": 1e-9, "adaptive_delta_min": 0.07, "adaptive_delta_max": 0.07},
    {"adaptive_delta_target": 0.01, "delta": 0.005},
    {"adaptive_delta_target": 0.01, "delta": 0.5},
    {"dual_clip_c": 1.000001},
    {"gppo_beta_low": 0, "gppo_beta_high": 0},
    {"dcpo_cap": 1.000001},
    {"kl_full_top_k": 1, "kl_full_direction": "reverse", "kl_full_diagnostic": True},
    {"erc_beta_low": 1e-9, "erc_beta_high": 1e-9, "token_dump_path": "dump"},
    {"erc_beta_low": 0.999999, "erc_beta_high": 5},
    {"erc_eps": 1e-30, "correct_nll_coef": 0, "correct_reward": -1, "correct_nll_norm": "micro_batch"},
    {"token_dump_every_n_steps": 1, "token_dump_max_tokens": 1},
    {"vocab_pass": True, "pack_old_log_prob_as_update": False, "old_log_prob_from_update": False},
    {"old_log_prob_from_update": True},
]


@pytest.mark.parametrize(
    "kwargs, message",
    REFUSED_AT_CONSTRUCTION,
    ids=[",".join(f"{key}={value}" for key, value in kwargs.items()) for kwargs, _ in REFUSED_AT_CONSTRUCTION],
)
def test_each_knob_is_refused_past_its_bound_word_for_word(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        DivClipPolicyLossConfig(**{"loss_mode": "kl3", **kwargs})
    assert str(error.value) == message


@pytest.mark.parametrize(
    "kwargs",
    ACCEPTED_AT_CONSTRUCTION,
    ids=[",".join(f"{k}={v}" for k, v in kw.items()) for kw in ACCEPTED_AT_CONSTRUCTION],
)
def test_each_knob_is_accepted_at_its_bound(kwargs: dict) -> None:
    config = DivClipPolicyLossConfig(loss_mode="kl3", **kwargs)
    assert {key: getattr(config, key) for key in kwargs} == kwargs
