"""Tests that kill what the loss path's mutation score (``tools/mutation.py``, docs/benchmarks.md) found alive.

ERC's band is open: ``rho <= 1 - beta_l`` and ``rho >= 1 + beta_h`` are outside (ERC paper, Eq. 3-4), so the
edges themselves are tested with ratios that are exact in floating point; the band's tensors are in the
dtype the loss asks for, whatever the entropies' dtype.
"""

from __future__ import annotations

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
