"""Tests that kill what the loss path's mutation score (``tools/mutation.py``, docs/benchmarks.md) found alive.

ERC's band is open: ``rho <= 1 - beta_l`` and ``rho >= 1 + beta_h`` are outside (ERC paper, Eq. 3-4), so the
edges themselves are tested with ratios that are exact in floating point; the band's tensors are in the
dtype the loss asks for, whatever the entropies' dtype.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import torch


def policy(**knobs: float):
    from verl_ext.config import DivClipPolicyLossConfig

    return DivClipPolicyLossConfig(loss_mode="kl3", **knobs)


def test_outside_band_is_the_open_band_on_both_sides() -> None:
    """(1 - beta_l, 1 + beta_h) open: its edges are outside, points just inside are in, far points are out,
    and each side reads its own beta (an asymmetric band)."""
    from verl_ext.core.erc import outside_band

    rho = torch.tensor([0.5, 0.5000001, 1.0, 1.1999999, 1.2, 1.7, 0.2, float("nan")], dtype=torch.float64)
    expected = [True, False, False, False, True, True, True, True]
    assert outside_band(rho, 0.5, 0.2).tolist() == expected
    # the sides swapped: (0.8, 1.5)
    assert outside_band(rho, 0.2, 0.5).tolist() == [True, True, False, False, False, True, True, True]


def test_the_band_counts_its_edges_as_outside_in_the_loss_dtype() -> None:
    """``entropy_ratio_band`` at ratios exactly on the edges (eps = 1: (H + 1) / (H_old + 1) = 3/2 and 2/4):
    both outside, counted once on their side, gradient gate 0; the tensors in the requested dtype."""
    from verl_ext.core.erc import entropy_ratio_band

    old = torch.tensor([[1.0, 3.0, 1.0, 0.4]])
    new = torch.tensor([[2.0, 1.0, 1.0, 0.5]])
    mask = torch.tensor([[1, 1, 1, 0]])
    band = entropy_ratio_band(old, new, mask, policy(erc_beta_low=0.5, erc_beta_high=0.5, erc_eps=1.0), torch.float64)
    assert band.rho.tolist() == [[1.5, 0.5, 1.0, 1.0]]
    assert band.keep.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert band.outside.tolist() == [[True, True, False, False]]
    assert (float(band.n_above), float(band.n_below)) == (1.0, 1.0)
    for tensor in (band.rho, band.keep, band.n_above, band.n_below):
        assert tensor.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_ratio_computes_in_the_requested_dtype_from_bf16_entropies(dtype: torch.dtype) -> None:
    """bf16 entropies (verl's default compute dtype): rho is computed in ``dtype`` from their values, not in
    bf16 -- (H + eps) / (H_old + eps) differs from the bf16 quotient at these values."""
    from verl_ext.core.erc import entropy_ratio

    old = torch.tensor([[1.0, 3.0, 0.7]], dtype=torch.bfloat16)
    new = torch.tensor([[1.1, 2.9, 0.71]], dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 0]])
    rho = entropy_ratio(old, new, mask, 1e-3, dtype)
    assert rho.dtype == dtype
    expected = (new.to(dtype) + 1e-3) / (old.to(dtype) + 1e-3)
    torch.testing.assert_close(rho[0, :2], expected[0, :2], rtol=0, atol=0)
    assert rho[0, 2] == 1.0  # padding
    in_bf16 = ((new + 1e-3) / (old + 1e-3)).to(dtype)
    assert not torch.equal(rho[0, :2], in_bf16[0, :2])


def test_the_gradient_gate_keeps_a_bf16_log_probs_gradient_bf16() -> None:
    """verl's bf16 log-probs with the band in float32 (the loss computes it there): the gated gradient is the
    bf16 gradient times keep, in bf16 (a float32 multiplier would change the gradient's dtype: torch refuses)."""
    from verl_ext.core.erc import entropy_ratio_band, gate_log_prob_gradient

    old = torch.tensor([[1.0, 3.0, 1.0]])
    new = torch.tensor([[2.0, 1.0, 1.0]])
    band = entropy_ratio_band(
        old, new, torch.ones(1, 3), policy(erc_beta_low=0.5, erc_beta_high=0.5, erc_eps=1.0), torch.float32
    )
    log_prob = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.bfloat16, requires_grad=True)
    gated = gate_log_prob_gradient(log_prob, band)
    assert torch.equal(gated, log_prob)
    (gated * torch.tensor([[2.0, 3.0, 4.0]], dtype=torch.bfloat16)).sum().backward()
    assert log_prob.grad.dtype == torch.bfloat16
    assert log_prob.grad.tolist() == [[0.0, 0.0, 4.0]]


def band_metrics(old: list[float], new: list[float], mask: list[int]) -> dict[str, float]:
    """ERC's metrics of one row as the loss finishes them (eps = 1: rho = (H + 1) / (H_old + 1))."""
    from verl_ext.core.erc import entropy_band_sums, entropy_ratio_band, finish_entropy_band_metrics

    band = entropy_ratio_band(
        torch.tensor([old]),
        torch.tensor([new]),
        torch.tensor([mask]),
        policy(erc_beta_low=0.5, erc_beta_high=0.5, erc_eps=1.0),
        torch.float64,
    )
    values = {name: float(value) for name, value in entropy_band_sums(band).items()}
    finish_entropy_band_metrics(values, band, float(sum(mask)))
    return values


@pytest.mark.parametrize("n_padding", [1, 2])
def test_erc_extremes_are_the_valid_tokens_with_one_valid_token_or_one_padding_token(n_padding: int) -> None:
    """Padding's ratio 1 hides the valid extreme when every valid ratio is on one side of 1: with a single
    padding token, or a single valid token, the reported min / max are still the valid tokens'."""
    above = band_metrics(
        [1.0] * 3, [1.4, 2.0, 1.6][: 4 - 1 - n_padding] + [5.0] * n_padding, [1] * (3 - n_padding) + [0] * n_padding
    )
    assert above["erc/ratio_min"] == pytest.approx(1.2)
    below = band_metrics(
        [1.0] * 3, [0.6, 0.8, 0.7][: 4 - 1 - n_padding] + [0.1] * n_padding, [1] * (3 - n_padding) + [0] * n_padding
    )
    assert below["erc/ratio_max"] == pytest.approx(0.9 if n_padding == 1 else 0.8)


def test_the_gauge_counts_one_valid_token_whole() -> None:
    """One valid token outside the clip range: ``ratio_clipfrac`` 1 (the count over one token, not two);
    a micro-batch without valid tokens reads 0 everywhere, an empty one too."""
    from verl_ext.core.gauge import on_policy_gauge

    old = torch.zeros(1, 3)
    new = torch.tensor([[0.5, 0.0, 0.0]])
    out = on_policy_gauge(old, new, torch.tensor([[1, 0, 0]]), 0.2, 0.28)
    assert out["onpolicy/ratio_clipfrac"] == 1.0
    assert out["onpolicy/log_ratio_abs_max"] == pytest.approx(0.5)
    none_valid = on_policy_gauge(old, new, torch.zeros(1, 3, dtype=torch.int64), 0.2, 0.28)
    assert none_valid == {"onpolicy/log_ratio_abs_max": 0.0, "onpolicy/ratio_clipfrac": 0.0}
    empty = on_policy_gauge(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int64), 0.2, 0.28)
    assert empty == {"onpolicy/log_ratio_abs_max": 0.0, "onpolicy/ratio_clipfrac": 0.0}


def test_the_gauge_measures_log_pi_theta_minus_log_pi_old() -> None:
    """On real log-probs (not zeros): equal ones read 0 and count nothing; pi_theta 0.5 nats below pi_old reads
    0.5, its ratio exp(-0.5) below the clip range; padding, whatever it holds, is not measured."""
    from verl_ext.core.gauge import on_policy_gauge

    old = torch.tensor([[-1.0, -2.0, -7.0]])
    mask = torch.tensor([[1, 1, 0]])
    same = on_policy_gauge(old, old.clone(), mask, 0.2, 0.28)
    assert same == {"onpolicy/log_ratio_abs_max": 0.0, "onpolicy/ratio_clipfrac": 0.0}
    lower = on_policy_gauge(old, torch.tensor([[-1.5, -2.0, 3.0]]), mask, 0.2, 0.28)
    assert lower["onpolicy/log_ratio_abs_max"] == pytest.approx(0.5)
    assert lower["onpolicy/ratio_clipfrac"] == 0.5


def test_behaviour_divergence_is_kl3_of_pi_old_over_mu_on_valid_tokens() -> None:
    """mu against pi_old (``actor/divclip/staleness/*``): the mean over valid tokens of w - 1 - log w with
    w = pi_old / mu, and max |log w| (here of a negative log w); KL3 is asymmetric in log w, so the direction
    shows (log w = +1 and -2 give e - 2 and 1 + 1/e^2); padding, whatever it holds, is left out; no valid token
    gives nothing."""
    from verl_ext.core.staleness import behaviour_divergence

    old = torch.tensor([[-1.0, -4.0, -2.0, 0.0]])
    mu = torch.tensor([[-2.0, -2.0, -2.0, -9.0]])  # log w = +1, -2, 0 and (padding) +9
    mask = torch.tensor([[1, 1, 1, 0]])
    found = behaviour_divergence(old, mu, mask)
    expected_mean = ((math.e - 2.0) + (1.0 + math.exp(-2.0)) + 0.0) / 3
    assert found["behaviour_kl3_mean"] == pytest.approx(expected_mean, rel=1e-12)
    assert found["behaviour_log_ratio_abs_max"] == pytest.approx(2.0, rel=1e-12)
    one_sided = behaviour_divergence(old[:, :1], mu[:, :1], mask[:, :1])  # log w = +1 alone: e - 2, not 1/e
    assert one_sided["behaviour_kl3_mean"] == pytest.approx(math.e - 2.0, rel=1e-12)
    assert behaviour_divergence(old, mu, torch.zeros_like(mask)) == {}


def test_define_constraint_records_its_declaration_and_refuses_bad_ones() -> None:
    """``define_constraint`` (the constraint registry of ATR Eq. 5), called at run time with names of this test's
    own: a name joins ``CONSTRAINTS`` with what it declares -- by default a token-level constraint dropping its
    violations, measured by ``kl3_mean``; a sequence-level one by ``seq_kl3_mean`` -- and the decorator hands the
    region back; a sequence-level constraint that preserves violations, or a name defined twice, is refused
    naming it (the first definition kept)."""
    from verl_ext.core.region import CONSTRAINTS, ConstraintSpec, define_constraint, interval

    def region(inputs):
        return interval(inputs, 0.5, 2.0)

    try:
        assert define_constraint("_test_token")(region) is region
        token = CONSTRAINTS["_test_token"]
        assert (token.on_violation, token.level, token.budget_metric) == ("drop", "token", "kl3_mean")
        assert token == ConstraintSpec("_test_token", region, "drop", "token", False, "kl3_mean", False, (), "")
        define_constraint("_test_sequence", level="sequence")(region)  # sequence-level, dropping: allowed
        assert CONSTRAINTS["_test_sequence"].budget_metric == "seq_kl3_mean"
        define_constraint(
            "_test_full",
            on_violation="preserve",
            delta_budget=True,
            budget_metric="my_metric",
            needs_old_topk=True,
            reads=["delta"],
            summary="a test constraint",
        )(region)
        expected = ConstraintSpec(
            "_test_full", region, "preserve", "token", True, "my_metric", True, ("delta",), "a test constraint"
        )
        assert CONSTRAINTS["_test_full"] == expected
        with pytest.raises(
            ValueError, match=r"^constraint '_test_bad': sequence-level constraints only drop violations$"
        ):
            define_constraint("_test_bad", on_violation="preserve", level="sequence")
        assert "_test_bad" not in CONSTRAINTS
        other = lambda inputs: interval(inputs, 0.0, 9.0)  # noqa: E731
        with pytest.raises(ValueError, match=r"^constraint '_test_token' is already defined \(.*region\)$"):
            define_constraint("_test_token")(other)
        assert CONSTRAINTS["_test_token"].region is region
    finally:
        for name in ("_test_token", "_test_sequence", "_test_full", "_test_bad"):
            CONSTRAINTS.pop(name, None)


