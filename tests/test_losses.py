"""The unified divergence-constrained surrogate: theorems, every mode against a naive
reference (values and gradients), GPPO/dual-clip/ERC behaviours and config validation."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import FSDPActorConfig

from tests.loss_reference import RefKnobs, reference_bounds_dcpo, reference_loss
from verl_ext.config import DivClipPolicyLossConfig, check_clip_ratios
from verl_ext.core import divergences
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.surrogate import constrained_policy_loss

MODES = ["clip", "gppo", "kl3", "kl1", "kl2", "is_kl3", "trgppo", "dcpo", "seq_kl3"]


def actor_config(mode: str, eps_low: float = 0.2, eps_high: float = 0.28, clip_ratio_c: float = 3.0, **policy):
    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=eps_low,
        clip_ratio_high=eps_high,
        clip_ratio_c=clip_ratio_c,
        policy_loss=DivClipPolicyLossConfig(loss_mode=mode, **policy),
    )


def run_registry_loss(mode, old, new, adv, mask, config, old_entropy=None, entropy=None, **kwargs):
    """verl's registry entry of ``mode``; ERC's entropies reach it as the actor loss gives them (``supplying``)."""
    from verl_ext.registry import LossInputs, supplying

    log_prob = new.clone().requires_grad_(True)
    given = old_entropy is not None or entropy is not None
    with supplying(LossInputs(old_entropy=old_entropy, entropy=entropy)) if given else contextlib.nullcontext():
        loss, metrics = get_policy_loss_fn(mode)(
            old_log_prob=old,
            log_prob=log_prob,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="token-mean",
            config=config,
            **kwargs,
        )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def naive_ppo_clip_loss(old, new, adv, mask, eps_low, eps_high):
    """Textbook PPO/DAPO clip, -min(wA, clip(w)A), token-mean (no dual-clip)."""
    log_prob = new.clone().requires_grad_(True)
    w = torch.exp(log_prob - old)
    surrogate = torch.min(w * adv, torch.clamp(w, 1 - eps_low, 1 + eps_high) * adv)
    loss = -(surrogate * mask).sum() / mask.sum()
    loss.backward()
    return log_prob.grad


def random_batch(seed: int, rows: int = 6, cols: int = 24, spread: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 4 - 0.01
    new = torch.clamp(old + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * spread, max=0.0)
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, cols).contiguous()
    mask = torch.ones(rows, cols, dtype=torch.float64)
    mask[0, cols // 2 :] = 0
    return old, new, adv, mask


def mode_bounds(mode: str, old_log_prob: float, knobs: RefKnobs) -> tuple[float, float]:
    """Ratio interval of a mode for one token, for placing test points around it."""
    if mode in ("clip", "gppo"):
        return 1 - knobs.eps_low, 1 + knobs.eps_high
    if mode == "dcpo":
        return reference_bounds_dcpo(math.exp(old_log_prob), knobs)
    if mode == "trgppo":
        lower, upper = divergences.trgppo_ratio_bounds(torch.tensor([old_log_prob], dtype=torch.float64), knobs.delta)
        return min(float(lower), 1 - knobs.eps_low), max(float(upper), 1 + knobs.eps_high)
    return {
        "kl3": divergences.kl3_ratio_bounds,
        "seq_kl3": divergences.kl3_ratio_bounds,
        "kl1": divergences.kl1_ratio_bounds,
        "kl2": divergences.kl2_ratio_bounds,
        "is_kl3": divergences.is_kl3_ratio_bounds,
    }[mode](knobs.delta)


def boundary_batch(mode: str, knobs: RefKnobs):
    """Ratios just inside, just outside and far beyond both bounds, at 1, for A of both signs."""
    if CONSTRAINTS[mode].level == "sequence":
        return sequence_boundary_batch(knobs)
    olds, news, advs = [], [], []
    for old in (-0.05, -0.7, -2.5):
        lower, upper = mode_bounds(mode, old, knobs)
        ratios = [
            1.0,
            lower * (1 + 1e-4),
            lower * (1 - 1e-4),
            lower * 0.3,
            upper * (1 - 1e-4),
            upper * (1 + 1e-4),
            upper * 4,
        ]
        for ratio in ratios:
            # keep the new probability a probability (the trgppo upper root can reach 1/q)
            new = min(old + math.log(max(ratio, 1e-30)), 0.0)
            for adv in (1.0, -1.0, 0.5, -2.0):
                olds.append(old)
                news.append(new)
                advs.append(adv)
    shape = (1, len(olds))
    as_t = lambda v: torch.tensor(v, dtype=torch.float64).reshape(shape)  # noqa: E731
    return as_t(olds), as_t(news), as_t(advs), torch.ones(shape, dtype=torch.float64)


def sequence_boundary_batch(knobs: RefKnobs, cols: int = 7):
    """One sequence per row whose ratio s_i = exp(mean log w) sits at 1, just inside, just outside
    and far beyond both KL3 bounds, and at the +-20 log-ratio clamp; token log-ratios spread
    around log s_i, valid lengths 3..cols (masked tails), advantages +, -, and mixed per token,
    plus a fully masked row."""
    lower, upper = divergences.kl3_ratio_bounds(knobs.delta)
    targets = [
        1.0,
        lower * (1 + 1e-4),
        lower * (1 - 1e-4),
        lower * 0.3,
        upper * (1 - 1e-4),
        upper * (1 + 1e-4),
        upper * 4,
        math.exp(-20),
        math.exp(20),
    ]
    advantage_rows = ([1.0] * cols, [-1.0] * cols, [0.5, -2.0, 1.5, -0.3, 2.0, -1.0, 0.7][:cols])
    olds, news, advs, masks = [], [], [], []
    for k, target in enumerate(targets):
        for adv_row in advantage_rows:
            length = 3 + (k + len(olds)) % (cols - 2)
            spread = torch.linspace(-0.4, 0.4, length, dtype=torch.float64)
            log_ratio = math.log(target) + (spread - spread.mean())
            if abs(math.log(target)) >= 20:  # beyond the clamp: every token at or past +-20
                log_ratio = math.copysign(1, math.log(target)) * (20 + torch.arange(length, dtype=torch.float64))
            old = torch.full((cols,), -30.0 if target > 1 else -1.5, dtype=torch.float64)
            new = old.clone()
            new[:length] = old[:length] + log_ratio
            new[length:] = 0.3  # padding: garbage that must not count
            olds.append(old)
            news.append(new)
            advs.append(torch.tensor(adv_row, dtype=torch.float64))
            masks.append((torch.arange(cols) < length).double())
    olds.append(torch.full((cols,), -1.0, dtype=torch.float64))
    news.append(torch.full((cols,), -0.1, dtype=torch.float64))
    advs.append(torch.ones(cols, dtype=torch.float64))
    masks.append(torch.zeros(cols, dtype=torch.float64))  # a fully masked row
    return torch.stack(olds), torch.stack(news), torch.stack(advs), torch.stack(masks)


# ----------------------------------------------------------------------------------------
# Theorem 4.1: the general operator with the ratio constraint has PPO clipping's gradient.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_theorem_4_1_clip_gradient_equals_ppo_and_vanilla(seed):
    old, new, adv, mask = random_batch(seed)
    _, grad, _ = run_registry_loss("clip", old, new, adv, mask, actor_config("clip"))
    expected = naive_ppo_clip_loss(old, new, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    # verl's vanilla always applies dual-clip; a huge c disables it.
    vanilla = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=1e12,
    )
    _, vanilla_grad, _ = run_registry_loss("vanilla", old, new, adv, mask, vanilla)
    torch.testing.assert_close(grad, vanilla_grad, rtol=1e-10, atol=1e-12)
    assert (grad != 0).any() and (grad == 0).any(), "batch must exercise both kept and clipped tokens"


def test_clip_is_not_dual_clipped_by_default():
    """verl's vanilla drops tokens with A < 0 and w > 3; exact PPO/DAPO keeps their gradient."""
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    new = old + math.log(5.0)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    mask = torch.ones_like(old)
    _, grad, _ = run_registry_loss("clip", old, new, adv, mask, actor_config("clip"))
    assert grad.item() == pytest.approx(5.0)  # d(-wA)/dlog pi = -A w
    _, grad_dual, metrics = run_registry_loss("clip", old, new, adv, mask, actor_config("clip", dual_clip_c=3.0))
    assert grad_dual.item() == 0.0
    assert metrics["actor/divclip/dualclip_frac"] == 1.0


