"""The seven single-line breaks of the loss path issue 41 found green, each failing a test named for it.

Each test compares the product with something else -- verl's own function, the paper's formula (the naive
reference of ``tests/loss_reference.py``) or an independent count -- never the same code on both sides:

* ERC on verl's own modes (:data:`verl_ext.registry.ERC_ON_VERL_MODE`) gates only the policy term's
  log-probs: with ``use_kl_loss`` and every token outside the band, the KL loss's gradient is verl's on every
  token (:func:`test_erc_on_verl_mode_keeps_the_kl_loss_gradient_on_every_token`);
* ``loss_scale_factor`` under ``seq-mean-token-sum-norm`` (the ATR scripts' 1536) scales ``kl3``'s loss as
  the formula says (:func:`test_loss_scale_factor_scales_kl3_under_seq_mean_token_sum_norm`);
* every KL-budget mode reads ``policy_loss.delta`` at a value other than the default
  (:func:`test_every_kl_mode_reads_a_non_default_delta`);
* an asymmetric ERC band reaches the loss, the on-policy gauge and the token dump with its sides in place
  (:func:`test_an_asymmetric_erc_band_reaches_the_loss_the_gauge_and_the_dump`);
* the loss inputs the actor loss supplies are gone after every call, raised or not
  (:func:`test_the_loss_inputs_are_reset_after_every_call_whatever_ran_before`);
* the actor keys the loss-parity cases set are honoured rows whose evidence exercises the key
  (:func:`test_every_actor_key_the_loss_cases_set_is_honoured_with_evidence_that_exercises_it`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import PolicyLossConfig
from verl.workers.utils import losses as verl_losses

from recipe.bench.harness import make_actor_config
from tests.loss_reference import RefKnobs, reference_loss, reference_surrogate_matrix
from tests.test_full_kl import naive_kl_full_loss, operator_batch, run_operator
from tests.test_losses import actor_config, boundary_batch, run_registry_loss
from tests.test_ppo_loss_parity import (
    CASES,
    CLIP_RATIOS,
    KL,
    PROMPT_LENS,
    RESPONSE_LENS,
    LossRun,
    ParityCase,
    _nested,
    make_micro_batch,
    model_output_values,
    run_loss,
)

REPO = Path(__file__).resolve().parents[1]


def response_positions() -> list[list[int]]:
    """Per response, the flat positions of the engine's output that hold its tokens' values (the output
    at position t predicts token t + 1, so a response sits one to the left of its tokens)."""
    positions, start = [], 0
    for prompt, response in zip(PROMPT_LENS, RESPONSE_LENS, strict=False):
        positions.append(list(range(start + prompt - 1, start + prompt - 1 + response)))
        start += prompt + response
    return positions


def valid_positions(data: Any) -> list[int]:
    """Flat positions of the valid (unmasked) response tokens."""
    return [
        p
        for rows, mask in zip(response_positions(), data["response_mask"].unbind(), strict=False)
        for p, m in zip(rows, mask.tolist(), strict=False)
        if m
    ]


def with_entropy_ratios(data: Any, values: dict[str, torch.Tensor], ratios: tuple[float, ...]) -> list[list[float]]:
    """pi_theta's entropy 1 everywhere and pi_old's ``1 / rho`` per response token, rho cycling through
    ``ratios`` along the response; returns the rho of each response token."""
    values["entropy"] = torch.ones_like(values["entropy"])
    rhos = [[ratios[t % len(ratios)] for t in range(n)] for n in RESPONSE_LENS]
    data["entropy"] = _nested([1.0 / torch.tensor(row) for row in rhos])
    return rhos


def divclip_config(mode: str, case: ParityCase, **policy: Any) -> Any:
    from verl_ext.config import DivClipPolicyLossConfig

    policy_loss = DivClipPolicyLossConfig(loss_mode=mode, **policy)
    return make_actor_config(policy_loss=policy_loss, **{**CLIP_RATIOS, **case.actor})


def run_erc_loss(loss_fn: Any, config: Any, data: Any, values: dict[str, torch.Tensor]) -> LossRun:
    """``run_loss`` with the engine's entropy as a plain (non-leaf) output: ERC without an entropy bonus
    uses it only as a mask, so only the log-probs get a gradient."""
    offsets = torch.tensor([0] + [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=False)]).cumsum(0)
    leaf = values["log_probs"].clone().requires_grad_(True)
    model_output = {
        "log_probs": torch.nested.nested_tensor_from_jagged(leaf, offsets=offsets),
        "entropy": torch.nested.nested_tensor_from_jagged(values["entropy"].clone(), offsets=offsets),
    }
    loss, metrics = loss_fn(config, model_output, data.clone())
    (grad,) = torch.autograd.grad(loss, leaf)
    return LossRun(loss.detach(), {"log_probs": grad}, metrics)


def metric(run: Any, name: str) -> float:
    (value,) = run.metrics[name].values
    return float(value)


# ------------------------------------------------------------------------------------------------
# Break 1: verl_ext/core/erc.py gating log_prob itself instead of a view of it
# ------------------------------------------------------------------------------------------------


def test_erc_on_verl_mode_keeps_the_kl_loss_gradient_on_every_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """ERC on verl's ``vanilla`` with ``use_kl_loss``, every token outside the band: the policy term gives no
    gradient, the KL loss keeps verl's on every valid token -- the gradient of verl's own ``ppo_loss`` on the
    same micro-batch with zero advantages (where only the KL loss moves the log-probs). The installed loss
    went through :data:`~verl_ext.registry.ERC_ON_VERL_MODE`; a wide band is the control (the policy term
    then moves the gradient)."""
    from verl_ext.actor_loss import divclip_actor_loss
    from verl_ext.config_rules.policy import ERC_ON_VERL_MODE

    calls: list[str] = []
    entry = core_algos.POLICY_LOSS_REGISTRY[ERC_ON_VERL_MODE]
    monkeypatch.setitem(
        core_algos.POLICY_LOSS_REGISTRY,
        ERC_ON_VERL_MODE,
        lambda **kwargs: calls.append(ERC_ON_VERL_MODE) or entry(**kwargs),
    )
    case = ParityCase("erc_with_kl_loss", actor=dict(KL, kl_loss_type="low_var_kl"), entropy=True, ref_log_prob=True)
    data = make_micro_batch(case)
    values = model_output_values(data)
    with_entropy_ratios(data, values, (1.3, 0.75))  # every token outside (0.99, 1.01)
    ours = run_erc_loss(
        divclip_actor_loss, divclip_config("vanilla", case, erc_beta_low=0.01, erc_beta_high=0.01), data, values
    )
    assert calls == [ERC_ON_VERL_MODE]
    assert metric(ours, "actor/divclip/erc/clipfrac_upper") + metric(ours, "actor/divclip/erc/clipfrac_lower") == 1.0

    zero_advantages = data.clone()
    zero_advantages["advantages"] = _nested([torch.zeros_like(a) for a in data["advantages"].unbind()])
    plain = make_actor_config(policy_loss=PolicyLossConfig(loss_mode="vanilla"), **{**CLIP_RATIOS, **case.actor})
    kl_only = run_erc_loss(verl_losses.ppo_loss, plain, zero_advantages, values)
    valid = valid_positions(data)
    assert (kl_only.grads["log_probs"][valid] != 0).all()
    torch.testing.assert_close(ours.grads["log_probs"], kl_only.grads["log_probs"])
    assert metric(ours, "kl_loss") == metric(kl_only, "kl_loss")

    wide = run_erc_loss(
        divclip_actor_loss, divclip_config("vanilla", case, erc_beta_low=0.99, erc_beta_high=1e6), data, values
    )
    assert not torch.allclose(wide.grads["log_probs"], kl_only.grads["log_probs"])


# ------------------------------------------------------------------------------------------------
# Break 2: verl_ext/core/surrogate.py calling agg_loss without loss_scale_factor
# ------------------------------------------------------------------------------------------------


def padded(nested: torch.Tensor) -> torch.Tensor:
    """``(batch, max response length)`` of a nested per-response field, zeros beyond each row."""
    width = max(RESPONSE_LENS)
    return torch.stack([torch.cat([row, row.new_zeros(width - len(row))]) for row in nested.unbind()])


def padded_from_flat(flat: torch.Tensor) -> torch.Tensor:
    """``(batch, max response length)`` of the response values in a flat engine output (0 beyond a row)."""
    width = max(RESPONSE_LENS)
    rows = [torch.cat([flat[p], flat.new_zeros(width - len(p))]) for p in response_positions()]
    return torch.stack(rows)


@pytest.mark.parametrize("loss_scale_factor", [1536, None])
def test_loss_scale_factor_scales_kl3_under_seq_mean_token_sum_norm(loss_scale_factor: Any) -> None:
    """``kl3`` with ``seq-mean-token-sum-norm`` as the ATR scripts run it (``loss_scale_factor=1536``): the
    installed loss is the paper's formula, -1/(n_seq * factor) sum_i sum_t min(w A, clip_delta(w) A), with
    the factor verl's ``agg_loss`` documents (the response length when unset) -- value and gradient."""
    from verl_ext.actor_loss import divclip_actor_loss

    actor = dict(loss_scale_factor=loss_scale_factor, loss_agg_mode="seq-mean-token-sum-norm")
    case = ParityCase("kl3_seq_norm", actor=actor)
    data = make_micro_batch(case)
    values = model_output_values(data)
    ours = run_loss(divclip_actor_loss, divclip_config("kl3", case), data, values, with_entropy=False)

    leaf = values["log_probs"].clone().requires_grad_(True)
    mask, old, adv = (padded(data[name]) for name in ("response_mask", "old_log_probs", "advantages"))
    surrogate = reference_surrogate_matrix(
        old, padded_from_flat(leaf), adv, mask, RefKnobs(mode="kl3", eps_low=0.2, eps_high=0.28, delta=0.07)
    )
    factor = loss_scale_factor if loss_scale_factor is not None else mask.shape[-1]
    expected = -surrogate.sum() / len(RESPONSE_LENS) / factor
    (grad,) = torch.autograd.grad(expected, leaf)
    torch.testing.assert_close(ours.loss, expected.detach(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(ours.grads["log_probs"], grad, rtol=1e-5, atol=1e-9)
    assert (grad != 0).any() and (surrogate.detach() != 0).any()


# ------------------------------------------------------------------------------------------------
# Break 3: verl_ext/core/constraints.py building a region at a fixed delta
# ------------------------------------------------------------------------------------------------

KL_MODES = ("kl1", "kl2", "is_kl3", "kl3", "seq_kl3", "trgppo", "kl_full")


def coarsened_kl(topk: Any, direction: str) -> torch.Tensor:
    """KL between the (k + 1)-bucket coarsenings from the stored log-masses, by the definition."""
    p, q = (topk.new, topk.old) if direction == "forward" else (topk.old, topk.new)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("delta", [0.02, 0.3])
@pytest.mark.parametrize("mode", KL_MODES)
def test_every_kl_mode_reads_a_non_default_delta(mode: str, delta: float) -> None:
    """Each KL-budget mode at a delta other than the default 0.07 is the paper's formula at that delta (the
    naive reference, values and gradients, on ratios placed around that delta's bounds); the reference at
    the default delta differs on the same batch, so a region built at a fixed 0.07 fails here."""
    if mode == "kl_full":
        old_lp, new_lp, adv, mask, topk = operator_batch(seed=0)
        loss, grad, _ = run_operator(mode, old_lp, new_lp, adv, mask, topk, delta=delta)
        kl = coarsened_kl(topk, "forward")

        def reference(at: float) -> tuple[torch.Tensor, torch.Tensor]:
            log_prob = new_lp.clone().requires_grad_(True)
            ref = naive_kl_full_loss(old_lp, log_prob, adv, mask, kl, at)
            return ref.detach(), torch.autograd.grad(ref, log_prob)[0]
    else:
        knobs = RefKnobs(mode=mode, delta=delta)
        old_lp, new_lp, adv, mask = boundary_batch(mode, knobs)
        loss, grad, _ = run_registry_loss(mode, old_lp, new_lp, adv, mask, actor_config(mode, delta=delta))

        def reference(at: float) -> tuple[torch.Tensor, torch.Tensor]:
            log_prob = new_lp.clone().requires_grad_(True)
            ref = reference_loss(old_lp, log_prob, adv, mask, RefKnobs(mode=mode, delta=at))
            return ref.detach(), torch.autograd.grad(ref, log_prob)[0]

    ref_loss, ref_grad = reference(delta)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    default_loss, default_grad = reference(0.07)
    binds = not (torch.allclose(default_loss, ref_loss) and torch.allclose(default_grad, ref_grad))
    assert binds, "the reference at the default delta is the same on this batch"


# ------------------------------------------------------------------------------------------------
# Breaks 4 and 5: verl_ext/actor_loss.py swapping the ERC band's sides for the gauge and the dump
# ------------------------------------------------------------------------------------------------

#: (beta_low, beta_high): the band (0.8, 1.5); rho 1.3 is inside, 0.75 outside (swapped: the reverse)
ASYMMETRIC = (0.2, 0.5)
RATIOS = (1.3, 1.3, 0.75, 1.0)


@pytest.mark.parametrize("mode", ["kl3", "vanilla"])
def test_an_asymmetric_erc_band_reaches_the_loss_the_gauge_and_the_dump(mode: str, tmp_path: Path) -> None:
    """ERC with the band (1 - 0.2, 1 + 0.5) on an on-policy micro-batch with a token dump: exactly the
    tokens with rho = 0.75 are outside -- in the loss's ``erc/clipfrac_*``, in the on-policy gauge's
    ``erc_masked_frac`` and in the dump's ``clipped`` flags -- and none of those with rho = 1.3 (which a
    band with its sides swapped, (0.5, 1.2), would mask instead)."""
    from verl_ext.actor_loss import divclip_actor_loss

    case = ParityCase("asymmetric_erc", entropy=True, on_policy_mark=True)
    data = make_micro_batch(case)
    values = model_output_values(data)
    rhos = with_entropy_ratios(data, values, RATIOS)
    masks = data["response_mask"].unbind()
    valid_rhos = [
        rho for row, mask in zip(rhos, masks, strict=False) for rho, m in zip(row, mask.tolist(), strict=False) if m
    ]
    n_low, n_high = valid_rhos.count(0.75), valid_rhos.count(1.3)
    assert 0 < n_low < n_high  # the two sides count differently: a swap changes every fraction
    dump = tmp_path / "dump.jsonl"
    config = divclip_config(
        mode,
        case,
        erc_beta_low=ASYMMETRIC[0],
        erc_beta_high=ASYMMETRIC[1],
        token_dump_path=str(dump),
        token_dump_every_n_steps=1,
    )
    ours = run_erc_loss(divclip_actor_loss, config, data, values)

    n = len(valid_rhos)
    assert metric(ours, "actor/divclip/erc/clipfrac_upper") == 0.0
    assert metric(ours, "actor/divclip/erc/clipfrac_lower") == pytest.approx(n_low / n)
    assert metric(ours, "actor/divclip/onpolicy/erc_masked_frac") == pytest.approx(n_low / n)
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == n
    assert sorted(round(row["entropy_ratio"], 4) for row in rows) == sorted(valid_rhos)
    for row in rows:
        assert row["clipped"] == (abs(row["entropy_ratio"] - 0.75) < 1e-4), row


# ------------------------------------------------------------------------------------------------
# Break 6: verl_ext/registry.py never resetting the loss inputs' context variable
# ------------------------------------------------------------------------------------------------


def test_the_loss_inputs_are_reset_after_every_call_whatever_ran_before() -> None:
    """``supplying`` restores what was there before, after a normal exit, after an exception and when
    nested; through the actor loss, an ERC call on a verl mode and one that raises inside ``ppo_loss``
    leave nothing behind, so the ERC entry called outside the actor loss refuses (it would otherwise run
    with the previous call's inputs)."""
    from verl_ext.actor_loss import divclip_actor_loss
    from verl_ext.registry import ERC_ON_VERL_MODE, LossInputs, supplied_inputs, supplying

    assert supplied_inputs() is None
    outer, inner = LossInputs(verl_mode="vanilla"), LossInputs(verl_mode="gspo")
    with supplying(outer):
        assert supplied_inputs() is outer
        with supplying(inner):
            assert supplied_inputs() is inner
        assert supplied_inputs() is outer
    assert supplied_inputs() is None
    with pytest.raises(RuntimeError, match="inside"):
        with supplying(inner):
            raise RuntimeError("inside")
    assert supplied_inputs() is None

    case = ParityCase("erc", actor=dict(KL), entropy=True, ref_log_prob=True)
    data = make_micro_batch(case)
    values = model_output_values(data)
    with_entropy_ratios(data, values, RATIOS)
    config = divclip_config("vanilla", case, erc_beta_low=0.2, erc_beta_high=0.5)
    run_erc_loss(divclip_actor_loss, config, data, values)
    assert supplied_inputs() is None
    del data["ref_log_prob"]  # the KL loss raises inside ppo_loss, after the policy term ran
    with pytest.raises(KeyError, match="ref_log_prob"):
        run_erc_loss(divclip_actor_loss, config, data, values)
    assert supplied_inputs() is None
    shape = (2, 3)
    with pytest.raises(ValueError, match="runs only inside the divclip actor loss"):
        core_algos.POLICY_LOSS_REGISTRY[ERC_ON_VERL_MODE](
            old_log_prob=torch.zeros(shape),
            log_prob=torch.zeros(shape),
            advantages=torch.ones(shape),
            response_mask=torch.ones(shape, dtype=torch.bool),
            config=config,
        )


# ------------------------------------------------------------------------------------------------
# Break 7: recipe/verl_keys.py reclassifying an honoured key (loss_scale_factor) as no_effect
# ------------------------------------------------------------------------------------------------

EVIDENCE_FILE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?")


def evidence_sources(evidence: str) -> list[str]:
    """The text of each test file (or test function, with ``::name``) an evidence string names."""
    sources = []
    for path, name in EVIDENCE_FILE.findall(evidence):
        text = (REPO / path).read_text()
        if name:
            match = re.search(rf"^def {name}\b.*?(?=^\S)", text + "\nEND", flags=re.M | re.S)
            assert match, f"{path}::{name} is no test function"
            text = match.group(0)
        sources.append(text)
    return sources


def loss_case_actor_keys() -> list[str]:
    """The actor keys the loss-parity cases set (each moves verl's loss:
    ``test_ppo_loss_parity.py::test_the_options_change_the_loss``)."""
    return sorted({key for case in CASES for key in case.actor})


@pytest.mark.parametrize("key", loss_case_actor_keys())
def test_every_actor_key_the_loss_cases_set_is_honoured_with_evidence_that_exercises_it(key: str) -> None:
    """A key the loss cases show to change verl's loss is ``honoured`` on the divclip path (the actor loss is
    verl's ``ppo_loss``), and one of the tests its row names exercises that key -- so reclassifying, say,
    ``loss_scale_factor`` as ``no_effect`` (or naming evidence that never sets it) fails here."""
    from recipe.verl_keys import KeyClass, classify
    from verl_ext.config import ACTOR

    rule = classify(f"{ACTOR}.{key}")
    assert rule.key_class is KeyClass.HONOURED, (key, rule.key_class, rule.reason)
    assert rule.evidence is not None
    sources = evidence_sources(rule.evidence)
    assert sources, f"{key}: the evidence names no test file: {rule.evidence!r}"
    assert any(re.search(rf"\b{key}\b", text) for text in sources), (key, rule.evidence)


def test_the_loss_case_keys_include_the_atr_scripts_aggregation() -> None:
    """The generated list above covers the keys the ATR scripts set on the loss (not vacuous)."""
    assert {"loss_scale_factor", "loss_agg_mode", "use_kl_loss", "entropy_coeff"} <= set(loss_case_actor_keys())