def test_the_gauge_clip_range_is_closed() -> None:
    """A ratio exactly on 1 - eps_low or 1 + eps_high is inside the actor's clip range (verl's clip keeps
    it); one beyond either is counted."""
    from verl_ext.core.gauge import on_policy_gauge

    log_ratio = torch.tensor([[-0.3, 0.2, -0.31, 0.21]])
    ratio = log_ratio.exp()
    low, high = 1.0 - float(ratio[0, 0]), float(ratio[0, 1]) - 1.0
    assert (1.0 - low, 1.0 + high) == (float(ratio[0, 0]), float(ratio[0, 1]))  # exact edges
    out = on_policy_gauge(torch.zeros(1, 4), log_ratio, torch.ones(1, 4), low, high)
    assert out["onpolicy/ratio_clipfrac"] == 0.5


def test_the_gauge_reads_erc_eps_from_the_band_and_needs_both_entropies() -> None:
    """``erc_ratio_dev_max`` is max |rho - 1| with the band's eps (1 here: (2 + 1) / (1 + 1) = 1.5), with
    1e-8 when no band is given (rho = 2), and absent unless both entropies are given."""
    from verl_ext.core.gauge import on_policy_gauge

    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2)
    old_entropy, entropy = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 1.0]])
    with_band = on_policy_gauge(zeros, zeros, mask, 0.2, 0.2, old_entropy, entropy, erc_band=(0.2, 0.2, 1.0))
    assert with_band["onpolicy/erc_ratio_dev_max"] == pytest.approx(0.5)
    assert with_band["onpolicy/erc_masked_frac"] == 0.5
    without_band = on_policy_gauge(zeros, zeros, mask, 0.2, 0.2, old_entropy, entropy)
    assert without_band["onpolicy/erc_ratio_dev_max"] == pytest.approx(1.0)
    assert "onpolicy/erc_masked_frac" not in without_band
    for one in ((None, entropy), (old_entropy, None)):
        assert set(on_policy_gauge(zeros, zeros, mask, 0.2, 0.2, *one)) == {
            "onpolicy/log_ratio_abs_max",
            "onpolicy/ratio_clipfrac",
        }


def test_entropy_ratio_of_fp64_entropies_is_computed_in_the_requested_fp32() -> None:
    """fp64 entropies with ``dtype`` float32 (the band the verl modes compute): both entropies are cast to
    float32 first, so rho is float32 and equals the float32 formula bit for bit (an fp64 intermediate would
    round differently somewhere among these values)."""
    from verl_ext.core.erc import entropy_ratio

    gen = torch.Generator().manual_seed(0)
    old = 0.1 + 3 * torch.rand(4, 256, generator=gen, dtype=torch.float64)
    new = 0.1 + 3 * torch.rand(4, 256, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 256, dtype=torch.bool)
    rho = entropy_ratio(old, new, mask, 1e-3, torch.float32)
    assert rho.dtype == torch.float32
    eps = torch.tensor(1e-3, dtype=torch.float32)
    assert torch.equal(rho, (new.float() + eps) / (old.float() + eps))
    assert not torch.equal(rho, ((new + 1e-3) / (old + 1e-3)).float())


# -- the constraints' regions at their bounds, and the gauge's rule at bf16 --------------------------------------


def _next_double(x: float, toward: float) -> float:
    """The float64 neighbour of ``x`` in the direction of ``toward``."""
    return torch.nextafter(torch.tensor(x, dtype=torch.float64), torch.tensor(toward, dtype=torch.float64)).item()


def _inputs(ratio: list[float], old_log_prob: list[float], low: float, high: float, **knobs: float):
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.region import ConstraintInputs

    w = torch.tensor([ratio], dtype=torch.float64)
    return ConstraintInputs(
        w.log(),
        w,
        torch.tensor([old_log_prob], dtype=torch.float64),
        torch.ones_like(w, dtype=torch.bool),
        low,
        high,
        DivClipPolicyLossConfig(loss_mode=knobs.pop("loss_mode", "dcpo"), **knobs),
    )


def test_the_dcpo_region_is_closed_on_each_of_its_four_bounds() -> None:
    """DCPO's interval is closed: w = 1/2, w = cap, q w (w - 1) = -eps_low and = eps_high are inside (each token
    sits on one bound, exactly in floating point: q = exp(0) = 1), and the next double beyond each is outside."""
    from verl_ext.core.region import CONSTRAINTS

    on = _inputs([0.5, 3.0, 2.0], [-30.0, -30.0, 0.0], 0.25, 2.0, dcpo_cap=3.0)
    assert CONSTRAINTS["dcpo"].region(on).inside.tolist() == [[True, True, True]]
    low_on = _inputs([0.5], [0.0], 0.25, 2.0, dcpo_cap=3.0)  # q w (w - 1) = -1/4 = -eps_low
    assert CONSTRAINTS["dcpo"].region(low_on).inside.tolist() == [[True]]
    beyond = [_next_double(0.5, 0.0), _next_double(3.0, 9.0), _next_double(2.0, 9.0)]
    off = _inputs(beyond, [-30.0, -30.0, 0.0], 0.25, 2.0, dcpo_cap=3.0)
    assert CONSTRAINTS["dcpo"].region(off).inside.tolist() == [[False, False, False]]
    tighter = _inputs([0.5], [0.0], _next_double(0.25, 0.0), 2.0, dcpo_cap=3.0)  # eps_low just below 1/4
    assert CONSTRAINTS["dcpo"].region(tighter).inside.item() is False


def test_the_clip_region_is_closed_where_torch_clamp_passes_the_gradient() -> None:
    """``clip`` (and every ratio interval built by ``interval``) is closed, as PPO's ``clamp`` is: a ratio exactly
    on 1 - eps_low or 1 + eps_high keeps its gradient through ``torch.clamp`` (verl's ``vanilla``) and is inside
    the region; the next double beyond either bound loses it and is outside. Dyadic bounds: 0.75 and 1.5."""
    from verl_ext.core.region import CONSTRAINTS

    points = [0.75, 1.5, _next_double(0.75, 0.0), _next_double(1.5, 9.0), 1.0]
    w = torch.tensor(points, dtype=torch.float64, requires_grad=True)
    torch.clamp(w, 0.75, 1.5).sum().backward()
    clamp_keeps = (w.grad != 0).tolist()
    assert clamp_keeps == [True, True, False, False, True]
    region = CONSTRAINTS["clip"].region(_inputs(points, [-1.0] * 5, 0.25, 0.5, loss_mode="clip"))
    assert region.inside.tolist() == [clamp_keeps]
    assert (region.lower, region.upper) == (0.75, 1.5)


def test_the_kl_full_region_is_closed_at_delta() -> None:
    """Eq. 4's KL_t <= delta: a token whose coarsened KL equals delta is inside, the next double above is not."""
    import dataclasses

    from verl_ext.core.region import CONSTRAINTS

    base = _inputs([1.0, 1.0], [-1.0, -1.0], 0.2, 0.2, loss_mode="kl_full", delta=0.07)
    kl = torch.tensor([[0.07, _next_double(0.07, 1.0)]], dtype=torch.float64)
    region = CONSTRAINTS["kl_full"].region(dataclasses.replace(base, full_kl=kl))
    assert region.inside.tolist() == [[True, False]]