@pytest.mark.parametrize("seed", range(3))
def test_dual_clip_matches_vanilla_values_and_gradients(seed):
    old, new, adv, mask = random_batch(seed, spread=1.5)
    cfg = actor_config("clip", eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    loss, grad, _ = run_registry_loss("clip", old, new, adv, mask, cfg)
    vanilla = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    _, vanilla_grad, _ = run_registry_loss("vanilla", old, new, adv, mask, vanilla)
    torch.testing.assert_close(grad, vanilla_grad, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------
# Theorem 4.2: KL3 <= delta  <=>  w in [l_delta, u_delta].
# ----------------------------------------------------------------------------------------


def test_theorem_4_2_paper_numbers():
    lower, upper = divergences.kl3_ratio_bounds(0.07)
    assert round(lower, 3) == 0.671 and round(upper, 3) == 1.422


@pytest.mark.parametrize("delta", [1e-4, 1e-3, 0.01, 0.03, 0.07, 0.1, 0.3, 1.0, 3.0, 10.0])
def test_theorem_4_2_bounds_solve_kl3_and_are_asymmetric(delta):
    lower, upper = divergences.kl3_ratio_bounds(delta)
    kl3 = lambda w: w - 1 - math.log(w)  # noqa: E731
    assert kl3(lower) == pytest.approx(delta, rel=1e-9)
    assert kl3(upper) == pytest.approx(delta, rel=1e-9)
    assert 0 < lower < 1 < upper
    assert 1 - lower < upper - 1
    gen = torch.Generator().manual_seed(int(delta * 1e4))
    w = torch.exp(torch.randn(20000, generator=gen, dtype=torch.float64) * 2)
    by_divergence = divergences.kl3(torch.log(w)) <= delta
    by_bounds = (w >= lower) & (w <= upper)
    # disagreement only possible within rounding of the boundary
    disagree = by_divergence != by_bounds
    assert torch.all((w[disagree] / lower - 1).abs().lt(1e-9) | (w[disagree] / upper - 1).abs().lt(1e-9))


@pytest.mark.parametrize("seed", range(3))
def test_theorem_4_2_kl3_gradient_equals_clip_with_lambert_bounds(seed):
    lower, upper = divergences.kl3_ratio_bounds(0.07)
    old, new, adv, mask = random_batch(seed)
    _, kl3_grad, _ = run_registry_loss("kl3", old, new, adv, mask, actor_config("kl3", delta=0.07))
    clip_cfg = actor_config("clip", eps_low=1 - lower, eps_high=upper - 1)
    _, clip_grad, _ = run_registry_loss("clip", old, new, adv, mask, clip_cfg)
    torch.testing.assert_close(kl3_grad, clip_grad, rtol=1e-10, atol=1e-12)


def test_lambert_w_against_scipy():
    scipy_special = pytest.importorskip("scipy.special")
    for z in [-0.3678, -0.36, -0.3, -0.1, -1e-3, -1e-9]:
        for branch in (0, -1):
            assert divergences.lambert_w(z, branch) == pytest.approx(scipy_special.lambertw(z, branch).real, rel=1e-9)
    for z in [0.0, 1e-6, 0.5, 3.0, 100.0, 1e8]:
        assert divergences.lambert_w(z, 0) == pytest.approx(scipy_special.lambertw(z, 0).real, rel=1e-9, abs=1e-15)
    with pytest.raises(ValueError, match="branch"):
        divergences.lambert_w(0.5, -1)


def test_lambert_w_residual_near_branch_point():
    """scipy loses accuracy within 1e-10 of -1/e; check w e^w = z directly there."""
    for offset in (1e-14, 1e-12, 1e-10):
        z = -1 / math.e + offset
        for branch, side in ((0, 1), (-1, -1)):
            w = divergences.lambert_w(z, branch)
            assert side * (w + 1) > 0
            assert w * math.exp(w) == pytest.approx(z, rel=1e-13, abs=1e-16)


@pytest.mark.parametrize(
    "bounds, divergence",
    [
        (divergences.kl1_ratio_bounds, lambda w: abs(math.log(w))),
        (divergences.kl2_ratio_bounds, lambda w: 0.5 * math.log(w) ** 2),
        (divergences.is_kl3_ratio_bounds, lambda w: w * math.log(w) - w + 1),
    ],
)
@pytest.mark.parametrize("delta", [0.01, 0.07, 0.5])
def test_other_scalar_bounds_solve_their_divergence(bounds, divergence, delta):
    lower, upper = bounds(delta)
    assert divergence(lower) == pytest.approx(delta, rel=1e-9)
    assert divergence(upper) == pytest.approx(delta, rel=1e-9)


def test_is_kl3_has_no_lower_bound_beyond_delta_one():
    assert divergences.is_kl3_ratio_bounds(1.5)[0] == 0.0


def test_trgppo_roots_solve_the_bernoulli_kl():
    old = torch.tensor([-0.01, -0.3, -1.0, -4.0], dtype=torch.float64)
    lower, upper = divergences.trgppo_ratio_bounds(old, 0.07)
    for a, lo, up in zip(old.tolist(), lower.tolist(), upper.tolist(), strict=False):
        q = math.exp(a)
        kl = lambda w, q=q: -q * math.log(w) + (1 - q) * math.log((1 - q) / (1 - q * w))  # noqa: E731
        assert kl(lo) == pytest.approx(0.07, rel=1e-6)
        assert kl(up) == pytest.approx(0.07, rel=1e-6)
        assert lo < 1 < up < 1 / q


@pytest.mark.parametrize("delta", [0.01, 0.07, 0.3])
def test_trgppo_interpolated_bounds_match_bisection(delta):
    old = -(torch.rand(5000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) ** 2) * 24.9 - 1e-6
    exact = divergences.trgppo_ratio_bounds(old, delta, iterations=60)
    interpolated = divergences.trgppo_ratio_bounds_interpolated(old, delta)
    for e, i in zip(exact, interpolated, strict=False):
        log_e, log_i = e.log().clamp(-20, 20), i.log()
        assert (log_i - log_e).abs().max() < 1e-2
        moderate = log_e.abs() < 15
        assert moderate.sum() > 1000
        assert (log_i - log_e)[moderate].abs().max() < 1e-3


# ----------------------------------------------------------------------------------------
# Every mode against the naive reference: values and gradients, at and beyond every bound.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_reference_around_bounds(mode):
    knobs = RefKnobs(mode=mode)
    old, new, adv, mask = boundary_batch(mode, knobs)
    loss, grad, _ = run_registry_loss(mode, old, new, adv, mask, actor_config(mode))
    ref_log_prob = new.clone().requires_grad_(True)
    ref = reference_loss(old, ref_log_prob, adv, mask, knobs)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_log_prob.grad, rtol=1e-10, atol=1e-12)
    if mode == "gppo":  # gradient-preserving: no token ever loses its gradient
        assert (grad != 0).all()
    else:
        assert (grad == 0).any() and (grad != 0).any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(2))
