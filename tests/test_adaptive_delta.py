"""The adaptive trust-region threshold (ATR-GRPO Sec. 6.5): the rule, its state file, its config
checks, and the trainer hooks that drive it (verl's side stubbed here; the real trainer on 2 ranks
with a crash and a resume, across two Ray nodes, is tests/test_two_nodes_ray.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from recipe.config_checks import ConfigError, validate_divclip_config
from tests.test_losses import actor_config, random_batch, run_registry_loss
from tests.test_recipe_main import SEPARATE, compose_config
from verl_ext.adaptive_delta import SEQUENCE_METRIC, STATE_FILE, TOKEN_METRIC, AdaptiveDelta
from verl_ext.config import DivClipPolicyLossConfig

P = "actor_rollout_ref.actor.policy_loss"


def controller(**overrides: Any) -> AdaptiveDelta:
    knobs = dict(loss_mode="kl3", delta=0.07, adaptive_delta_target=0.01)
    knobs.update(overrides)
    ctl = AdaptiveDelta.from_policy(DivClipPolicyLossConfig(**knobs))
    assert ctl is not None
    return ctl


def test_static_delta_is_the_default():
    assert DivClipPolicyLossConfig(loss_mode="kl3").adaptive_delta_enabled is False
    assert AdaptiveDelta.from_policy(DivClipPolicyLossConfig(loss_mode="kl3")) is None


@pytest.mark.parametrize(
    "measured, expected",
    [
        (0.0151, 0.07 / 1.5),  # above target * tolerance: shrink
        (0.0150, 0.07),  # on the band's edge: hold
        (0.01, 0.07),  # on target: hold
        (0.01 / 1.5, 0.07),
        (0.0066, 0.07 * 1.5),  # below target / tolerance: widen
        (0.0, 0.07 * 1.5),
    ],
)
def test_multiplicative_rule_with_dead_band(measured, expected):
    ctl = controller()
    assert ctl.update({TOKEN_METRIC: measured}) is (expected != 0.07)
    assert ctl.delta == pytest.approx(expected, rel=1e-15)
    assert ctl.updates == 1


def test_delta_stays_within_its_bounds():
    ctl = controller(adaptive_delta_min=0.05, adaptive_delta_max=0.1)
    for _ in range(5):
        ctl.update({TOKEN_METRIC: 1.0})
    assert ctl.delta == 0.05
    assert ctl.update({TOKEN_METRIC: 1.0}) is False  # at the floor: no re-install needed
    for _ in range(5):
        ctl.update({TOKEN_METRIC: 0.0})
    assert ctl.delta == 0.1


def test_tracks_the_sequence_kl3_for_seq_kl3():
    assert controller().metric == TOKEN_METRIC
    ctl = controller(loss_mode="seq_kl3")
    assert ctl.metric == SEQUENCE_METRIC
    with pytest.raises(KeyError, match="seq_kl3_mean"):
        ctl.update({TOKEN_METRIC: 0.1})
    with pytest.raises(ValueError, match="finite"):
        ctl.update({SEQUENCE_METRIC: float("nan")})


def test_state_round_trip_next_to_the_checkpoint(tmp_path):
    ctl = controller()
    ctl.update({TOKEN_METRIC: 1.0})
    folder = tmp_path / "global_step_7"
    path = ctl.save(str(folder))
    assert json.loads(open(path).read())["delta"] == ctl.delta
    assert not list(folder.glob("*.tmp-*"))  # written atomically
    fresh = controller()
    assert fresh.restore(str(folder)) is True
    assert (fresh.delta, fresh.updates) == (ctl.delta, 1)
    assert controller().restore(str(tmp_path / "global_step_3")) is False  # no state there
    narrowed = controller(adaptive_delta_max=0.08, adaptive_delta_min=0.05)
    narrowed.restore(str(folder))
    assert narrowed.delta == 0.05  # clamped into this run's bounds


def test_restoring_another_controllers_state_fails(tmp_path):
    controller(loss_mode="seq_kl3").save(str(tmp_path))
    with pytest.raises(ValueError, match="seq_kl3_mean"):
        controller().restore(str(tmp_path))
    (tmp_path / STATE_FILE).write_text(json.dumps({"delta": -1}))
    with pytest.raises(ValueError, match=STATE_FILE):
        controller().restore(str(tmp_path))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"adaptive_delta_target": 0.0}, "adaptive_delta_target"),
        ({"adaptive_delta_target": float("inf")}, "adaptive_delta_target"),
        ({"adaptive_delta_target": 0.01, "adaptive_delta_rate": 1.0}, "adaptive_delta_rate"),
        ({"adaptive_delta_target": 0.01, "adaptive_delta_tolerance": 0.9}, "adaptive_delta_tolerance"),
        ({"adaptive_delta_target": 0.01, "adaptive_delta_min": 0.2, "adaptive_delta_max": 0.1}, "adaptive_delta_min"),
        ({"adaptive_delta_target": 0.01, "adaptive_delta_min": -1.0}, "adaptive_delta_min"),
        ({"adaptive_delta_target": 0.01, "delta": 0.9}, "delta"),
        ({"adaptive_delta_target": 0.01, "loss_mode": "clip"}, "adaptive_delta_target"),
        ({"adaptive_delta_target": 0.01, "loss_mode": "dcpo"}, "adaptive_delta_target"),
        ({"adaptive_delta_target": 0.01, "loss_mode": "sapo"}, "adaptive_delta_target"),
    ],
)
def test_invalid_adaptive_knobs_raise_naming_the_key(kwargs, key):
    kwargs = {"loss_mode": "kl3", **kwargs}
    with pytest.raises(ValueError, match=rf"policy_loss\.{key}"):
        DivClipPolicyLossConfig(**kwargs)


@pytest.mark.parametrize("mode", ["kl3", "kl1", "kl2", "is_kl3", "trgppo", "seq_kl3"])
def test_every_kl_budget_mode_accepts_the_controller_and_logs_delta(mode):
    DivClipPolicyLossConfig(loss_mode=mode, adaptive_delta_target=0.01)
    old, new, adv, mask = random_batch(0)
    _, _, metrics = run_registry_loss(mode, old, new, adv, mask, actor_config(mode, delta=0.03))
    assert metrics["actor/divclip/delta"] == 0.03


def test_verls_own_trainer_path_refuses_the_adaptive_knob():
    old, new, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match=r"recipe\.main"):
        run_registry_loss("kl3", old, new, adv, mask, actor_config("kl3", adaptive_delta_target=0.01))


def on_policy_refusal(mini_batch: int, prompts: int) -> str:
    """The refusal of an adaptive delta whose every update is on-policy, word for word."""
    actor = "actor_rollout_ref.actor"
    return (
        f"{P}.adaptive_delta_target: with one PPO mini-batch per step ({actor}.ppo_mini_batch_size={mini_batch} >= "
        f"data.train_batch_size={prompts}) and {actor}.ppo_epochs=1 every update is on-policy, its measured KL3 is 0 "
        "and the controller could only widen delta: use a smaller ppo_mini_batch_size or more ppo_epochs, or a "
        "static delta"
    )


def test_on_policy_updates_are_rejected_before_ray():
    on = [f"{P}.adaptive_delta_target=0.01", "data.train_batch_size=16"]
    with pytest.raises(ConfigError) as refused:
        validate_divclip_config(compose_config(*on, "actor_rollout_ref.actor.ppo_mini_batch_size=16"))
    assert str(refused.value) == on_policy_refusal(16, 16)
    validate_divclip_config(compose_config(*on, "actor_rollout_ref.actor.ppo_mini_batch_size=8"))
    validate_divclip_config(
        compose_config(*on, "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_epochs=2")
    )


ADAPTIVE_SEPARATE = [*SEPARATE, f"{P}.adaptive_delta_target=0.01"]  # 16 prompts a step, mini-batches of 4


def test_separate_async_reads_one_update_a_step_or_is_rejected_before_ray():
    """The controller reads one update a step, its KL3 against the pi_old it started from. separate_async's
    Decoupled PPO trains parameter_sync_step updates a step against the cycle's first weights, so only with
    parameter_sync_step=1 does that hold -- and then, as in sync, one on-policy mini-batch has nothing to read."""
    for sync_step in (4, 2):
        with pytest.raises(ConfigError) as refused:
            validate_divclip_config(
                compose_config(
                    *ADAPTIVE_SEPARATE,
                    f"trainer.v1.separate_async.parameter_sync_step={sync_step}",
                    f"data.train_batch_size={4 * sync_step}",
                )
            )
        assert str(refused.value) == (
            f"{P}.adaptive_delta_target: trainer.v1.trainer_mode=separate_async with "
            f"trainer.v1.separate_async.parameter_sync_step={sync_step} trains {sync_step} updates per step against "
            "the cycle's first weights as pi_old, so no update but the first measures its own KL3 from the pi_old it "
            "started at: use parameter_sync_step=1 (one update a step) or a static delta"
        )
    one = [
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.v1.separate_async.parameter_sync_step=1",
    ]
    with pytest.raises(ConfigError) as refused:
        validate_divclip_config(compose_config(*ADAPTIVE_SEPARATE, *one))
    assert str(refused.value) == on_policy_refusal(4, 4)
    validate_divclip_config(compose_config(*ADAPTIVE_SEPARATE, *one, "actor_rollout_ref.actor.ppo_epochs=2"))


class FakeWorkerGroup:
    def __init__(self) -> None:
        self.loss_fns: list[Any] = []

    def set_loss_fn(self, loss_fn: Any) -> None:
        self.loss_fns.append(loss_fn)


class FakeBatch:
    def __init__(self) -> None:
        self.extra_info: dict[str, Any] = {}


def test_trainer_reinstalls_the_loss_when_delta_moves_and_persists_it(monkeypatch, tmp_path):
    """The hooks' wiring; verl's own methods are stubbed (the real ones run in the CPU smoke)."""
    from verl.trainer.ppo.v1 import PPOTrainerSync

    from recipe.trainer import DivClipPPOTrainerSync

    measured = {"kl3": 1.0}

    def verl_update_actor(self, batch, metrics):
        metrics[TOKEN_METRIC] = measured["kl3"]
        return batch

    def verl_load_checkpoint(self):
        self.global_steps = 4 if (tmp_path / "global_step_4").exists() else 0

    saved: list[int] = []
    monkeypatch.setattr(PPOTrainerSync, "on_init_end", lambda self: None)
    monkeypatch.setattr(PPOTrainerSync, "_update_actor", verl_update_actor)
    monkeypatch.setattr(PPOTrainerSync, "_load_checkpoint", verl_load_checkpoint)
    monkeypatch.setattr(PPOTrainerSync, "_save_checkpoint", lambda self: saved.append(self.global_steps))

    def fresh_trainer() -> Any:
        trainer = object.__new__(DivClipPPOTrainerSync)
        trainer.config = compose_config(f"{P}.adaptive_delta_target=0.01", f"trainer.default_local_dir={tmp_path}")
        trainer.actor_rollout_wg = FakeWorkerGroup()
        trainer.local_trigger_step = 0  # what verl's __init__ sets
        trainer._load_checkpoint()
        trainer.on_init_end()
        return trainer

    trainer = fresh_trainer()
    deltas = lambda t: [f.keywords["config"].policy_loss.delta for f in t.actor_rollout_wg.loss_fns]  # noqa: E731
    assert deltas(trainer) == [0.07]
    metrics: dict = {}
    trainer._update_actor(FakeBatch(), metrics)
    assert metrics["actor/divclip/delta_next"] == pytest.approx(0.07 / 1.5)
    assert deltas(trainer) == [0.07, pytest.approx(0.07 / 1.5)]
    measured["kl3"] = 0.01  # inside the band: no change, no re-install
    trainer._update_actor(FakeBatch(), {})
    assert len(deltas(trainer)) == 2
    trainer.global_steps = 4
    trainer._save_checkpoint()
    assert saved == [4] and (tmp_path / "global_step_4" / STATE_FILE).exists()
    resumed = fresh_trainer()
    assert deltas(resumed) == [pytest.approx(0.07 / 1.5)]  # the first install already uses the restored delta
