"""The on-policy gauge's ``ratio_clipfrac`` applies the selected mode's own clip rule, in every mode.

The reference is each mode's own loss: its clip fraction (``actor/pg_clipfrac``, the divclip operator's or verl's
function's) counts the tokens outside the trust region on the side the advantage pushes towards, so the same
micro-batch run once with every advantage +1 and once with every advantage -1 counts the tokens outside on
either side; the gauge counts them whatever the advantage's sign. The micro-batch is the declaration test's
sweep (:mod:`tests.test_knobs`): ratios over about [e^-4, e^4], sequence ratios on both sides of every bound.
"""

from __future__ import annotations

import pytest

from tests.test_knobs import actor_config, run_installed_loss
from verl_ext.knobs import all_modes

GAUGE = "actor/divclip/onpolicy/ratio_clipfrac"
#: verl's cispo counts ``ratio != clip(ratio)`` whatever the advantage's sign (its pg_clipfrac is both sides already).
SIGN_FREE_CLIPFRAC = {"cispo"}
#: verl's clip_cov clips by vanilla's rule (its ``clip_by_origin``) and masks covariance-picked tokens besides; its
#: pg_clipfrac counts that mask, so vanilla's loss is the reference for its clip rule.
REFERENCE = {"clip_cov": "vanilla"}


@pytest.mark.parametrize("mode", all_modes())
def test_the_gauge_counts_what_the_modes_own_rule_clips(mode: str) -> None:
    knobs = {"kl_full_top_k": 8} if mode == "kl_full" else {}
    gauge = run_installed_loss(actor_config(mode, **knobs), on_policy=True).metrics[GAUGE]
    reference = actor_config(REFERENCE.get(mode, mode), **knobs)
    pushed = [
        run_installed_loss(reference, advantage=sign).metrics.get("actor/pg_clipfrac", 0.0) for sign in (1.0, -1.0)
    ]
    expected = pushed[0] if mode in SIGN_FREE_CLIPFRAC else sum(pushed)
    assert gauge == pytest.approx(expected, abs=1e-6), (mode, gauge, pushed)


def test_the_gauge_is_not_the_actors_clip_range_where_the_mode_has_its_own() -> None:
    """kl3's band at delta = 0.07 is not [0.8, 1.2]: the gauge follows the band (the control arm of the test above)."""
    kl3 = run_installed_loss(actor_config("kl3"), on_policy=True).metrics[GAUGE]
    clip = run_installed_loss(actor_config("clip"), on_policy=True).metrics[GAUGE]
    assert kl3 != pytest.approx(clip)


def test_a_verl_mode_without_a_declaration_is_gauged_by_the_actors_clip_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mode registered in verl's policy-loss registry after ours (a user's own; every verl 0.9.1 mode is declared)
    has no rule of its own to gauge: ``ratio_clipfrac`` counts the tokens outside the actor's clip interval,
    which is vanilla's declared rule -- so a copy of vanilla registered under another name gauges as vanilla does.
    Control: the sweep puts tokens outside that interval (the gauge is not 0)."""
    from verl.trainer.ppo import core_algos

    from verl_ext.verl_modes import VERL_MODE_READS

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "users_mode", core_algos.POLICY_LOSS_REGISTRY["vanilla"])
    assert "users_mode" not in VERL_MODE_READS
    users = run_installed_loss(actor_config("users_mode"), on_policy=True).metrics[GAUGE]
    vanilla = run_installed_loss(actor_config("vanilla"), on_policy=True).metrics[GAUGE]
    assert users == vanilla > 0