def test_mode_matches_reference_random(mode, seed):
    knobs = RefKnobs(mode=mode, dual_clip_c=3.0 if seed else None)
    old, new, adv, mask = random_batch(seed + 10, spread=1.0)
    config = actor_config(mode, dual_clip_c=knobs.dual_clip_c)
    loss, grad, _ = run_registry_loss(mode, old, new, adv, mask, config)
    ref_log_prob = new.clone().requires_grad_(True)
    ref = reference_loss(old, ref_log_prob, adv, mask, knobs)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_log_prob.grad, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------
# Sequence-level KL3 (ATR-GRPO Sec. 6.5).
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
@pytest.mark.parametrize("delta", [0.01, 0.07, 0.5])
def test_seq_kl3_matches_reference_around_bounds(delta, dual_clip_c):
    knobs = RefKnobs(mode="seq_kl3", delta=delta, dual_clip_c=dual_clip_c)
    old, new, adv, mask = sequence_boundary_batch(knobs)
    cfg = actor_config("seq_kl3", delta=delta, dual_clip_c=dual_clip_c)
    loss, grad, metrics = run_registry_loss("seq_kl3", old, new, adv, mask, cfg)
    ref_log_prob = new.clone().requires_grad_(True)
    ref = reference_loss(old, ref_log_prob, adv, mask, knobs)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_log_prob.grad, rtol=1e-10, atol=1e-12)
    # the decision is per sequence: a row with one advantage sign keeps or drops all its tokens
    lower, upper = divergences.kl3_ratio_bounds(delta)
    log_s = (torch.clamp(new - old, -20, 20) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    s = torch.exp(log_s)
    valid = mask.bool()
    for i in range(old.shape[0]):
        row_adv = adv[i][valid[i]]
        if not valid[i].any() or not ((row_adv > 0).all() or (row_adv < 0).all()):
            continue
        pushed_out = (s[i] > upper and row_adv[0] > 0) or (s[i] < lower and row_adv[0] < 0)
        dual = dual_clip_c is not None and row_adv[0] < 0 and s[i] > dual_clip_c
        if pushed_out or dual:
            assert (grad[i][valid[i]] == 0).all(), i
        else:
            # GSPO-token gradient: -A_t s_i / n_tokens per token; verl's +-20 clamp stops the
            # gradient of tokens whose own log-ratio lies beyond it
            unclamped = ((new - old)[i][valid[i]].abs() <= 20).double()
            assert unclamped.any()
            expected = -row_adv * s[i] / valid.sum() * unclamped
            torch.testing.assert_close(grad[i][valid[i]], expected, rtol=1e-10, atol=0)
    assert (grad[~valid] == 0).all()
    assert metrics["actor/divclip/ratio_lower"] == pytest.approx(lower)
    assert metrics["actor/divclip/ratio_upper"] == pytest.approx(upper)
    assert metrics["actor/divclip/delta"] == delta
    has_tokens = valid.any(-1)
    seq_kl3 = (s - 1 - log_s)[has_tokens]
    assert metrics["actor/divclip/seq_kl3_mean"] == pytest.approx(seq_kl3.mean().item(), rel=1e-12)
    assert metrics["actor/divclip/seq_kl3_max"] == pytest.approx(seq_kl3.max().item(), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_seq_kl3_is_gspo_with_lambert_bounds(seed):
    """With seq-mean-token-mean aggregation, seq_kl3 has the gradient of verl's ``gspo`` clipped
    at [l_delta, u_delta]: the KL3 budget on s_i is an asymmetric GSPO clip."""
    lower, upper = divergences.kl3_ratio_bounds(0.07)
    old, new, adv, mask = random_batch(seed, spread=0.25)
    mask[2, 5:] = 0

    def grad_of(mode, config):
        log_prob = new.clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn(mode)(
            old_log_prob=old,
            log_prob=log_prob,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="seq-mean-token-mean",
            config=config,
        )
        loss.backward()
        return log_prob.grad

    ours = grad_of("seq_kl3", actor_config("seq_kl3", delta=0.07))
    gspo = grad_of(
        "gspo",
        FSDPActorConfig(
            strategy="fsdp2",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            clip_ratio_low=1 - lower,
            clip_ratio_high=upper - 1,
        ),
    )
    # another implementation (other order of float operations): agreement to ~1e-9 relative
    torch.testing.assert_close(ours, gspo, rtol=1e-7, atol=1e-12)
    assert (ours == 0).any() and (ours != 0).any(), "batch must clip some sequences and keep others"


def test_seq_kl3_differs_from_token_kl3():
    """A sequence whose tokens all leave the token bounds in both directions can have s_i = 1:
    token-level kl3 drops them, seq_kl3 keeps every token's gradient."""
    old = torch.full((1, 4), -2.0, dtype=torch.float64)
    new = old + torch.tensor([[0.8, -0.8, 0.8, -0.8]], dtype=torch.float64)  # w = 2.23, 0.45
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(old)
    _, token_grad, _ = run_registry_loss("kl3", old, new, adv, mask, actor_config("kl3"))
    _, seq_grad, metrics = run_registry_loss("seq_kl3", old, new, adv, mask, actor_config("seq_kl3"))
    assert (token_grad == 0).all()
    torch.testing.assert_close(seq_grad, -adv / 4, rtol=1e-12, atol=0)  # s = 1
    assert metrics["actor/divclip/seq_kl3_mean"] == pytest.approx(0.0, abs=1e-15)
    assert metrics["actor/divclip/kl3_mean"] > 0.07  # the token-level KL3 is still reported


def test_seq_kl3_padding_garbage_changes_nothing():
    """Padded positions (even far out of range) change nothing; bf16 inputs: see
    test_bf16_inputs_give_finite_loss_and_bf16_gradient."""
    old, new, adv, mask = random_batch(2, spread=0.2)
    loss32, grad32, _ = run_registry_loss("seq_kl3", old, new, adv, mask, actor_config("seq_kl3"))
    garbage = new.clone()
    garbage[mask == 0] = 50.0
    loss_g, grad_g, _ = run_registry_loss("seq_kl3", old, garbage, adv, mask, actor_config("seq_kl3"))
    torch.testing.assert_close(loss_g, loss32, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_g, grad32, rtol=1e-12, atol=0)


def test_gppo_paper_example():
    """w = 1.5, A = 1, eps = 0.2: the clipped token still gets dL/dlog pi = -(1 + eps) = -1.2."""
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    new = old + math.log(1.5)
    adv = torch.ones_like(old)
    loss, grad, metrics = run_registry_loss("gppo", old, new, adv, torch.ones_like(old), actor_config("gppo", 0.2, 0.2))
    assert grad.item() == pytest.approx(-1.2, rel=1e-12)
    assert loss.item() == pytest.approx(-1.2, rel=1e-12)  # forward value = Clip-Higher's
    assert metrics["actor/divclip/clipfrac_upper"] == 1.0 and metrics["actor/divclip/no_grad_frac"] == 0.0
    _, clip_grad, _ = run_registry_loss("clip", old, new, adv, torch.ones_like(old), actor_config("clip", 0.2, 0.2))
    assert clip_grad.item() == 0.0


def test_gppo_general_beta_scales_clipped_gradients():
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    new = old + torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    cfg = actor_config("gppo", 0.2, 0.28, gppo_beta_low=0.5, gppo_beta_high=0.25)
    _, grad, _ = run_registry_loss("gppo", old, new, adv, torch.ones_like(old), cfg)
    # token-mean over 2 tokens: -A * beta * bound / 2
    assert grad[0, 0].item() == pytest.approx(-1.0 * 0.25 * 1.28 / 2)
    assert grad[0, 1].item() == pytest.approx(1.0 * 0.5 * 0.8 / 2)


# ----------------------------------------------------------------------------------------
# ERC (hard violation) through the core.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_erc_masks_exactly_tokens_outside_entropy_band(mode):
    old, new, adv, mask = random_batch(3, spread=0.3)
    gen = torch.Generator().manual_seed(7)
    old_entropy = torch.rand(old.shape, generator=gen, dtype=torch.float64) * 2 + 0.1
    scale = torch.tensor([0.5, 0.96, 1.0, 1.04, 1.2, 0.949], dtype=torch.float64).repeat(old.shape[1] // 6 + 1)
    entropy = old_entropy * scale[: old.shape[1]]
    knobs = RefKnobs(mode=mode, erc_beta_low=0.05, erc_beta_high=0.05)
    cfg = actor_config(mode, erc_beta_low=0.05, erc_beta_high=0.05)
    loss, grad, metrics = run_registry_loss(mode, old, new, adv, mask, cfg, old_entropy=old_entropy, entropy=entropy)
    ref_log_prob = new.clone().requires_grad_(True)
    ref = reference_loss(old, ref_log_prob, adv, mask, knobs, old_entropy, entropy)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_log_prob.grad, rtol=1e-10, atol=1e-12)
    rho = entropy / old_entropy
    outside = ((rho <= 0.95) | (rho >= 1.05)) & mask.bool()
    assert torch.all(grad[outside] == 0)
    # without ERC the same tokens would have had gradient (where the base mode keeps it)
    _, base_grad, _ = run_registry_loss(mode, old, new, adv, mask, actor_config(mode))
    assert (base_grad[outside] != 0).any()
    torch.testing.assert_close(grad[~outside], base_grad[~outside])
    valid = mask.bool()
    assert metrics["actor/divclip/erc/clipfrac_upper"] == pytest.approx(
        ((rho >= 1.05) & valid).sum().item() / valid.sum().item()
    )
    assert metrics["actor/divclip/erc/clipfrac_lower"] == pytest.approx(
        ((rho <= 0.95) & valid).sum().item() / valid.sum().item()
    )
    assert metrics["actor/divclip/erc/ratio_min"] == pytest.approx(rho[valid].min().item())
    assert metrics["actor/divclip/erc/ratio_max"] == pytest.approx(rho[valid].max().item())


def test_erc_keeps_masked_tokens_in_the_denominator():
    """Reference ERC semantics: the loss value is unchanged, only gradients are removed."""
    old, new, adv, mask = random_batch(4, spread=0.1)
    old_entropy = torch.ones_like(old)
    entropy = torch.full_like(old, 1.5)  # every token outside the band
    cfg_erc = actor_config("clip", erc_beta_low=0.05, erc_beta_high=0.05)
    loss, grad, _ = run_registry_loss("clip", old, new, adv, mask, cfg_erc, old_entropy=old_entropy, entropy=entropy)
    base_loss, _, _ = run_registry_loss("clip", old, new, adv, mask, actor_config("clip"))
    assert loss.item() == pytest.approx(base_loss.item(), rel=1e-12)
    assert torch.all(grad == 0)


def test_erc_without_entropies_names_the_fix():
    old, new, adv, mask = random_batch(0)
    cfg = actor_config("kl3", erc_beta_low=0.05, erc_beta_high=0.05)
    with pytest.raises(ValueError, match=r"recipe\.main"):
        run_registry_loss("kl3", old, new, adv, mask, cfg)


# ----------------------------------------------------------------------------------------
# Aggregation, metrics and dtype handling.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"])
def test_aggregation_uses_verl_agg_loss_with_global_batch_info(agg):
    """Two data-parallel halves with global batch info sum to the full-batch gradient."""
    old, new, adv, mask = random_batch(5)
    policy = DivClipPolicyLossConfig(loss_mode="kl3")

    def grad_of(rows, info):
        log_prob = new[rows].clone().requires_grad_(True)
        loss, _ = constrained_policy_loss(
            old[rows],
            log_prob,
            adv[rows],
            mask[rows],
            mode="kl3",
            policy=policy,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            loss_agg_mode=agg,
            global_batch_info=info,
        )
        loss.backward()
        return log_prob.grad

    full = grad_of(slice(None), {})
    info = {
        "dp_size": 2,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": mask.shape[0],
        "loss_scale_factor": None,
    }
    halves = torch.cat([grad_of(slice(0, 3), info), grad_of(slice(3, 6), info)]) / 2  # DP averages grads
    torch.testing.assert_close(halves, full, rtol=1e-10, atol=1e-12)


def test_metrics_report_bounds_and_fractions():
    old, new, adv, mask = random_batch(6, spread=1.0)
    _, _, metrics = run_registry_loss("kl3", old, new, adv, mask, actor_config("kl3"))
    lower, upper = divergences.kl3_ratio_bounds(0.07)
    assert metrics["actor/divclip/ratio_lower"] == pytest.approx(lower)
    assert metrics["actor/divclip/ratio_upper"] == pytest.approx(upper)
    w = torch.exp(new - old)
    valid = mask.bool()
    up = ((w > upper) & (adv > 0) & valid).sum().item() / valid.sum().item()
    assert metrics["actor/divclip/clipfrac_upper"] == pytest.approx(up)
    kl3 = (w - 1 - torch.log(w))[valid]
    assert metrics["actor/divclip/kl3_mean"] == pytest.approx(kl3.mean().item())
    assert metrics["actor/divclip/kl3_max"] == pytest.approx(kl3.max().item())
    _, _, trgppo_metrics = run_registry_loss("trgppo", old, new, adv, mask, actor_config("trgppo"))
    tl, tu = divergences.trgppo_ratio_bounds(old[valid], 0.07)  # < 1024 tokens: all of them
    assert trgppo_metrics["actor/divclip/ratio_lower"] == pytest.approx(
        torch.clamp(tl, max=0.8).mean().item(), rel=1e-3
    )
    assert trgppo_metrics["actor/divclip/ratio_upper"] == pytest.approx(
        torch.clamp(tu, min=1.28).mean().item(), rel=1e-3
    )
    _, _, dcpo_metrics = run_registry_loss("dcpo", old, new, adv, mask, actor_config("dcpo"))
    dl, du = divergences.dcpo_ratio_bounds(old, 0.2, 0.28, 10.0)  # < 1024 valid tokens: all sampled
    assert dcpo_metrics["actor/divclip/ratio_lower"] == pytest.approx(dl[valid].mean().item())
    assert dcpo_metrics["actor/divclip/ratio_upper"] == pytest.approx(du[valid].mean().item())


def test_bound_metrics_of_large_batches_use_a_strided_sample():
    from verl_ext.core.constraints import METRIC_SAMPLE

    old, new, adv, mask = random_batch(9, rows=8, cols=1000)
    _, _, metrics = run_registry_loss("dcpo", old, new, adv, mask, actor_config("dcpo"))
    stride = -(-old.numel() // METRIC_SAMPLE)
    sample = old.reshape(-1)[::stride][mask.bool().reshape(-1)[::stride]]
    assert 0 < sample.numel() <= METRIC_SAMPLE
    dl, _ = divergences.dcpo_ratio_bounds(sample, 0.2, 0.28, 10.0)
    assert metrics["actor/divclip/ratio_lower"] == pytest.approx(dl.mean().item())


@pytest.mark.parametrize("mode, seed, spread", [("kl3", 8, 0.6), ("seq_kl3", 2, 0.2)])
def test_bf16_inputs_give_finite_loss_and_bf16_gradient(mode, seed, spread):
    """bf16 log-probs compute in fp32 and get a bf16 gradient, token- and sequence-level."""
    old, new, adv, mask = random_batch(seed, spread=spread)
    log_prob = new.to(torch.bfloat16).requires_grad_(True)
    loss, _ = get_policy_loss_fn(mode)(
        old_log_prob=old.to(torch.bfloat16),
        log_prob=log_prob,
        advantages=adv.float(),
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=actor_config(mode),
    )
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert log_prob.grad.dtype == torch.bfloat16 and torch.isfinite(log_prob.grad).all()


# ----------------------------------------------------------------------------------------
# Config validation.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"delta": 0.0}, "delta"),
        ({"delta": -1.0}, "delta"),
        ({"delta": float("nan")}, "delta"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"dual_clip_c": 0.5}, "dual_clip_c"),
        ({"erc_beta_low": 0.0, "erc_beta_high": 0.05}, "erc_beta_low"),
        ({"erc_beta_low": 1.0, "erc_beta_high": 0.05}, "erc_beta_low"),
        ({"erc_beta_low": 0.05, "erc_beta_high": 0.0}, "erc_beta_high"),
        ({"erc_beta_low": 0.05}, "erc_beta_high"),
        ({"erc_beta_high": 0.05}, "erc_beta_low"),
        ({"erc_eps": 0.0}, "erc_eps"),
        ({"gppo_beta_low": -1.0}, "gppo_beta_low"),
        ({"dcpo_cap": 1.0}, "dcpo_cap"),
        ({"loss_mode": "kl4"}, "loss_mode"),
        # ERC stacks on verl's modes too (verl_ext.verl_modes), except where it cannot:
        ({"loss_mode": "bypass_mode", "erc_beta_low": 0.05, "erc_beta_high": 0.05}, "erc_beta_low"),
        ({"loss_mode": "sapo", "dual_clip_c": 10.0}, "dual_clip_c"),
    ],
)
def test_invalid_config_values_raise_naming_the_key(kwargs, key):
    kwargs = {"loss_mode": "kl3", **kwargs}
    with pytest.raises(ValueError, match=rf"policy_loss\.{key}"):
        DivClipPolicyLossConfig(**kwargs)


