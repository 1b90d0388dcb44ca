"""Registration through the verl.plugins entry point and config composition via _target_."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException
from verl.utils.config import omega_conf_to_dataclass

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
    import verl_ext.registry  # noqa: F401  (registers the loss-mode check)

    with pytest.raises(ValueError) as error:
        DivClipPolicyLossConfig(loss_mode="clip", adaptive_delta_target=0.01)
    assert str(error.value) == (
        "actor_rollout_ref.actor.policy_loss.adaptive_delta_target adapts the KL budget delta, which "
        "loss_mode='clip' does not have; the KL-budget modes are "
        "['is_kl3', 'kl1', 'kl2', 'kl3', 'kl_full', 'seq_kl3', 'trgppo']"
    )