def test_the_sequence_ratio_divides_by_the_valid_tokens_even_one_and_is_zero_without_any() -> None:
    from verl_ext.core.surrogate import sequence_mean_log_ratio

    log_ratio = torch.tensor([[0.3, 5.0, 5.0], [0.2, -0.4, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[True, False, False], [True, True, False], [False, False, False]])
    assert torch.allclose(sequence_mean_log_ratio(log_ratio, mask), torch.tensor([0.3, -0.1, 0.0]))


def test_the_kl3_budget_of_a_ratio_range_is_left_out_where_the_lower_bound_is_zero() -> None:
    """The diagnostic's ``_kl3delta`` budget is max(KL3(l), KL3(u)) for scalar bounds with l > 0; a lower bound of 0
    (``clip_ratio_low = 1``) has no finite KL3, so only the configured delta is compared."""
    from verl_ext.core.region import TrustRegion
    from verl_ext.core.surrogate import _diagnostic_deltas

    inside = torch.ones(1, 2, dtype=torch.bool)
    assert _diagnostic_deltas(0.07, TrustRegion(inside, 0.0, 1.28)) == {"": 0.07}
    assert _diagnostic_deltas(0.07, TrustRegion(inside, torch.zeros(1, 2), 1.28)) == {"": 0.07}
    both = _diagnostic_deltas(0.07, TrustRegion(inside, 0.8, 1.28))
    assert both[""] == 0.07 and both["_kl3delta"] == pytest.approx(max(0.8 - 1 - math.log(0.8), 0.28 - math.log(1.28)))


@pytest.mark.parametrize("mode", ["clip", "kl3", "dcpo"])
def test_the_gauges_rule_is_the_same_on_bf16_log_probs_as_on_their_float32_values(mode: str) -> None:
    """The gauge's trust-region test promotes bf16 log-probs before subtracting (as the operator does), so bf16
    inputs decide exactly what their float32 values decide, on 20,000 tokens spread over every bound. Control:
    the same rule on the log-ratio taken in bf16 decides some of those tokens differently."""
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.surrogate import outside_trust_region

    generator = torch.Generator().manual_seed(0)
    # log-probs of magnitudes 3e-4 to 2.7 (a bf16 difference of two of them rounds where their exponents differ)
    old = -(torch.rand(1, 20_000, generator=generator) * 9.0 - 8.0).exp().bfloat16()
    new = (old.float() + torch.rand(1, 20_000, generator=generator) * 1.2 - 0.6).bfloat16()
    mask = torch.ones_like(old, dtype=torch.bool)
    policy = DivClipPolicyLossConfig(loss_mode=mode)

    def outside(o: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return outside_trust_region(mode, o, n, mask, policy=policy, clip_ratio_low=0.2, clip_ratio_high=0.28)

    decided = outside(old, new)
    assert torch.equal(decided, outside(old.float(), new.float()))
    in_bf16 = outside(old.float(), (old.float() + (new - old).float()))  # the difference rounded to bf16 first
    assert 0 < int((in_bf16 != decided).sum()) < 2_000, int((in_bf16 != decided).sum())


@pytest.mark.parametrize("extreme", [-50.0, 50.0])
def test_the_gauge_clamps_each_tokens_log_ratio_before_the_sequence_mean(extreme: float) -> None:
    """As the operator does (and verl before its exp), each token's log-ratio is clamped to +-20 before GSPO's
    sequence mean: one token at +-50 among 100 gives log s = +-0.2, inside seq_kl3's delta = 0.07 (KL3 0.019 /
    0.021); unclamped it would be +-0.5, outside (KL3 0.107 / 0.149, the control)."""
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.surrogate import outside_trust_region

    old = torch.full((1, 100), -1.0, dtype=torch.float64)
    new = old.clone()
    new[0, 7] += extreme
    mask = torch.ones_like(old, dtype=torch.bool)
    policy = DivClipPolicyLossConfig(loss_mode="seq_kl3", delta=0.07)
    outside = outside_trust_region("seq_kl3", old, new, mask, policy=policy, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert not outside.any()
    kl3 = lambda log_s: math.exp(log_s) - 1.0 - log_s  # noqa: E731
    assert kl3(extreme / 250) <= 0.07 < kl3(extreme / 100)  # clamped mean 20/100 vs unclamped 50/100


def test_the_trgppo_epsilon_band_is_closed() -> None:
    """TRGPPO's region is the union of the closed epsilon band [1 - eps_low, 1 + eps_high] and the Bernoulli-KL
    budget: with a budget too small to rescue anything (delta = 1e-9), w = 0.75 and 1.25 (eps = 0.25, exact) are
    inside and the next doubles beyond them are not."""
    from verl_ext.core.region import CONSTRAINTS

    on = _inputs([0.75, 1.25], [-0.1, -0.1], 0.25, 0.25, loss_mode="trgppo", delta=1e-9)
    beyond = [_next_double(0.75, 0.0), _next_double(1.25, 2.0)]
    off = _inputs(beyond, [-0.1, -0.1], 0.25, 0.25, loss_mode="trgppo", delta=1e-9)
    assert CONSTRAINTS["trgppo"].region(on).inside.tolist() == [[True, True]]
    assert CONSTRAINTS["trgppo"].region(off).inside.tolist() == [[False, False]]


def _token_level_modes() -> list[str]:
    from verl_ext.core.region import CONSTRAINTS

    return sorted(name for name, spec in CONSTRAINTS.items() if spec.level == "token")


@pytest.mark.parametrize("mode", _token_level_modes())
def test_ppo_kl_is_verls_on_every_token_level_mode(mode: str) -> None:
    """``actor/ppo_kl`` is verl's metric, mean(log pi_old - log pi_theta) over the valid tokens: on the declaration
    test's sweep every token-level divclip mode reports what verl's own ``vanilla`` reports (not zero, so a sign
    would show)."""
    from tests.test_knobs import run_mode

    knobs = {"kl_full_top_k": 8} if mode == "kl_full" else {}
    verl = run_mode("vanilla", {}).metrics["actor/ppo_kl"]
    assert abs(verl) > 1e-3
    assert run_mode(mode, knobs).metrics["actor/ppo_kl"] == pytest.approx(verl, rel=1e-6)


def test_the_metrics_of_a_micro_batch_without_tokens_are_zero_not_an_error() -> None:
    """A micro-batch of zero tokens (an empty ``(rows, 0)`` response) reports ``kl3_max`` 0 and every fraction 0
    (the max of an empty tensor would raise)."""
    from verl_ext.core.region import TrustRegion
    from verl_ext.core.surrogate import _metrics

    for rows in (2, 0):  # two rows of no token; no row at all (the sequence-level metrics too)
        empty = torch.zeros(rows, 0)
        none = empty.bool()
        region = TrustRegion(none, 0.8, 1.28)
        metrics = _metrics(none, empty, region, none, none, None, None, None, sequence_log_ratio=torch.zeros(rows))
        assert metrics["actor/divclip/kl3_max"] == metrics["actor/divclip/seq_kl3_max"] == 0.0
        assert metrics["actor/pg_clipfrac"] == metrics["actor/ppo_kl"] == metrics["actor/divclip/kl3_mean"] == 0.0


def test_no_grad_frac_counts_the_dropped_tokens() -> None:
    """In a drop mode without dual-clip or ERC the tokens that lose their gradient are exactly the clipped ones:
    ``no_grad_frac`` equals ``pg_clipfrac`` (kl3 on the declaration test's sweep, where some are clipped)."""
    from tests.test_knobs import run_mode

    metrics = run_mode("kl3", {}).metrics
    assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0
    assert metrics["actor/divclip/no_grad_frac"] == pytest.approx(metrics["actor/pg_clipfrac"])


def test_per_token_ratio_bounds_are_reported_as_their_mean_over_valid_tokens_clamped_to_the_log_ratio_range() -> None:
    """A region may give per-token bounds (``TrustRegion``'s contract); ``ratio_lower`` / ``ratio_upper`` are their
    means over the valid tokens, each clamped to [e^-20, e^20] (log-ratios are clamped there, so a bound of 0 or
    inf is no bound). No registered constraint returns unsampled per-token bounds today, so this is its test."""
    from verl_ext.core.region import TrustRegion
    from verl_ext.core.surrogate import _metrics

    mask = torch.tensor([[True, True, False]])
    lower = torch.tensor([[0.0, 0.5, 7.0]], dtype=torch.float64)
    upper = torch.tensor([[math.inf, 2.0, 9.0]], dtype=torch.float64)
    none = torch.zeros_like(mask)
    metrics = _metrics(mask, torch.zeros(1, 3), TrustRegion(mask, lower, upper), none, none, None, None, None)
    assert metrics["actor/divclip/ratio_lower"] == pytest.approx((math.exp(-20.0) + 0.5) / 2, rel=1e-12)
    assert metrics["actor/divclip/ratio_upper"] == pytest.approx((math.exp(20.0) + 2.0) / 2, rel=1e-12)


def test_dualclip_frac_is_the_share_of_tokens_the_dual_clip_caps() -> None:
    """On the sweep (ratios over [e^-4, e^4], advantages of both signs) dual-clip c = 3 caps some tokens, not all."""
    from tests.test_knobs import run_mode

    share = run_mode("clip", {"dual_clip_c": 3.0}).metrics["actor/divclip/dualclip_frac"]
    assert 0.0 < share < 0.5


def test_own_modes_are_exactly_the_projects_registered_constraints() -> None:
    """``is_own_mode`` on every name verl's registry holds: the divclip constraints and the ERC entry are the
    project's, each of verl's own losses and an unknown name are not."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_ext.core.region import CONSTRAINTS
    from verl_ext.registry import ERC_ON_VERL_MODE, is_own_mode
    from verl_ext.verl_modes import VERL_MODE_READS

    ours = {*CONSTRAINTS, ERC_ON_VERL_MODE}
    assert ours <= set(POLICY_LOSS_REGISTRY)
    assert {mode for mode in POLICY_LOSS_REGISTRY if is_own_mode(mode)} == ours
    assert set(VERL_MODE_READS) <= set(POLICY_LOSS_REGISTRY) - ours
    assert not is_own_mode("no_such_loss")


#: one rising row (log-probs -1 -> -0.5) and one falling row (-0.5 -> -1): dyadic, so old + (new - old) == new
_RISING_FALLING_OLD = [[-1.0, -1.0], [-0.5, -0.5]]
_RISING_FALLING_LOG_RATIO = [[0.5, 0.5], [-0.5, -0.5]]


def _measured(mode: str) -> tuple[float, float]:
    """(the rising row's, the falling row's) value of what verl's function for ``mode`` compares with its bounds,
    computed as verl computes it: w or the sequence ratio (compared with 1 + eps_high, 1 - eps_low), log w,
    p - p_old, the Bernoulli KL."""
    up, down = math.exp(0.5), math.exp(-0.5)
    if mode in ("vanilla", "gspo"):
        return up, down
    if mode == "geo_mean":
        return 0.5, -0.5
    old = torch.tensor(_RISING_FALLING_OLD, dtype=torch.float64)[:, 0]
    new = old + torch.tensor(_RISING_FALLING_LOG_RATIO, dtype=torch.float64)[:, 0]
    old_p, p = old.exp(), new.exp()
    if mode == "dppo_tv":
        diff = p - old_p
        return float(diff[0]), float(diff[1])
    binary_kl = old_p * (old - new) + (1 - old_p) * torch.log((1.0 - old_p + 1e-8) / (1.0 - p + 1e-8))
    return float(binary_kl[0]), float(binary_kl[1])


def _bounds(mode: str, tighter: str = "") -> tuple[float, float]:
    """(eps_low, eps_high) exactly at the measured values, or one step of the compared quantity tighter on
    ``tighter``'s side ("low" or "high")."""
    up, down = _measured(mode)
    if mode in ("vanilla", "gspo"):  # 1 + eps and 1 - eps exact for ratios in [0.5, 2] (Sterbenz)
        high = (_next_double(up, 0.0) if tighter == "high" else up) - 1.0
        low = 1.0 - (_next_double(down, 1.0) if tighter == "low" else down)
        return low, high
    high = _next_double(up, 0.0) if tighter == "high" else up
    low = -down if mode in ("geo_mean", "dppo_tv") else down
    return (_next_double(low, 0.0) if tighter == "low" else low), high


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean", "dppo_tv", "dppo_kl"])
def test_the_gauges_rule_of_each_verl_mode_is_closed_at_both_bounds_as_verls(mode: str) -> None:
    """verl's functions clamp to, or keep tokens within, closed bounds (``clamp``, ``<=``): a token (a sequence, for
    GSPO) exactly on a bound is inside the mode's rule, and one step of the compared quantity tighter on a side puts
    that side's row outside -- the rising row on ``eps_high``, the falling row on ``eps_low``."""
    from verl_ext.verl_modes import VERL_MODE_READS

    rule = VERL_MODE_READS[mode].outside
    old = torch.tensor(_RISING_FALLING_OLD, dtype=torch.float64)
    log_ratio = torch.tensor(_RISING_FALLING_LOG_RATIO, dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    assert rule(log_ratio, old, mask, *_bounds(mode)).tolist() == [[False, False], [False, False]]
    assert rule(log_ratio, old, mask, *_bounds(mode, "high")).tolist() == [[True, True], [False, False]]
    assert rule(log_ratio, old, mask, *_bounds(mode, "low")).tolist() == [[False, False], [True, True]]


def _dump_call(config: object, step: int | None) -> None:
    from verl.utils import tensordict_utils as tu

    from tests.test_loss_breaks import ParityCase, make_micro_batch, model_output_values, run_erc_loss
    from verl_ext.actor_loss import divclip_actor_loss

    data = make_micro_batch(ParityCase("dump", entropy=True, on_policy_mark=True))
    if step is not None:
        tu.assign_non_tensor(data, global_steps=step)
    run_erc_loss(divclip_actor_loss, config, data, model_output_values(data))


def _dump_config(dump: Path, **knobs: int) -> object:
    """kl3 with ERC's band at 0.05 (the dump's ratios need it) and a token dump into ``dump``."""
    from tests.test_loss_breaks import ParityCase, divclip_config

    band = {"erc_beta_low": 0.05, "erc_beta_high": 0.05}
    return divclip_config("kl3", ParityCase("dump", entropy=True), **band, token_dump_path=str(dump), **knobs)


def test_the_token_dump_caps_a_step_over_all_its_calls_and_dumps_on_verls_step(tmp_path: Path) -> None:
    """One writer per dump path for the process: two loss calls at verl's step 9000 write at most the step's
    budget of rows in all; the step is the batch's ``global_steps`` (every 3rd step: 9000 is dumped, 9001 is not),
    not this process's count of loss calls (a few, which the steps are far from: with steps 6 and 7 the count
    matched them whenever four dump calls had run before in the process, as in mutmut's runs)."""
    dump = tmp_path / "dump.jsonl"
    config = _dump_config(dump, token_dump_every_n_steps=3, token_dump_max_tokens=5)
    for step in (9000, 9000, 9001):
        _dump_call(config, step)
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == 5 and {row["step"] for row in rows} == {9000}, rows


def test_without_verls_step_the_dump_counts_the_processes_loss_calls(tmp_path: Path) -> None:
    """A batch without ``global_steps`` (a caller outside verl's trainer): each loss call is the next step of this
    process's own count, one per call."""
    from verl_ext.actor_loss import _UPDATE_CALLS

    dump = tmp_path / "dump.jsonl"
    config = _dump_config(dump, token_dump_every_n_steps=1)
    start = _UPDATE_CALLS[0]
    for _ in range(2):
        _dump_call(config, None)
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [start + 1, start + 2]


def test_a_micro_batch_without_valid_tokens_reports_the_is_weights_mean_as_one() -> None:
    """The rollout-correction weights' mean over no valid token is 1 (no reweighting), not NaN."""
    from tests.test_losses import actor_config, run_registry_loss
    from verl_ext.registry import ROLLOUT_IS_METRIC

    old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.zeros(1, 3)
    weights = torch.full((1, 3), 0.5, dtype=torch.float64)
    _, _, metrics = run_registry_loss(
        "kl3", old, old, torch.ones_like(old), mask, actor_config("kl3"), rollout_is_weights=weights
    )
    assert metrics[ROLLOUT_IS_METRIC] == 1.0
    mask[0, 1] = 1
    _, _, metrics = run_registry_loss(
        "kl3", old, old, torch.ones_like(old), mask, actor_config("kl3"), rollout_is_weights=weights
    )
    assert metrics[ROLLOUT_IS_METRIC] == 0.5  # the control: a valid token's weight


def test_gspos_sequence_ratio_leaves_padding_out_of_its_mean() -> None:
    """The sequence ratio is the mean log w over valid tokens: a padding token's log w (whatever it holds)
    moves nothing -- a row of valid log w 0 stays inside any band."""
    from verl_ext.verl_modes import VERL_MODE_READS

    rule = VERL_MODE_READS["gspo"].outside
    log_ratio = torch.tensor([[0.0, 0.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    assert rule(log_ratio, torch.zeros_like(log_ratio), mask, 0.2, 0.2).tolist() == [[False, False, False]]
    assert rule(log_ratio, torch.zeros_like(log_ratio), mask | True, 0.2, 0.2).tolist() == [[True, True, True]]


def test_restoring_a_delta_of_zero_is_refused_naming_the_file(tmp_path: Path) -> None:
    """delta must be > 0 to resume a controller (0 would freeze every token); the refusal names the file."""
    from verl_ext.adaptive_delta import STATE_FILE, AdaptiveDelta
    from verl_ext.config import DivClipPolicyLossConfig

    (tmp_path / STATE_FILE).write_text(json.dumps({"delta": 0}))
    controller = AdaptiveDelta.from_policy(DivClipPolicyLossConfig(loss_mode="kl3", adaptive_delta_target=0.01))
    with pytest.raises(ValueError, match=f"{STATE_FILE}: 'delta' must be a finite number > 0, got 0"):
        controller.restore(str(tmp_path))


def test_restoring_another_metrics_controller_says_why(tmp_path: Path) -> None:
    from verl_ext.adaptive_delta import STATE_FILE, AdaptiveDelta
    from verl_ext.config import DivClipPolicyLossConfig

    (tmp_path / STATE_FILE).write_text(json.dumps({"delta": 0.07, "metric": "actor/divclip/seq_kl3_mean"}))
    controller = AdaptiveDelta.from_policy(DivClipPolicyLossConfig(loss_mode="kl3", adaptive_delta_target=0.01))
    with pytest.raises(
        ValueError, match="tracked 'actor/divclip/seq_kl3_mean'.*: resuming would continue a different controller$"
    ):
        controller.restore(str(tmp_path))


def _erc_on_vanilla(case_actor: dict, **data_kw: bool):
    """ERC on verl's vanilla through the actor loss, every entropy ratio 1 inside the wide band (0.01, 1e6 + 1),
    and verl's own ``ppo_loss`` on the same micro-batch."""
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils import losses as verl_losses

    from recipe.bench.harness import make_actor_config
    from tests.test_loss_breaks import (
        CLIP_RATIOS,
        ParityCase,
        divclip_config,
        make_micro_batch,
        model_output_values,
        run_erc_loss,
        with_entropy_ratios,
    )
    from verl_ext.actor_loss import divclip_actor_loss

    case = ParityCase("erc_on_vanilla", actor=case_actor, entropy=True, **data_kw)
    data = make_micro_batch(case)
    values = model_output_values(data)
    with_entropy_ratios(data, values, (1.0,))
    config = divclip_config("vanilla", case, erc_beta_low=0.99, erc_beta_high=1e6)
    ours = run_erc_loss(divclip_actor_loss, config, data, values)
    plain = make_actor_config(policy_loss=PolicyLossConfig(loss_mode="vanilla"), **{**CLIP_RATIOS, **case.actor})
    return ours, run_erc_loss(verl_losses.ppo_loss, plain, data, values)


def test_erc_on_a_verl_mode_aggregates_as_the_actor_says() -> None:
    """With every token inside a wide band, ERC on ``vanilla`` is verl's ``ppo_loss`` under the actor's
    ``loss_agg_mode`` (here ``seq-mean-token-sum``, whose loss differs from the default token mean)."""
    ours, verls = _erc_on_vanilla({"loss_agg_mode": "seq-mean-token-sum"})
    torch.testing.assert_close(ours.loss, verls.loss, rtol=0, atol=0)
    torch.testing.assert_close(ours.grads["log_probs"], verls.grads["log_probs"], rtol=0, atol=0)
    _, token_mean = _erc_on_vanilla({})
    assert not torch.allclose(token_mean.loss, verls.loss)  # the control: the mode binds on this micro-batch


def test_erc_on_a_verl_mode_reports_the_is_weights_mean() -> None:
    """The rollout-correction weights reach verl's function and their mean over valid tokens is reported."""
    ours, _ = _erc_on_vanilla({}, rollout_is_weights=True)
    (value,) = ours.metrics["actor/divclip/rollout_is_weight_mean"].values
    assert 0.5 < float(value) < 2.0  # the micro-batch's weights are drawn from [0.5, 2)


def test_erc_on_a_verl_mode_needs_both_entropies() -> None:
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.verl_modes import verl_policy_loss

    erc = DivClipPolicyLossConfig(loss_mode="vanilla", erc_beta_low=0.05, erc_beta_high=0.05)
    x = torch.zeros(1, 2)
    for old_entropy, entropy in ((x, None), (None, x)):
        with pytest.raises(ValueError, match=r"ERC on loss_mode='vanilla' needs pi_old's and pi_theta's per-token"):
            verl_policy_loss(
                "vanilla",
                old_log_prob=x,
                log_prob=x,
                advantages=x,
                response_mask=x + 1,
                loss_agg_mode="token-mean",
                config=None,
                policy=erc,
                old_entropy=old_entropy,
                entropy=entropy,
            )


def test_erc_metrics_on_a_verl_mode_count_one_valid_token_whole() -> None:
    """``_erc_metrics`` over one valid token: its ratio is the mean, the min and the max; over none, nothing."""
    from verl_ext.core.erc import entropy_ratio_band
    from verl_ext.verl_modes import _erc_metrics

    band_policy = policy(erc_beta_low=0.05, erc_beta_high=0.05, erc_eps=1.0)
    old, new = torch.tensor([[1.0, 5.0]]), torch.tensor([[2.0, 7.0]])  # (2 + 1) / (1 + 1) = 1.5 on the valid token
    one = torch.tensor([[1, 0]])
    metrics = _erc_metrics(entropy_ratio_band(old, new, one, band_policy, torch.float32), one)
    assert metrics["actor/divclip/erc/ratio_mean"] == metrics["actor/divclip/erc/ratio_max"] == 1.5
    assert metrics["actor/divclip/erc/clipfrac_upper"] == 1.0
    none = torch.zeros_like(one)
    assert _erc_metrics(entropy_ratio_band(old, new, none, band_policy, torch.float32), none) == {}


def test_the_controller_counts_every_update_and_names_the_actor_metrics_it_saw() -> None:
    from verl_ext.adaptive_delta import TOKEN_METRIC, AdaptiveDelta
    from verl_ext.config import DivClipPolicyLossConfig

    controller = AdaptiveDelta.from_policy(DivClipPolicyLossConfig(loss_mode="kl3", adaptive_delta_target=0.01))
    for _ in range(3):
        controller.update({TOKEN_METRIC: 0.01})
    assert controller.updates == 3
    with pytest.raises(KeyError, match=r"\(actor metrics: \['actor/divclip/seq_kl3_mean', 'actor/pg_loss'\]\)"):
        controller.update({"actor/pg_loss": 1.0, "critic/score": 0.5, "actor/divclip/seq_kl3_mean": 0.1})


def test_erc_on_a_verl_mode_tests_the_band_in_float32_from_bf16_entropies() -> None:
    """bf16 entropies 0.328125 -> 0.34375: rho = 1.0476 in float32, inside (0.95, 1.05); the bf16 quotient
    (with ERC's eps) is outside. The band is tested in float32, as on the divclip modes."""
    from verl.workers.config import PolicyLossConfig

    from recipe.bench.harness import make_actor_config
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.erc import entropy_ratio_band
    from verl_ext.verl_modes import verl_policy_loss

    erc = DivClipPolicyLossConfig(loss_mode="vanilla", erc_beta_low=0.05, erc_beta_high=0.05)
    old_entropy, entropy = (torch.tensor([[h]], dtype=torch.bfloat16) for h in (0.328125, 0.34375))
    mask = torch.ones(1, 1, dtype=torch.int64)
    in_bf16, in_fp32 = (entropy_ratio_band(old_entropy, entropy, mask, erc, d).outside for d in (None, torch.float32))
    assert in_bf16.item() and not in_fp32.item()  # the case binds: the two dtypes decide differently
    x = torch.zeros(1, 1)
    _, metrics = verl_policy_loss(
        "vanilla",
        old_log_prob=x,
        log_prob=x.clone().requires_grad_(True),
        advantages=x + 1,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=make_actor_config(policy_loss=PolicyLossConfig(loss_mode="vanilla")),
        policy=erc,
        old_entropy=old_entropy,
        entropy=entropy,
    )
    assert metrics["actor/divclip/erc/clipfrac_upper"] == 0.0


@pytest.mark.parametrize("dp_size, expected", [(2, 0.75), (None, 0.375)])
def test_the_micro_batch_correct_nll_reads_the_scale_factor_and_the_data_parallel_size(
    dp_size: int | None, expected: float
) -> None:
    """``correct_nll_norm=micro_batch`` under ``seq-mean-token-sum-norm``: the one correct response's token sum
    (6) over ``loss_scale_factor`` (4, not the response length 3), times the micro-batch's share of the mini-batch,
    2 rows x ``dp_size`` / 8 sequences (``dp_size`` 1 when the batch info has none)."""
    from types import SimpleNamespace

    from verl_ext.actor_loss import _correct_response_nll
    from verl_ext.config import DivClipPolicyLossConfig

    log_prob = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]], dtype=torch.float64)
    info = {"loss_scale_factor": 4.0, "global_batch_size": 8, **({"dp_size": dp_size} if dp_size else {})}
    config = SimpleNamespace(loss_agg_mode="seq-mean-token-sum-norm", global_batch_info=info)
    policy = DivClipPolicyLossConfig(loss_mode="kl3", correct_nll_coef=0.1, correct_nll_norm="micro_batch")
    nll, correct_frac = _correct_response_nll(log_prob, rewards, torch.ones(2, 3, dtype=torch.bool), policy, config)
    assert (float(nll), correct_frac) == (expected, 0.5)


def test_the_actor_loss_declares_what_its_policy_asks_of_the_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The installed loss's engine request follows the policy: the vocabulary pass only when asked, the old pass
    packed as the update unless turned off (and always for verl's own config); with key recording on, the actor
    config is bound to its key."""
    from verl.workers.config import PolicyLossConfig

    from recipe.bench.harness import make_actor_config
    from verl_ext.actor_loss import ACTOR_KEY, build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core import key_reads
    from verl_ext.engine.request import request_of

    def request(policy_loss: object) -> object:
        return request_of(build_actor_loss(make_actor_config(policy_loss=policy_loss)))

    for vocab_pass, pack in ((True, True), (False, False)):
        policy = DivClipPolicyLossConfig(loss_mode="kl3", vocab_pass=vocab_pass, pack_old_log_prob_as_update=pack)
        found = request(policy)
        assert (found.vocab_pass, found.pack_old_log_prob_as_update) == (vocab_pass, pack)
    plain = request(PolicyLossConfig(loss_mode="vanilla"))
    assert (plain.vocab_pass, plain.pack_old_log_prob_as_update) == (False, True)
    monkeypatch.setenv(key_reads.RECORD_ENV, str(tmp_path))
    config = make_actor_config(policy_loss=PolicyLossConfig(loss_mode="vanilla"))
    build_actor_loss(config)
    assert getattr(config, key_reads.ROOT_ATTR) == ACTOR_KEY


@pytest.mark.parametrize("mode", ["gspo", "dppo_tv"])
def test_the_gauge_decides_a_verl_mode_on_extreme_tokens_as_verls_function(mode: str) -> None:
    """A token whose log-prob rose by 25-30 nats: verl's GSPO takes the sequence mean of the unclamped log-ratios
        (one token at +30 among 100: s = e^0.3 = 1.35, outside (0.8, 1.25)); DPPO-TV compares p - p_old of the
        unclamped probabilities (e^-25 -> 1: outside 0.25). Clamped to +-20 first, both would fall inside
        (e^0.2 = 1.22; e^-5 - e^-25 = 0.0067). The gauge's rule (``ratio_clipfrac``) counts what verl's clip fraction
    counts with every advantage +1."""
    from tests.test_knobs import actor_config
    from tests.test_losses import run_registry_loss
    from verl_ext.actor_loss import outside_mode_rule

    old = torch.full((1, 100), -40.0 if mode == "gspo" else -25.0, dtype=torch.float32)
    new = old.clone()
    new[0, 0] = -10.0 if mode == "gspo" else 0.0
    mask = torch.ones_like(old, dtype=torch.bool)
    outside = outside_mode_rule(mode, None, old, new, mask, 0.2, 0.25)
    config = actor_config(mode, clip_ratio_low=0.2, clip_ratio_high=0.25)
    _, _, verls = run_registry_loss(mode, old, new, torch.ones_like(old), mask.float(), config)
    assert float(outside.float().mean()) == pytest.approx(verls["actor/pg_clipfrac"]) and outside.any()


def test_gspos_sequence_ratio_of_one_valid_token_is_that_tokens_ratio() -> None:
    """A row with one valid token (the rest padding): its sequence ratio is that token's w = e^0.3, outside
    (0.8, 1.2); divided by 2 it would be e^0.15, inside."""
    from verl_ext.verl_modes import VERL_MODE_READS

    log_ratio = torch.tensor([[0.3, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, False]])
    assert VERL_MODE_READS["gspo"].outside(log_ratio, torch.zeros_like(log_ratio), mask, 0.2, 0.2).all()


def test_a_restored_state_without_an_update_count_starts_counting_from_zero(tmp_path: Path) -> None:
    from verl_ext.adaptive_delta import STATE_FILE, AdaptiveDelta
    from verl_ext.config import DivClipPolicyLossConfig

    (tmp_path / STATE_FILE).write_text(json.dumps({"delta": 0.05}))
    controller = AdaptiveDelta.from_policy(DivClipPolicyLossConfig(loss_mode="kl3", adaptive_delta_target=0.01))
    assert controller.restore(str(tmp_path)) and (controller.delta, controller.updates) == (0.05, 0)


def test_a_foreign_entry_without_a_qualified_name_is_named_by_its_repr() -> None:
    """A callable without ``__qualname__`` (a ``functools.partial``) under a divclip name: the refusal names it by
    its module and its repr."""
    import functools

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_ext import registry

    ours = POLICY_LOSS_REGISTRY["gppo"]
    POLICY_LOSS_REGISTRY["gppo"] = functools.partial(print, "verl's future gppo")
    try:
        with pytest.raises(RuntimeError, match=r"\(functools\.functools\.partial\(<built-in function print>, "):
            registry.register_modes()
    finally:
        POLICY_LOSS_REGISTRY["gppo"] = ours


def test_the_registry_entry_refuses_what_it_cannot_run_naming_why() -> None:
    """Called as verl's registry would call it, outside the divclip actor loss: without the actor config; with
    the adaptive delta (the divclip trainer runs it); with the KL diagnostic (pi_old's top-k is not passed) --
    each refused with its reason; supplied the top-k, the diagnostic runs."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from tests.test_losses import actor_config
    from verl_ext.core.coarsened_kl import TopKLogMasses
    from verl_ext.registry import LossInputs, supplying

    x = torch.zeros(1, 2)
    call = dict(old_log_prob=x, log_prob=x, advantages=x, response_mask=x + 1, loss_agg_mode="token-mean")
    kl3 = get_policy_loss_fn("kl3")
    with pytest.raises(ValueError, match=r"^policy loss 'kl3' needs the actor config \(config=None\)$"):
        kl3(**call)
    adaptive = actor_config("kl3", adaptive_delta_target=0.01)
    with pytest.raises(ValueError, match=r"turns on the adaptive delta for loss_mode='kl3', which the divclip trainer"):
        kl3(**call, config=adaptive)
    diagnostic = actor_config("kl3", kl_full_diagnostic=True, kl_full_top_k=2)
    with pytest.raises(ValueError, match=r"^policy_loss\.kl_full_diagnostic needs pi_old's top-k"):
        kl3(**call, config=diagnostic)
    masses = torch.log(torch.full((1, 2, 3), 1 / 3))  # k = 2 and the tail, pi_theta = pi_old
    with supplying(LossInputs(topk=TopKLogMasses(old=masses, new=masses.clone()))):
        _, metrics = kl3(**call, config=diagnostic)
    assert any("kl_full" in name for name in metrics), sorted(metrics)  # the diagnostic ran


# -- the closed forms of verl_ext.core.divergences: their edges, refusals and reported bounds -----------------


@pytest.mark.parametrize("branch", [0, -1])
def test_lambert_w_at_its_branch_point_and_its_refusals(branch: int) -> None:
    """W(-1/e) = -1 on both branches (also from 1e-16 below, within the rounding the function forgives); a z
    further below, NaN, or z >= 0 on branch -1 is refused naming the bad value, and so is any other branch."""
    from verl_ext.core.divergences import lambert_w

    assert lambert_w(-math.exp(-1.0), branch) == -1.0
    assert lambert_w(-math.exp(-1.0) - 1e-16, branch) == -1.0
    assert lambert_w(-math.exp(-1.0) - 1e-15, branch) == -1.0  # the forgiven rounding's last value
    assert lambert_w(1.0) == pytest.approx(0.5671432904097838, rel=1e-15)  # the omega constant: branch 0 by default
    if branch == -1:  # values of scipy.special.lambertw; far from the branch point the series start fails
        for z, w in ((-1e-300, -697.3227762954601), (-4e-55, -130.12437648884395), (-0.25, -2.153292364110349)):
            assert lambert_w(z, -1) == pytest.approx(w, rel=1e-13)
    for bad in (-0.5, -math.exp(-1.0) - 1e-14, float("nan")):
        with pytest.raises(ValueError, match=r"below the branch point -1/e"):
            lambert_w(bad, branch)
    if branch == -1:
        for bad in (0.0, 0.3):
            with pytest.raises(ValueError, match=r"branch -1 needs -1/e <= z < 0, got z=" + repr(bad)):
                lambert_w(bad, -1)
    with pytest.raises(ValueError, match=r"branch must be 0 or -1, got 1"):
        lambert_w(-0.1, 1)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, float("inf"), float("nan"), "0.07", None])
def test_every_closed_form_refuses_a_delta_that_is_not_a_finite_positive_number(bad: object) -> None:
    from verl_ext.core import divergences

    for bounds in (
        divergences.kl3_ratio_bounds,
        divergences.kl1_ratio_bounds,
        divergences.kl2_ratio_bounds,
        divergences.is_kl3_ratio_bounds,
    ):
        message = r"policy_loss.delta must be a finite number > 0, got " + re.escape(repr(bad))
        with pytest.raises(ValueError, match=message):
            bounds(bad)


def test_the_kl3_and_is_kl3_bounds_take_each_end_from_its_own_branch() -> None:
    """Each end of the KL3 and IS-KL3 intervals solves its equation (w - 1 - log w = delta; w log w - w + 1 =
    delta) on its own side of 1, at delta = 1 too, where IS-KL3's lower end is w -> 0 (its limit is exactly 1)."""
    from verl_ext.core.divergences import is_kl3_ratio_bounds, kl3_ratio_bounds

    for delta in (0.07, 0.5, 1.0):
        low, high = kl3_ratio_bounds(delta)
        assert low < 1.0 < high
        for w in (low, high):
            assert w - 1.0 - math.log(w) == pytest.approx(delta, rel=1e-12)
    low, high = is_kl3_ratio_bounds(0.5)
    assert 0.0 < low < 1.0 < high
    for w in (low, high):
        assert w * math.log(w) - w + 1.0 == pytest.approx(0.5, rel=1e-12)
    low, high = is_kl3_ratio_bounds(1.0)
    assert low == 0.0 and high * math.log(high) - high + 1.0 == pytest.approx(1.0, rel=1e-12)


def test_dcpos_reported_bounds_are_the_edges_of_its_root_free_region() -> None:
    """DCPO's closed-form bounds (``actor/divclip/ratio_lower|upper``, the DCPO paper's formula) sit exactly where the
    region's root-free test ``-eps_low <= q w (w - 1) <= eps_high``, ``1/2 <= w <= cap`` changes its decision:
    a ratio 1e-9 inside either bound is inside, 1e-9 beyond is outside, for common and rare tokens (q from 0.9
    to 1e-3: the lower bound pinned at 1/2, the upper at the cap)."""
    from verl_ext.core.region import CONSTRAINTS

    q = [0.9, 0.5, 0.2, 0.05, 1e-3]
    old = [math.log(x) for x in q]
    low, high, cap = 0.2, 0.28, 4.0
    region = CONSTRAINTS["dcpo"].region(_inputs([1.0] * len(q), old, low, high, dcpo_cap=cap))
    lower, upper = region.lower.tolist(), region.upper.tolist()
    for x, lo, up in zip(q, lower, upper, strict=True):
        assert lo == pytest.approx(0.5 + 0.5 * math.sqrt(max(0.0, 1.0 - 4.0 * low / x)), rel=1e-12)
        assert up == pytest.approx(min(0.5 + 0.5 * math.sqrt(1.0 + 4.0 * high / x), cap), rel=1e-12)
    assert lower[-1] == 0.5 and upper[-1] == cap and 0.5 < lower[0] < 1.0 < upper[0] < cap
    for factor, expected in ((1 + 1e-9, [True, False]), (1 - 1e-9, [False, True])):
        points = [w for lo, up in zip(lower, upper, strict=True) for w in (lo * factor, up * factor)]
        olds = [o for o in old for _ in range(2)]
        inside = CONSTRAINTS["dcpo"].region(_inputs(points, olds, low, high, dcpo_cap=cap)).inside
        assert inside.reshape(-1, 2).tolist() == [expected] * len(q), factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_trgppos_roots_come_back_in_the_log_probs_dtype(dtype: torch.dtype) -> None:
    """The bisection runs in float64 and returns the roots in the log-probs' dtype (float32 for integer
    input); both the bisection and the table's interpolation."""
    from verl_ext.core.divergences import trgppo_ratio_bounds, trgppo_ratio_bounds_interpolated

    old = torch.tensor([-1, -2, -3]).to(dtype)
    expected = dtype if dtype.is_floating_point else torch.float32
    for lower, upper in (trgppo_ratio_bounds(old, 0.07), trgppo_ratio_bounds_interpolated(old, 0.07)):
        assert (lower.dtype, upper.dtype) == (expected, expected)
        assert bool((lower < 1).all()) and bool((upper > 1).all())


# -- verl_ext.core.coarsened_kl: pi_old's top-k over chunked rows, the tail, the defaults -------------------------


def test_pi_olds_top_k_over_rows_in_chunks_equals_the_direct_log_softmax() -> None:
    """``topk_of_rows`` / ``log_masses_of_rows`` on 130 of 150 rows, out of order, in chunks of 64 (a 65,536-token
    vocabulary's 16 MiB float32 buffer): the k most likely ids of each selected row, largest first, int32, and
    their log-masses plus the tail's (float32) equal float64 log-softmax's; no rows give empty results of the
    right shapes and dtypes."""
    from tests.loss_reference import bucket_log_masses_fp64
    from verl_ext.core.coarsened_kl import log_masses_of_rows, topk_of_rows
    from verl_ext.core.entropy import chunk_rows_for

    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(150, 65_536, generator=generator) * 3
    assert chunk_rows_for(logits) == 64
    rows = torch.randperm(150, generator=generator)[:130]
    masses, ids = topk_of_rows(logits, rows, 5)
    assert (masses.shape, masses.dtype, ids.shape, ids.dtype) == ((130, 6), torch.float32, (130, 5), torch.int32)
    expected = torch.topk(logits[rows], 5, dim=-1).indices
    assert torch.equal(ids.long(), expected)
    assert torch.allclose(masses.double(), bucket_log_masses_fp64(logits[rows], ids), atol=2e-5)
    other = torch.argsort(torch.rand(130, 65_536, generator=generator), dim=-1)[:, :3]
    again = log_masses_of_rows(logits, rows, other)
    assert again.shape == (130, 4) and again.dtype == torch.float32
    assert torch.allclose(again.double(), bucket_log_masses_fp64(logits[rows], other), atol=2e-5)
    none = torch.zeros(0, dtype=torch.long)
    half = logits[:2].bfloat16()  # empty results are float32 / int32 whatever the logits' dtype
    empty_masses, empty_ids = topk_of_rows(half, none, 5)
    assert (empty_masses.shape, empty_masses.dtype, empty_ids.shape, empty_ids.dtype) == (
        (0, 6),
        torch.float32,
        (0, 5),
        torch.int32,
    )
    empty = log_masses_of_rows(half, none, torch.zeros(0, 3, dtype=torch.int32))
    assert (empty.shape, empty.dtype) == ((0, 4), torch.float32)


def test_the_tail_masses_are_each_policys_last_bucket_and_the_default_direction_is_forward() -> None:
    from verl_ext.core.coarsened_kl import TopKLogMasses, coarsened_kl, full_kl_sums

    old = torch.tensor([[[0.5, 0.3, 0.2]]]).log()
    new = torch.tensor([[[0.6, 0.3, 0.1]]]).log()
    tail_old, tail_new = TopKLogMasses(old, new).tail_masses()
    assert tail_old.item() == pytest.approx(0.2, rel=1e-6) and tail_new.item() == pytest.approx(0.1, rel=1e-6)
    forward = 0.6 * math.log(0.6 / 0.5) + 0.1 * math.log(0.1 / 0.2)
    assert coarsened_kl(new, old).item() == pytest.approx(forward, rel=1e-6)
    assert coarsened_kl(new, old, "reverse").item() != pytest.approx(forward, rel=1e-3)
    with pytest.raises(ValueError, match=r"kl_full_direction='sideways': must be one of"):
        coarsened_kl(new, old, "sideways")
    nothing = full_kl_sums(torch.zeros(0, 0), TopKLogMasses(old[:, :0], new[:, :0]), torch.zeros(0, 0, dtype=bool))
    assert nothing["kl_full_max"].shape == () and nothing["kl_full_max"].item() == 0.0


def test_the_diagnostics_full_kl_rule_keeps_a_token_exactly_at_delta() -> None:
    """Eq. 4 keeps KL_t <= delta: a token at exactly delta is not clipped by the full-KL rule (counted in
    ``mode_only`` when the mode clips it), one just above is (``full_only`` when the mode keeps it)."""
    from verl_ext.core.coarsened_kl import diagnostic_sums

    kl = torch.tensor([[0.25, _next_double(0.25, 1.0)]], dtype=torch.float64)
    true = torch.ones(1, 2, dtype=torch.bool)
    sums = diagnostic_sums(kl, true, torch.tensor([[True, False]]), true, {"": 0.25})
    assert sums["kl_full_diag/mode_only_frac"].item() == 1
    assert sums["kl_full_diag/full_only_frac"].item() == 1


def test_the_bernoulli_kl_is_infinite_where_pi_theta_would_exceed_one_and_closed_at_delta() -> None:
    """KL(Bern(q) || Bern(q w)) is +inf where q w >= 1 (q w = 1 exactly and beyond: no Bernoulli there), finite
    below; ``bernoulli_kl_within`` keeps a token whose KL equals delta (TRGPPO's budget is closed)."""
    from verl_ext.core.divergences import bernoulli_kl, bernoulli_kl_within

    old = torch.full((4,), math.log(0.5), dtype=torch.float64)
    log_ratio = torch.tensor([math.log(2.0), math.log(3.0), math.log(2.5), math.log(1.5)], dtype=torch.float64)
    kl = bernoulli_kl(old, log_ratio)
    assert kl[:3].tolist() == [math.inf] * 3
    expected = -0.5 * math.log(1.5) + 0.5 * math.log(0.5 / 0.25)
    assert kl[3].item() == pytest.approx(expected, rel=1e-12)
    at = bernoulli_kl_within(old[3:], log_ratio[3:], kl[3].item())
    assert at.tolist() == [True]
    assert bernoulli_kl_within(old[3:], log_ratio[3:], _next_double(kl[3].item(), 0.0)).tolist() == [False]


def test_trgppos_table_covers_both_ends_and_follows_the_log_probs_device() -> None:
    """The interpolated TRGPPO bounds match the bisection next to both ends of the table's grid (q near e^-25
    and near 1), and come back on the log-probs' device (the table moves there: ``meta`` here)."""
    from verl_ext.core.divergences import trgppo_ratio_bounds, trgppo_ratio_bounds_interpolated

    old = torch.tensor([-24.9995, -24.99, -1e-3, -2e-4], dtype=torch.float64)
    exact = trgppo_ratio_bounds(old, 0.07, iterations=60)
    interpolated = trgppo_ratio_bounds_interpolated(old, 0.07)
    for e, i in zip(exact, interpolated, strict=True):
        assert (e.log().clamp(-20, 20) - i.log()).abs().max() < 1e-2
    assert (exact[1][2:].log() - interpolated[1][2:].log()).abs().max() < 1e-3
    lower, upper = trgppo_ratio_bounds_interpolated(torch.tensor([-1.0, -3.0], device="meta"), 0.07)
    assert (lower.device.type, upper.device.type, upper.shape) == ("meta", "meta", (2,))


@pytest.mark.parametrize("bad", [True, 2.0, 0, 11])
def test_a_top_k_size_must_be_an_int_within_the_vocabulary(bad: object) -> None:
    from verl_ext.core.coarsened_kl import check_top_k

    assert check_top_k(10, 10) == 10
    with pytest.raises(ValueError, match=r"=" + re.escape(repr(bad)) + r" must lie in \[1, vocabulary size 10\]"):
        check_top_k(bad, 10)  # type: ignore[arg-type]


def test_the_diagnostics_kl_means_divide_by_their_own_token_counts_even_one() -> None:
    """One clipped token (KL 0.3) and one unclipped (KL 0.1): each mean is that token's KL."""
    from verl_ext.core.coarsened_kl import finish_full_kl_metrics

    values = {"kl_full_diag/n_clipped": 1.0, "kl_full_diag/kl_clipped_sum": 0.3, "kl_full_diag/kl_unclipped_sum": 0.1}
    finish_full_kl_metrics(values, 2.0)
    assert values == {"kl_full_diag/kl_clipped_mean": 0.3, "kl_full_diag/kl_unclipped_mean": 0.1}


def test_an_empty_top_k_lives_on_the_logits_device() -> None:
    from verl_ext.core.coarsened_kl import topk_of_rows

    masses, ids = topk_of_rows(torch.zeros(4, 16, device="meta"), torch.zeros(0, dtype=torch.long), 3)
    assert (masses.device.type, ids.device.type, ids.shape) == ("meta", "meta", (0, 3))


# -- verl_ext.core.entropy: the chunked eager path ------------------------------------------------------------


def test_the_chunked_entropy_is_float32_on_the_logits_device_for_any_vocabulary_and_default_dtype() -> None:
    """``entropy_fp32`` in chunks of ``chunk_size`` rows: per-row entropies equal to float64 softmax's also when the
    vocabulary (3) is smaller than a chunk; float32 even with float64 as torch's default dtype; on the logits'
    device (``meta``)."""
    from verl_ext.core.entropy import entropy_fp32

    logits = torch.randn(10, 3, generator=torch.Generator().manual_seed(3))
    logp = torch.log_softmax(logits.double(), dim=-1)
    expected = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(entropy_fp32(logits, chunk_size=4).double(), expected, rtol=1e-5)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert entropy_fp32(logits, chunk_size=4).dtype == torch.float32
        assert entropy_fp32(logits[:3], chunk_size=4).dtype == torch.float32  # fewer rows than a chunk: one call
    finally:
        torch.set_default_dtype(previous)
    on_meta = entropy_fp32(torch.zeros(10, 8, device="meta"), chunk_size=4)
    assert (on_meta.device.type, on_meta.shape) == ("meta", (10,))


def test_the_compiled_entropy_runs_the_same_formula_on_the_cpu() -> None:
    """``entropy_fp32_compiled`` (``torch.compile`` of the same formula; CUDA with ``use_torch_compile`` in training)
    compiles and runs on the CPU too and agrees with the eager path to float32 summation order."""
    from verl_ext.core.entropy import entropy_fp32, entropy_fp32_compiled

    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(5)) * 4
    compiled = entropy_fp32_compiled(logits)
    assert compiled.shape == (2, 3) and compiled.dtype == torch.float32
    assert torch.allclose(compiled, entropy_fp32(logits), rtol=1e-5, atol=1e-7)


def test_the_eager_buffers_are_sized_per_device_type_over_the_vocabulary_dim() -> None:
    """One float32 ``rows x vocab`` working buffer is ``EAGER_CHUNK_BYTES`` of its device type (CUDA 256 MiB,
    CPU 16 MiB, any other type the CPU's): rows = bytes // (4 vocab) over the last dim whatever the leading dims,
    at least one row however large the vocabulary."""
    from verl_ext.core.entropy import chunk_bytes_for, chunk_rows_for

    assert chunk_bytes_for(torch.device("cuda")) == 256 << 20  # a device object: no GPU needed
    assert chunk_bytes_for(torch.device("cpu")) == chunk_bytes_for(torch.device("meta")) == 16 << 20
    assert chunk_rows_for(torch.zeros(2, 3, 65_536, device="meta")) == 64
    assert chunk_rows_for(torch.zeros(4, 1, device="meta")) == 4 << 20
    assert chunk_rows_for(torch.zeros(1, 5_000_000, device="meta")) == 1


# -- verl_ext.core.vocab_pass.bucket_log_masses: its refusals, defaults and float32 slices ------------------------


def _bucket_case(tokens: int = 9, vocab: int = 40, hidden: int = 8, k: int = 3):
    generator = torch.Generator().manual_seed(11)
    h = torch.randn(tokens, hidden, generator=generator)
    w = torch.randn(vocab, hidden, generator=generator)
    ids = torch.argsort(torch.rand(tokens, vocab, generator=generator), dim=-1)[:, :k].to(torch.int32)
    return h, w, ids


def test_bucket_log_masses_refuse_mismatched_shapes_and_foreign_ids_naming_them() -> None:
    from verl_ext.core.vocab_pass import bucket_log_masses

    h, w, ids = _bucket_case()
    cases = [
        ((h, w[:, 0], ids), r"hidden \(9, 8\) and head weight \(40,\) do not match"),
        ((h[0], w, ids), r"hidden \(8,\) and head weight \(40, 8\) do not match"),
        ((h[:, :7], w, ids), r"hidden \(9, 7\) and head weight \(40, 8\) do not match"),
        ((h, w, ids[:, 0]), r"ids \(9,\) must be \(tokens=9, k\)"),
        ((h, w, ids[:4]), r"ids \(4, 3\) must be \(tokens=9, k\)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            bucket_log_masses(*args)
    foreign = ids.clone()
    foreign[2, 1] = 40
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab=40\), got \[\d+, 40\] \(pi_old's stored "):
        bucket_log_masses(h, w, foreign)


def test_bucket_log_masses_compute_in_float32_slices_at_temperature_one_by_default() -> None:
    """The default temperature is 1; int32 ids (as pi_old's top-k is stored); the result is float32 and bit-equal
    under a float64 default dtype (the slices are float32 whatever torch's default)."""
    from verl_ext.core.vocab_pass import bucket_log_masses

    h, w, ids = _bucket_case()
    plain = bucket_log_masses(h, w, ids)
    assert plain.dtype == torch.float32 and plain.shape == (9, 4)
    assert torch.equal(plain, bucket_log_masses(h, w, ids, 1.0))
    assert not torch.allclose(plain, bucket_log_masses(h, w, ids, 2.0))
    # one row per block: the same values up to the matmul's rounding at another row count
    assert torch.allclose(plain, bucket_log_masses(h, w, ids, chunk_bytes=4 * 40), rtol=1e-5, atol=1e-6)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        again = bucket_log_masses(h, w, ids)
    finally:
        torch.set_default_dtype(previous)
    assert again.dtype == torch.float32 and torch.equal(again, plain)


def _operator_metrics(
    n_valid: int, erc: Optional[Any] = None, sequence_log_ratio: Optional[torch.Tensor] = None
) -> dict[str, float]:
    """The operator's metrics (``surrogate._metrics``) of one row of four tokens, the first ``n_valid`` valid:
    tokens 0 and 1 clipped, token 0 on the upper side, a scalar ratio interval."""
    from verl_ext.core.region import TrustRegion
    from verl_ext.core.surrogate import _metrics

    mask = torch.tensor([[True] * n_valid + [False] * (4 - n_valid)])
    log_ratio = torch.tensor([[0.4, -0.5, 0.1, 0.0]], dtype=torch.float64)
    return _metrics(
        mask,
        log_ratio,
        TrustRegion(torch.ones_like(mask), 0.8, 1.2),
        clipped=torch.tensor([[True, True, False, False]]),
        upper_side=torch.tensor([[True, False, False, True]]),
        no_grad=None,
        dual=None,
        erc=erc,
        sequence_log_ratio=sequence_log_ratio,
    )


def test_clipfrac_lower_counts_the_clipped_tokens_below_the_range() -> None:
    """Of four valid tokens one is clipped above and one below: each side's fraction a quarter, verl's
    ``pg_clipfrac`` their sum (the lower side is the total less the upper: its own key, not a renamed one)."""
    metrics = _operator_metrics(4)
    assert metrics["actor/divclip/clipfrac_upper"] == 0.25
    assert metrics["actor/divclip/clipfrac_lower"] == 0.25
    assert metrics["actor/pg_clipfrac"] == 0.5


def test_seq_kl3_mean_of_one_sequence_is_its_kl3() -> None:
    """A sequence-level constraint's ``seq_kl3_mean`` over a batch of one sequence is that sequence's KL3
    (divided by the count of sequences, 1, not by a floor above it)."""
    from verl_ext.core import divergences

    log_s = torch.tensor([0.3], dtype=torch.float64)
    metrics = _operator_metrics(4, sequence_log_ratio=log_s)
    assert metrics["actor/divclip/seq_kl3_mean"] == pytest.approx(float(divergences.kl3(log_s)[0]), rel=1e-12)
    assert metrics["actor/divclip/seq_kl3_mean"] == metrics["actor/divclip/seq_kl3_max"]


@pytest.mark.parametrize("n_valid", [0, 1])
def test_erc_extremes_are_left_out_only_when_no_token_is_valid(n_valid: int) -> None:
    """ERC's ``ratio_min`` / ``ratio_max`` are the extremes over valid tokens: with one valid token they are its
    ratio (eps = 1: (0.5 + 1) / (1 + 1) = 0.75); with none, neither is reported (an empty set has no extremes),
    while the band's counts still are."""
    from verl_ext.core.erc import entropy_ratio_band

    mask = torch.tensor([[True] * n_valid + [False] * (4 - n_valid)])
    band = entropy_ratio_band(
        torch.ones(1, 4),
        torch.tensor([[0.5, 3.0, 3.0, 3.0]]),
        mask,
        policy(erc_beta_low=0.05, erc_beta_high=0.05, erc_eps=1.0),
        torch.float64,
    )
    metrics = _operator_metrics(n_valid, erc=band)
    extremes = {key: metrics.get(f"actor/divclip/erc/ratio_{key}") for key in ("min", "max")}
    assert extremes == ({"min": 0.75, "max": 0.75} if n_valid else {"min": None, "max": None})
    assert metrics["actor/divclip/erc/clipfrac_lower"] == float(n_valid)


def test_gppo_no_grad_frac_counts_the_dual_clipped_tokens() -> None:
    """GPPO keeps a gradient on clipped tokens, so only dual-clip takes one away there: its ``no_grad_frac`` is
    ``dualclip_frac`` (> 0 on the declaration test's sweep at c = 1.5), not 0."""
    from tests.test_knobs import run_mode

    metrics = run_mode("gppo", {"dual_clip_c": 1.5}).metrics
    assert metrics["actor/divclip/dualclip_frac"] > 0.0
    assert metrics["actor/divclip/no_grad_frac"] == pytest.approx(metrics["actor/divclip/dualclip_frac"])


def _operator(
    mode: str,
    adv_scale: float = 1.0,
    dtype: torch.dtype = torch.float64,
    via: Optional[torch.dtype] = None,
    **knobs: Any,
):
    """The operator (:func:`tests.test_rollout_correction.run`, no IS weights; ERC's entropies when its knobs are
    given) on :func:`tests.test_full_kl.operator_batch` (KL from ~0 to large: ratios on both sides of every
    region, some above 1.5), its advantages times ``adv_scale``, the log-probs and advantages in ``dtype``
    (rounded to ``via`` first, when given). Returns the loss, the gradient of the log-probs, the metrics."""
    from tests.test_full_kl import operator_batch
    from tests.test_rollout_correction import run

    old, new, adv, mask, topk = operator_batch(11)
    cast = (lambda x: x.to(via).to(dtype)) if via is not None else (lambda x: x.to(dtype))  # noqa: E731
    return run(mode, knobs, cast(old), cast(new), cast(adv * adv_scale), mask, topk, None)


def test_the_operator_refuses_an_unknown_mode_and_erc_without_both_entropies_naming_them() -> None:
    """An unknown mode names itself and the known ones; ERC with either entropy missing names the mode."""
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.surrogate import constrained_policy_loss

    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    args = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)
    with pytest.raises(ValueError, match=r"loss_mode='nope' is not a divclip mode; known: \[.*'kl3'"):
        constrained_policy_loss(x, x, x, mask, mode="nope", policy=DivClipPolicyLossConfig(loss_mode="kl3"), **args)
    erc = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05)
    for entropies in ({"entropy": x}, {"old_entropy": x}, {}):
        with pytest.raises(ValueError, match=r"enable ERC for loss_mode='clip', but no per-token entropies"):
            constrained_policy_loss(x, x, x, mask, mode="clip", policy=erc, **args, **entropies)


def test_a_preserving_constraint_with_sampled_bounds_is_refused_naming_it() -> None:
    """GPPO-style preservation needs a bound per token; a constraint that reports a sample of bounds cannot."""
    from verl_ext.core.region import CONSTRAINTS, TrustRegion, define_constraint

    @define_constraint("test_sampled_preserve", on_violation="preserve")
    def sampled(inputs: Any) -> TrustRegion:
        no_bounds = inputs.ratio.new_zeros(0)
        return TrustRegion(torch.ones_like(inputs.response_mask), no_bounds, no_bounds, bounds_sampled=True)

    try:
        with pytest.raises(ValueError, match="constraint 'test_sampled_preserve' reports sampled bounds"):
            _operator("test_sampled_preserve")
    finally:
        del CONSTRAINTS["test_sampled_preserve"]


def _divclip_modes() -> list[str]:
    from verl_ext.core.region import CONSTRAINTS
    from verl_ext.core.surrogate import constrained_policy_loss  # noqa: F401  (defines the constraints)

    return sorted(CONSTRAINTS)


@pytest.mark.parametrize("mode", _divclip_modes())
def test_tokens_without_advantage_are_neither_clipped_nor_dual_clipped(mode: str) -> None:
    """Dr.GRPO gives a group of equal rewards A = 0: such a token is on neither side of the pessimistic min
    ((w - 1) A = 0) and below no dual-clip cap (A < 0 is the rule), so it counts in no clip fraction, whatever
    its ratio. Control arm: the same ratios with the batch's advantages are clipped and dual-clipped (a small
    delta: TRGPPO's bounds are wide for the batch's unlikely tokens at the default)."""
    from verl_ext.core.region import CONSTRAINTS

    knobs = {"dual_clip_c": 1.5, **({"delta": 0.005} if "delta" in CONSTRAINTS[mode].reads else {})}
    _, grad, zero = _operator(mode, adv_scale=0.0, **knobs)
    _, _, moving = _operator(mode, **knobs)
    assert moving["actor/pg_clipfrac"] > 0 and moving["actor/divclip/dualclip_frac"] > 0
    assert moving["actor/divclip/no_grad_frac"] > 0 or mode == "gppo"
    for name in ("actor/pg_clipfrac", "actor/divclip/clipfrac_upper", "actor/divclip/dualclip_frac"):
        assert zero[name] == 0.0, name
    assert zero["actor/divclip/no_grad_frac"] == 0.0
    assert not grad.any()


@pytest.mark.parametrize("mode", _divclip_modes())
def test_erc_takes_the_gradient_of_the_tokens_outside_its_band_in_every_mode(mode: str) -> None:
    """ERC is hard whatever the advantage's sign: with A = 0 (no token clipped or dual-clipped, as above) the
    tokens without a gradient are exactly those outside the entropy band, and ``no_grad_frac`` is their share --
    in the gradient-preserving mode (GPPO) as in the dropping ones."""
    _, _, metrics = _operator(mode, adv_scale=0.0, dual_clip_c=1.5, erc_beta_low=0.05, erc_beta_high=0.05)
    outside = metrics["actor/divclip/erc/clipfrac_upper"] + metrics["actor/divclip/erc/clipfrac_lower"]
    assert outside > 0.1  # the band's control: this batch's entropies move by up to 10 %
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/divclip/no_grad_frac"] == pytest.approx(outside, rel=1e-12)


@pytest.mark.parametrize("mode", ["clip", "gppo"])
def test_dual_clip_caps_a_ratio_above_c_not_at_it(mode: str) -> None:
    """``A < 0 and w > c`` (module docstring): a token whose ratio is exactly c keeps its ratio and its gradient,
    the next representable ratio above c is capped to the constant c (no gradient). c is taken from the
    computed ratio itself, so the two are equal in floating point."""
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.surrogate import constrained_policy_loss

    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[math.log(2.0), math.log(2.0)]], dtype=torch.float64)
    c = float(torch.exp(new[0, 0]))
    new[0, 1] = torch.log(torch.nextafter(torch.tensor(c, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)))
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = constrained_policy_loss(
        old,
        log_prob,
        torch.full((1, 2), -1.0, dtype=torch.float64),
        torch.ones(1, 2),
        mode=mode,
        policy=DivClipPolicyLossConfig(loss_mode=mode, dual_clip_c=c),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    loss.backward()
    ratio = torch.exp(new)
    assert ratio[0, 0] == c and ratio[0, 1] > c
    assert metrics["actor/divclip/dualclip_frac"] == 0.5
    # token-mean over 2 tokens of -(A * w): d/d log pi = w / 2 at the ratio, 0 under the cap
    assert log_prob.grad[0].tolist() == [c / 2, 0.0]


@pytest.mark.parametrize("mode", _divclip_modes())
def test_bf16_inputs_give_the_loss_of_their_values_computed_in_float32(mode: str) -> None:
    """verl's default bf16 log-probs and advantages: the operator computes in float32
    (``promote_types(bf16, float32)``), so the loss and the metrics equal, bit for bit, those of float32 inputs
    holding the same values, and the bf16 gradient is that float32 gradient rounded to bf16. (Control: the case
    tells the two apart -- the ratios of its bf16 log-probs are not bf16-exact.)"""
    knobs = {"dual_clip_c": 1.5, "erc_beta_low": 0.05, "erc_beta_high": 0.05}
    loss16, grad16, metrics16 = _operator(mode, dtype=torch.bfloat16, **knobs)
    loss32, grad32, metrics32 = _operator(mode, dtype=torch.float32, via=torch.bfloat16, **knobs)
    assert loss16.dtype == torch.float32 and grad16.dtype == torch.bfloat16
    assert loss16 == loss32
    assert torch.equal(grad16, grad32.to(torch.bfloat16))
    assert metrics16 == metrics32
    from tests.test_full_kl import operator_batch

    old, new = (x.to(torch.bfloat16) for x in operator_batch(11)[:2])
    assert not torch.equal(torch.exp(new - old).float(), torch.exp(new.float() - old.float()))


AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
BATCH_INFOS = [
    None,
    {"batch_num_tokens": 24},
    {"global_batch_size": 4},
    {"batch_num_tokens": 24, "global_batch_size": 4},
]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("info", BATCH_INFOS, ids=["no-global-counts", "tokens", "sequences", "both"])
def test_a_micro_batch_without_a_valid_token_adds_zero_whatever_global_counts_are_given(agg: str, info: Any) -> None:
    """Every aggregation, with or without the global token and sequence counts verl's ``ppo_loss`` passes: the
    loss of a micro-batch whose mask is all padding is exactly 0 with a zero gradient, never 0 / 0. Control arm:
    verl's ``agg_loss`` alone gives NaN where the count its mode divides by is not given (it counts the
    micro-batch's own: 0), and the loss of a valid token is not 0."""
    from verl.trainer.ppo.core_algos import agg_loss

    from tests.test_full_kl import run_operator

    gen = torch.Generator().manual_seed(0)
    old, new, adv = (torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    losses = []
    for mask in (torch.zeros(4, 6), torch.eye(4, 6)):
        loss, grad, _ = run_operator("kl3", old, new, adv, mask, None, loss_agg_mode=agg, global_batch_info=info)
        losses.append((float(loss), grad))
    (empty, empty_grad), (valid, _) = losses
    assert empty == 0.0 and not empty_grad.any()
    assert valid != 0.0
    reads = {"token-mean": "batch_num_tokens", "token-sum": None}.get(agg, "global_batch_size")
    alone = agg_loss(torch.ones(4, 6), torch.zeros(4, 6), agg, **(info or {}))
    assert math.isnan(alone) == (reads is not None and reads not in (info or {})), float(alone)


def test_the_step_path_metrics_are_the_seams_record_or_seam_0_without_one() -> None:
    """``actor/divclip/path/*``: a micro-batch the seam never stepped reports ``seam = 0`` (a measurement, not a
    claim); one it stepped reports each recorded feature as a float, under its own name."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_ext.actor_loss import PATH_METRIC, step_path_metrics
    from verl_ext.engine.request import STEP_PATH_KEY

    data = TensorDict({"x": torch.zeros(2, 1)}, batch_size=[2])
    assert step_path_metrics(data) == {f"{PATH_METRIC}seam": 0.0}
    tu.assign_non_tensor(data, **{STEP_PATH_KEY: {"seam": True, "vocab_pass": False, "old_log_prob_from_update": 0.5}})
    assert step_path_metrics(data) == {
        f"{PATH_METRIC}seam": 1.0,
        f"{PATH_METRIC}vocab_pass": 0.0,
        f"{PATH_METRIC}old_log_prob_from_update": 0.5,
    }


def test_a_missing_micro_batch_field_is_named_with_why_and_the_fields_present() -> None:
    from tensordict import TensorDict

    from verl_ext.actor_loss import _require

    data = TensorDict({"b": torch.zeros(1), "a": torch.zeros(1)}, batch_size=[1])
    assert _require(data, "a", "unused") == "a"
    with pytest.raises(KeyError, match=r"ERC needs it, but the micro-batch has no 'entropy' \(fields: \['a', 'b'\]\)"):
        _require(data, "entropy", "ERC needs it")


def test_erc_through_the_actor_loss_names_each_missing_entropy() -> None:
    """ERC's two entropies, each missing in turn from a call of the actor loss: pi_old's (the micro-batch's
    ``entropy``, from verl's old-log-prob pass) is named with why ERC needs it; the current one (absent from the
    engine's output, or None there) names the key that turns it on."""
    from tests.test_loss_breaks import (
        PROMPT_LENS,
        RESPONSE_LENS,
        ParityCase,
        divclip_config,
        make_micro_batch,
        model_output_values,
        run_erc_loss,
    )
    from verl_ext.actor_loss import divclip_actor_loss

    config = divclip_config("kl3", ParityCase("erc", entropy=True), erc_beta_low=0.05, erc_beta_high=0.05)
    data = make_micro_batch(ParityCase("no_old_entropy"))
    del data["entropy"]  # what verl's old-log-prob pass stores (the fixture's batch carries one)
    with pytest.raises(
        KeyError, match=r"^\"ERC needs pi_old's per-token entropy \(data\['entropy'\]\), but the micro-batch has no "
    ):
        run_erc_loss(divclip_actor_loss, config, data, model_output_values(data))
    data = make_micro_batch(ParityCase("erc", entropy=True))
    offsets = torch.tensor([0] + [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]).cumsum(0)
    log_probs = torch.nested.nested_tensor_from_jagged(model_output_values(data)["log_probs"], offsets=offsets)
    for model_output in ({"log_probs": log_probs}, {"log_probs": log_probs, "entropy": None}):
        with pytest.raises(
            ValueError,
            match=r"^ERC needs the current per-token entropy, but the engine returned none: set "
            r"actor_rollout_ref\.actor\.calculate_entropy=True$",
        ):
            divclip_actor_loss(config, model_output, data.clone())


def test_erc_without_a_bonus_runs_no_backward_through_the_current_entropy() -> None:
    """ERC with ``entropy_coeff`` 0 (the only one its config check lets through) reads the current entropy as a
    mask: the actor loss hands verl's bonus term a detached entropy, so no backward reaches it, while the
    log-probs keep their gradient. Control: verl's own ``ppo_loss`` on the same engine output does take the
    (zero) bonus term's backward through the entropy -- the effect the detach removes."""
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils import losses as verl_losses

    from recipe.bench.harness import make_actor_config
    from tests.test_loss_breaks import (
        CLIP_RATIOS,
        PROMPT_LENS,
        RESPONSE_LENS,
        ParityCase,
        divclip_config,
        make_micro_batch,
        model_output_values,
    )
    from verl_ext.actor_loss import divclip_actor_loss

    case = ParityCase("erc", entropy=True)
    data = make_micro_batch(case)
    values = model_output_values(data)
    offsets = torch.tensor([0] + [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]).cumsum(0)
    erc = divclip_config("kl3", case, erc_beta_low=0.05, erc_beta_high=0.05)
    plain = make_actor_config(policy_loss=PolicyLossConfig(loss_mode="vanilla"), **CLIP_RATIOS)
    assert erc.entropy_coeff == plain.entropy_coeff == 0
    for loss_fn, config, entropy_grad in ((divclip_actor_loss, erc, False), (verl_losses.ppo_loss, plain, True)):
        leaves = [values[key].clone().requires_grad_(True) for key in ("log_probs", "entropy")]
        model_output = {
            key: torch.nested.nested_tensor_from_jagged(leaf, offsets=offsets)
            for key, leaf in zip(("log_probs", "entropy"), leaves, strict=True)
        }
        loss, _ = loss_fn(config, model_output, data.clone())
        log_prob_grad, entropy_grad_seen = torch.autograd.grad(loss, leaves, allow_unused=True)
        assert log_prob_grad is not None and log_prob_grad.abs().sum() > 0, loss_fn
        assert (entropy_grad_seen is not None) is entropy_grad, loss_fn


def test_the_actor_loss_hands_verls_dp_group_on_to_ppo_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's engine calls the loss with ``dp_group=`` (its data-parallel group): the actor loss passes that very
    object on to verl's ``ppo_loss`` (which verl 0.9.1 accepts without reading), so a verl that reduces over it
    gets it. Control: called without one, ``ppo_loss`` sees its own default, None."""
    import verl_ext.actor_loss as actor_loss
    from tests.test_loss_breaks import ParityCase, divclip_config, make_micro_batch, model_output_values
    from tests.test_ppo_loss_parity import run_loss

    seen: list[Any] = []

    def recording(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        seen.append(dp_group)
        return ppo_loss(config, model_output, data, dp_group)

    ppo_loss = actor_loss.ppo_loss
    monkeypatch.setattr(actor_loss, "ppo_loss", recording)
    case = ParityCase("dp_group")
    config, data = divclip_config("kl3", case), make_micro_batch(case)
    group = object()
    with_group = functools.partial(actor_loss.divclip_actor_loss, dp_group=group)
    for loss_fn in (with_group, actor_loss.divclip_actor_loss):
        run_loss(loss_fn, config, data, model_output_values(data), with_entropy=False)
    assert len(seen) == 2 and seen[0] is group and seen[1] is None


@pytest.mark.parametrize(
    "mode, knobs", [("kl_full", {}), ("kl3", {"kl_full_diagnostic": True})], ids=["kl_full", "kl3_diagnostic"]
)
def test_a_mode_reading_pi_olds_top_k_names_what_is_missing(mode: str, knobs: dict[str, bool]) -> None:
    """``kl_full`` and the trust-region diagnostic read pi_old's top-k (stored by the trainer's old-log-prob pass)
    and the current one (returned by the engine seam): each missing in turn is named, with the mode."""
    from tests.test_loss_breaks import ParityCase, divclip_config, make_micro_batch, model_output_values, run_erc_loss
    from verl_ext.actor_loss import divclip_actor_loss
    from verl_ext.engine.topk_capture import NEW_TOPK_LOG_PROBS, OLD_TOPK_LOG_PROBS

    why = rf"^\"?loss_mode='{mode}' with policy_loss\.loss_mode=kl_full or kl_full_diagnostic=True needs pi_old's "
    why += "top-k, "
    config = divclip_config(mode, ParityCase(mode), **knobs)
    data = make_micro_batch(ParityCase(mode))
    with pytest.raises(KeyError, match=why + rf"stored by .*, but the micro-batch has no '{OLD_TOPK_LOG_PROBS}'"):
        run_erc_loss(divclip_actor_loss, config, data, model_output_values(data))
    data[OLD_TOPK_LOG_PROBS] = data["old_log_probs"].clone()  # present: the next check is the engine's output
    seam = r"the engine seam \(verl_ext\.engine\.seam\.install\) is not installed in this process, or the engine "
    seam += "is not one it covers$"
    missing_new = rf"stored by .*, but the engine returned no '{NEW_TOPK_LOG_PROBS}': {seam}"
    with pytest.raises(ValueError, match=why + missing_new):
        run_erc_loss(divclip_actor_loss, config, data, model_output_values(data))


def _rewarded_run(fields: dict[str, list[bool]], mask_dtype: torch.dtype = torch.int64, coef: float = 0.1) -> Any:
    """The actor loss's run on the parity micro-batch with each named reward field (1 on the last token of a
    response marked correct, else 0) and the correct-response NLL at coefficient ``coef``."""
    from tests.test_loss_breaks import (
        RESPONSE_LENS,
        ParityCase,
        divclip_config,
        make_micro_batch,
        model_output_values,
        run_erc_loss,
    )
    from tests.test_ppo_loss_parity import _nested
    from verl_ext.actor_loss import divclip_actor_loss

    data = make_micro_batch(ParityCase("nll"))
    for name, correct in fields.items():
        rows = [torch.zeros(n) for n in RESPONSE_LENS]
        for row, is_correct in zip(rows, correct, strict=True):
            row[-1] = float(is_correct)
        data[name] = _nested(rows)
    if mask_dtype is not torch.int64:
        mask = data["response_mask"]
        data["response_mask"] = _nested([row.to(mask_dtype) for row in mask.unbind()])
    config = divclip_config("kl3", ParityCase("nll"), correct_nll_coef=coef)
    return run_erc_loss(divclip_actor_loss, config, data, model_output_values(data))


def _rewarded(fields: dict[str, list[bool]], mask_dtype: torch.dtype = torch.int64) -> tuple[float, torch.Tensor]:
    """:func:`_rewarded_run` at coefficient 0.1: its ``correct_fraction`` and loss."""
    run = _rewarded_run(fields, mask_dtype)
    return float(run.metrics["actor/divclip/correct_fraction"].values[0]), run.loss


def test_the_nll_adds_its_coefficient_times_the_reported_nll_to_the_loss() -> None:
    """The correct-response NLL enters the loss as ``+ correct_nll_coef * NLL`` (the released ERC scripts' term),
    with the NLL reported as ``actor/divclip/correct_nll``: the loss at 0.1 and at 0.3 is the loss without the term
    (coefficient 0) plus that multiple of the reported, positive NLL, to float32 rounding."""
    from tests.test_loss_breaks import RESPONSE_LENS

    runs = {coef: _rewarded_run({"rm_scores": [True] * len(RESPONSE_LENS)}, coef=coef) for coef in (0.0, 0.1, 0.3)}
    assert "actor/divclip/correct_nll" not in runs[0.0].metrics
    for coef in (0.1, 0.3):
        (nll,) = runs[coef].metrics["actor/divclip/correct_nll"].values
        assert float(nll) > 0
        torch.testing.assert_close(runs[coef].loss, runs[0.0].loss + coef * float(nll), rtol=1e-6, atol=1e-7)


def test_the_nll_reads_token_level_rewards_before_rm_scores_and_names_both_when_missing() -> None:
    """verl's v1 trainer stores the rule reward as ``rm_scores`` and writes ``token_level_rewards`` back only with
    the KL in the reward: the NLL's correct responses are those of ``token_level_rewards`` where the micro-batch has
    it, else those of ``rm_scores``; with neither the loss names both. Any mask dtype verl hands over (int64, bool,
    float) gives the same loss."""
    from tests.test_loss_breaks import RESPONSE_LENS

    rows = len(RESPONSE_LENS)
    first, others = [i == 0 for i in range(rows)], [i != 0 for i in range(rows)]
    fraction, loss = _rewarded({"token_level_rewards": first, "rm_scores": others})
    assert fraction == 1 / rows
    assert _rewarded({"rm_scores": others})[0] == (rows - 1) / rows  # the control: the two fields differ
    for dtype in (torch.bool, torch.float32):
        torch.testing.assert_close(_rewarded({"token_level_rewards": first}, dtype)[1], loss, rtol=0, atol=0)
    with pytest.raises(
        KeyError,
        match=r"^\"policy_loss\.correct_nll_coef > 0 needs token_level_rewards or rm_scores, but the micro-batch has "
        r"no 'rm_scores'",
    ):
        _rewarded({})