@pytest.mark.parametrize(
    "low, high, message",
    [
        (1.0, 0.2, "clip_ratio_low must lie in [0, 1), got 1.0"),
        (0.2, -0.1, "clip_ratio_high must be >= 0, got -0.1"),
        (0.0, 0.0, "clip_ratio_low/clip_ratio_high are both 0: the ratio interval [1, 1] is empty"),
        (float("nan"), 0.2, "clip_ratio_low must be a finite number, got nan"),
        (0.2, float("inf"), "clip_ratio_high must be a finite number, got inf"),
        ("0.2", 0.2, "clip_ratio_low must be a finite number, got '0.2'"),
    ],
)
def test_invalid_clip_ratios_raise_naming_the_key(low, high, message):
    with pytest.raises(ValueError) as error:
        check_clip_ratios(low, high)
    assert str(error.value) == f"actor_rollout_ref.actor.{message}"


def test_the_only_empty_ratio_interval_is_both_epsilons_zero():
    assert check_clip_ratios(0.0, 1e-9) == (0.0, 1e-9) and check_clip_ratios(1e-9, 0.0) == (1e-9, 0.0)


def test_divclip_mode_with_verl_policy_config_explains_target():
    from verl.workers.config import PolicyLossConfig

    cfg = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=PolicyLossConfig(loss_mode="kl3")
    )
    old, new, adv, mask = random_batch(0)
    with pytest.raises(
        ValueError,
        match=r"loss_mode='kl3' needs .*_target_=verl_ext\.config\.DivClipPolicyLossConfig \(got 'PolicyLossConfig'\)",
    ):
        run_registry_loss("kl3", old, new, adv, mask, cfg)


def test_every_constraint_is_registered_with_verl():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    # kl_full needs pi_old's stored top-k, which verl's registry cannot pass: tests/test_full_kl.py
    assert set(MODES) | {"kl_full"} == set(CONSTRAINTS)
    assert {mode for mode, spec in CONSTRAINTS.items() if spec.needs_old_topk} == {"kl_full"}
    assert set(CONSTRAINTS) <= set(POLICY_LOSS_REGISTRY)


@pytest.mark.parametrize(
    "scale_valid, expect",
    [
        (1.2, "min hidden"),  # every valid ratio > 1: padding's neutral 1 would read as the min
        (0.8, "max hidden"),  # every valid ratio < 1: it would read as the max
        (1.0, "on-policy"),  # every valid ratio exactly 1
    ],
)
def test_erc_extremes_are_exact_over_valid_tokens_whatever_the_padding_holds(scale_valid, expect):
    """The band is computed with padding at rho = 1 (one pass for both extremes); where that hides
    a valid extreme, finish_entropy_band_metrics computes it exactly. Entropies on padding are
    garbage here (1e6 vs 1e-6) and must not reach any metric or gradient."""
    from verl_ext.core.erc import entropy_ratio_band

    old, new, adv, mask = random_batch(11, spread=0.3)
    gen = torch.Generator().manual_seed(3)
    old_entropy = torch.rand(old.shape, generator=gen, dtype=torch.float64) + 0.5
    spread = 1 + 0.01 * torch.rand(old.shape, generator=gen, dtype=torch.float64)  # keeps one side of 1
    entropy = old_entropy * (scale_valid * spread if scale_valid != 1.0 else 1.0)
    pad = ~mask.bool()
    assert pad.any()
    old_entropy = torch.where(pad, 1e-6, old_entropy)
    entropy = torch.where(pad, 1e6, entropy)
    cfg = actor_config("clip", erc_beta_low=0.5, erc_beta_high=0.5)  # wide: nothing masked
    _, grad, metrics = run_registry_loss("clip", old, new, adv, mask, cfg, old_entropy=old_entropy, entropy=entropy)
    eps = cfg.policy_loss.erc_eps
    rho = (entropy + eps) / (old_entropy + eps)
    valid = mask.bool()
    assert metrics["actor/divclip/erc/ratio_min"] == rho[valid].min().item(), expect
    assert metrics["actor/divclip/erc/ratio_max"] == rho[valid].max().item(), expect
    assert metrics["actor/divclip/erc/ratio_mean"] == pytest.approx(rho[valid].mean().item(), rel=1e-12)
    assert metrics["actor/divclip/erc/clipfrac_upper"] == 0.0 and metrics["actor/divclip/erc/clipfrac_lower"] == 0.0
    _, base_grad, _ = run_registry_loss("clip", old, new, adv, mask, actor_config("clip"))
    assert torch.equal(grad, base_grad)  # a band that never triggers changes no gradient, bit for bit
    band = entropy_ratio_band(old_entropy, entropy, mask, cfg.policy_loss, torch.float64)
    assert torch.equal(band.rho[valid], rho[valid]) and torch.all(band.rho[pad] == 1.0)
    assert torch.all(band.keep == 1.0) and band.n_above.item() == 0 and band.n_below.item() == 0


def test_erc_band_counts_and_gate_match_a_naive_band():
    """The arithmetic band (float masks, counts by sum) against the obvious bool formulation,
    including ratios exactly on the band's edges (which are outside: rho >= 1 + beta_h,
    rho <= 1 - beta_l) and padding whose garbage entropies would fall outside."""
    from verl_ext.core.erc import entropy_ratio_band, gate_log_prob_gradient

    policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.25, erc_beta_high=0.5, erc_eps=1e-8)
    old_entropy = torch.full((2, 8), 1.0)
    entropy = torch.tensor([[0.5, 0.75, 0.76, 1.0, 1.49, 1.5, 1.51, 3.0], [1.0, 1.0, 0.2, 9.0, 1.0, 1.0, 1.0, 1.0]])
    mask = torch.ones(2, 8)
    mask[1, 2:4] = 0  # padding holding out-of-band garbage
    band = entropy_ratio_band(old_entropy, entropy, mask, policy, torch.float32)
    rho = (entropy + 1e-8) / (old_entropy + 1e-8)
    above = (rho >= 1.5) & mask.bool()
    below = (rho <= 0.75) & mask.bool()
    assert band.n_above.item() == above.sum().item() == 3
    assert band.n_below.item() == below.sum().item() == 2
    assert torch.equal(band.keep, (~(above | below)).float())
    assert torch.equal(band.outside, above | below)
    log_prob = torch.zeros(2, 8, requires_grad=True)
    gated = gate_log_prob_gradient(log_prob, band)
    assert torch.equal(gated, log_prob)
    (gated * torch.arange(1.0, 17.0).view(2, 8)).sum().backward()
    expected = torch.where(above | below, 0.0, torch.arange(1.0, 17.0).view(2, 8))
    assert torch.equal(log_prob.grad, expected)
