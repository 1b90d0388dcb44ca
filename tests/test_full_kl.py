"""kl_full: the coarsened full-vocabulary KL over pi_old's stored top-k (ATR-GRPO Eq. 4), its
constraint in the Eq. 5 operator, the KL3-vs-trust-region diagnostic and the config checks.

* with k = vocabulary the coarsened KL is the exact KL (fp64 reference, 1e-6 relative from fp32
  logits), both directions; for k < vocabulary it never exceeds it (property test, random and
  peaked distributions);
* the operator clips exactly the tokens with KL_t > delta on Eq. 5's pessimistic side (values and
  gradients against a naive loop);
* the diagnostic counts the disagreements of a mode's and the full-KL rule's decisions;
* bad knobs raise naming the key.

The engine path (top-k stored by the old-log-prob pass, pi_theta's log-masses in the update, on-policy
exactly 0 under bf16) is tests/test_full_kl_engine.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.core.coarsened_kl import TopKLogMasses, coarsened_kl, log_masses_rows, stored_bytes_per_token, topk_rows
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.surrogate import constrained_policy_loss
from verl_ext.engine.topk_capture import CAPTURE_KEY, capturing_old_topk, old_topk_request


def exact_kl(new_logits: torch.Tensor, old_logits: torch.Tensor, direction: str) -> torch.Tensor:
    """Full-vocabulary KL in float64 from the logits' definition."""
    new, old = torch.log_softmax(new_logits.double(), -1), torch.log_softmax(old_logits.double(), -1)
    weight_log, other_log = (new, old) if direction == "forward" else (old, new)
    weight = weight_log.exp()
    return torch.where(weight > 0, weight * (weight_log - other_log), 0.0).sum(-1)  # 0 log 0 = 0


def coarsened_from_logits(new_logits: torch.Tensor, old_logits: torch.Tensor, k: int, direction: str) -> torch.Tensor:
    old_masses, ids = topk_rows(old_logits, k)
    new_masses = log_masses_rows(new_logits, ids)
    return coarsened_kl(new_masses, old_masses, direction)


def logits_pair(seed: int, rows: int, vocab: int, scale: float, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(rows, vocab, generator=gen) * scale
    new = old + torch.randn(rows, vocab, generator=gen) * shift
    return new.float(), old.float()


# ----------------------------------------------------------------------------------------------
# The coarsened KL
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("scale, shift", [(1.0, 0.5), (4.0, 0.3), (0.3, 1.0)])
def test_k_equal_vocabulary_is_the_exact_kl(direction, scale, shift):
    new, old = logits_pair(0, rows=16, vocab=1000, scale=scale, shift=shift)
    got = coarsened_from_logits(new, old, k=1000, direction=direction)
    want = exact_kl(new, old, direction)
    assert (want > 1e-3).all()  # away from 0, where a relative bound means something
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    # the tail bucket is empty: log-mass -inf in both
    masses, _ = topk_rows(old, 1000)
    assert torch.isneginf(masses[:, -1]).all()


@st.composite
def distributions(draw):
    vocab = draw(st.integers(2, 300))
    rows = draw(st.integers(1, 4))
    k = draw(st.integers(1, vocab))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0, 20.0]))  # 20: peaked, a near-one-hot pi_old
    shift = draw(st.sampled_from([0.0, 0.01, 0.5, 3.0]))
    peaked_new = draw(st.booleans())
    return vocab, rows, k, seed, scale, shift, peaked_new


@settings(max_examples=150, deadline=None)
@given(distributions(), st.sampled_from(["forward", "reverse"]))
def test_smaller_k_never_exceeds_the_exact_kl(case, direction):
    vocab, rows, k, seed, scale, shift, peaked_new = case
    new, old = logits_pair(seed, rows, vocab, scale, shift)
    if peaked_new:
        new = new * 10.0
    got = coarsened_from_logits(new, old, k, direction)
    want = exact_kl(new, old, direction)
    assert torch.isfinite(got).all() and (got >= 0).all()
    # float32 log-masses: the bound holds up to their rounding
    assert (got <= want + 1e-6 * (1 + want)).all(), (got, want)
    if k == vocab:
        torch.testing.assert_close(got, want.clamp_min(0), rtol=1e-5, atol=1e-6)


def test_kl_is_monotone_in_k_and_exact_when_the_tail_has_no_mass():
    new, old = logits_pair(3, rows=8, vocab=200, scale=2.0, shift=0.7)
    values = [coarsened_from_logits(new, old, k, "forward") for k in (1, 4, 16, 64, 200)]
    for smaller, larger in zip(values, values[1:], strict=False):
        assert (smaller <= larger + 1e-7).all()
    # pi_old and pi_theta both on 3 ids only (others at -inf): k = 3 is exact
    old3 = torch.full((2, 50), -math.inf)
    new3 = torch.full((2, 50), -math.inf)
    old3[:, :3] = torch.tensor([[0.0, -1.0, -2.0], [1.0, 0.5, -0.5]])
    new3[:, :3] = torch.tensor([[0.3, -1.5, -1.0], [0.0, 1.5, -0.1]])
    torch.testing.assert_close(coarsened_from_logits(new3, old3, 3, "forward"), exact_kl(new3, old3, "forward"))


def test_on_policy_is_exactly_zero_in_bf16_and_fp32():
    for dtype in (torch.float32, torch.bfloat16):
        _, old = logits_pair(5, rows=32, vocab=500, scale=3.0, shift=0.0)
        old = old.to(dtype)
        masses, ids = topk_rows(old, 8)
        again = log_masses_rows(old, ids)
        assert torch.equal(masses, again)
        for direction in ("forward", "reverse"):
            assert torch.equal(coarsened_kl(again, masses, direction), torch.zeros(32, dtype=torch.float64))


def test_stored_bytes_and_request():
    assert stored_bytes_per_token(32) == 32 * 4 + 33 * 4
    assert old_topk_request({"loss_mode": "kl_full", "kl_full_top_k": 16}) == 16
    assert old_topk_request({"loss_mode": "kl3", "kl_full_top_k": 16}) == 0
    assert old_topk_request({"loss_mode": "kl3", "kl_full_top_k": 16, "kl_full_diagnostic": True}) == 16
    extra = {"calculate_entropy": True}
    with capturing_old_topk(extra, 8):
        assert extra[CAPTURE_KEY] == 8
    assert CAPTURE_KEY not in extra  # the reference pass that follows must not capture
    with capturing_old_topk(extra, 0):
        assert CAPTURE_KEY not in extra


# ----------------------------------------------------------------------------------------------
# The constraint in the Eq. 5 operator
# ----------------------------------------------------------------------------------------------


def operator_batch(seed: int, rows: int = 4, cols: int = 12, vocab: int = 64, k: int = 8):
    """Per-token old / new logits, the sampled token's log-probs under both, advantages, a mask."""
    gen = torch.Generator().manual_seed(seed)
    old_logits = torch.randn(rows, cols, vocab, generator=gen, dtype=torch.float64) * 2.0
    spread = torch.rand(rows, cols, 1, generator=gen, dtype=torch.float64) * 1.2  # KL from ~0 to large
    new_logits = old_logits + torch.randn(rows, cols, vocab, generator=gen, dtype=torch.float64) * spread
    tokens = torch.randint(0, vocab, (rows, cols), generator=gen)
    old_lp = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    new_lp = torch.log_softmax(new_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old_masses, ids = topk_rows(old_logits.reshape(-1, vocab), k)
    new_masses = log_masses_rows(new_logits.reshape(-1, vocab), ids)
    topk = TopKLogMasses(old=old_masses.reshape(rows, cols, k + 1), new=new_masses.reshape(rows, cols, k + 1))
    adv = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    mask = torch.ones(rows, cols, dtype=torch.bool)
    mask[0, cols // 2 :] = False
    return old_lp, new_lp, adv, mask, topk


def run_operator(mode, old_lp, new_lp, adv, mask, topk, loss_agg_mode="token-mean", global_batch_info=None, **policy):
    log_prob = new_lp.clone().requires_grad_(True)
    loss, metrics = constrained_policy_loss(
        old_lp,
        log_prob,
        adv,
        mask,
        mode=mode,
        policy=DivClipPolicyLossConfig(loss_mode=mode, **policy),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode=loss_agg_mode,
        global_batch_info=global_batch_info,
        topk=topk,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def naive_kl_full_loss(old_lp, log_prob, adv, mask, kl, delta):
    """Eq. 5 token by token: the ratio is replaced by 1 where KL_t > delta and (w - 1) A > 0."""
    total = log_prob.new_zeros(())
    for i in range(old_lp.shape[0]):
        for j in range(old_lp.shape[1]):
            if not mask[i, j]:
                continue
            w = torch.exp(log_prob[i, j] - old_lp[i, j])
            w_value = float(w.detach())
            violated = float(kl[i, j]) > delta
            pessimistic = (w_value - 1.0) * float(adv[i, j]) > 0
            coef = torch.ones_like(w) if violated and pessimistic else w
            total = total + coef * adv[i, j]
    return -total / mask.sum()


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("seed", range(3))
def test_kl_full_follows_eq5(direction, seed):
    old_lp, new_lp, adv, mask, topk = operator_batch(seed)
    delta = 0.07
    loss, grad, metrics = run_operator(
        "kl_full", old_lp, new_lp, adv, mask, topk, delta=delta, kl_full_direction=direction
    )
    kl = topk.kl(direction)
    ref_lp = new_lp.clone().requires_grad_(True)
    ref = naive_kl_full_loss(old_lp, ref_lp, adv, mask, kl, delta)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_lp.grad, rtol=1e-10, atol=1e-12)
    assert (grad == 0).any() and (grad != 0).any()  # some tokens clipped, some kept
    clipped = (kl > delta) & ((torch.exp(new_lp - old_lp) - 1) * adv > 0) & mask
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(clipped.sum() / mask.sum()))
    assert metrics["actor/divclip/kl_full_mean"] == pytest.approx(float(kl[mask].mean()))
    assert metrics["actor/divclip/kl_full_max"] == pytest.approx(float(kl[mask].max()))
    tail_old, tail_new = topk.tail_masses()
    assert metrics["actor/divclip/kl_full_tail_old"] == pytest.approx(float(tail_old[mask].mean()))
    assert metrics["actor/divclip/kl_full_tail_new"] == pytest.approx(float(tail_new[mask].mean()))
    assert metrics["actor/divclip/delta"] == delta
    assert "actor/divclip/ratio_lower" not in metrics  # no ratio interval to report


def test_kl_full_on_policy_clips_nothing():
    old_lp, _, adv, mask, topk = operator_batch(7)
    on_policy = TopKLogMasses(old=topk.old, new=topk.old.clone())
    _, grad, metrics = run_operator("kl_full", old_lp, old_lp, adv, mask, on_policy, delta=1e-9)
    assert metrics["actor/divclip/kl_full_max"] == 0.0
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert (grad[mask] != 0).all()


def test_kl_full_without_topk_names_the_fix():
    old_lp, new_lp, adv, mask, _ = operator_batch(0)
    with pytest.raises(ValueError, match="top-k"):
        run_operator("kl_full", old_lp, new_lp, adv, mask, None)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=DivClipPolicyLossConfig(loss_mode="kl_full"),
    )
    with pytest.raises(ValueError, match="recipe.main"):
        get_policy_loss_fn("kl_full")(
            old_log_prob=old_lp,
            log_prob=new_lp,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="token-mean",
            config=config,
        )


def test_kl_full_is_a_budget_mode_with_its_own_adaptive_metric():
    from verl_ext.adaptive_delta import FULL_KL_METRIC, AdaptiveDelta

    assert CONSTRAINTS["kl_full"].delta_budget
    controller = AdaptiveDelta.from_policy(DivClipPolicyLossConfig(loss_mode="kl_full", adaptive_delta_target=0.02))
    assert controller.metric == FULL_KL_METRIC == "actor/divclip/kl_full_mean"
    assert controller.update({FULL_KL_METRIC: 1.0}) and controller.delta < 0.07


# ----------------------------------------------------------------------------------------------
# The diagnostic
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["kl3", "clip", "kl_full", "dcpo"])
def test_diagnostic_counts_disagreements(mode):
    from verl_ext.core import divergences

    old_lp, new_lp, adv, mask, topk = operator_batch(4, rows=6, cols=20)
    _, _, with_diag = run_operator(mode, old_lp, new_lp, adv, mask, topk, kl_full_diagnostic=True)
    _, _, without = run_operator(mode, old_lp, new_lp, adv, mask, topk)
    assert not any(k.startswith("actor/divclip/kl_full_diag/") for k in without)
    kl = topk.kl("forward")
    ratio = torch.exp(new_lp - old_lp)
    pessimistic = (ratio - 1) * adv > 0
    n = float(mask.sum())
    # the mode's decisions, from its own clip fraction (clipfrac = fraction clipped on Eq. 5's side)
    if mode == "kl3":
        lower, upper = divergences.kl3_ratio_bounds(0.07)
        mode_clipped = ((ratio < lower) | (ratio > upper)) & pessimistic & mask
    elif mode == "clip":
        mode_clipped = ((ratio < 0.8) | (ratio > 1.28)) & pessimistic & mask
    elif mode == "kl_full":
        mode_clipped = (kl > 0.07) & pessimistic & mask
    else:
        mode_clipped = None
    full_clipped = (kl > 0.07) & pessimistic & mask
    if mode_clipped is not None:
        assert with_diag["actor/divclip/kl_full_diag/mode_only_frac"] == pytest.approx(
            float((mode_clipped & ~full_clipped).sum()) / n
        )
        assert with_diag["actor/divclip/kl_full_diag/full_only_frac"] == pytest.approx(
            float((full_clipped & ~mode_clipped).sum()) / n
        )
        assert with_diag["actor/divclip/kl_full_diag/kl_clipped_mean"] == pytest.approx(
            float(kl[mode_clipped].mean()) if mode_clipped.any() else 0.0
        )
        assert with_diag["actor/divclip/kl_full_diag/kl_unclipped_mean"] == pytest.approx(
            float(kl[mask & ~mode_clipped].mean())
        )
    if mode == "kl_full":  # the rule against itself
        assert with_diag["actor/divclip/kl_full_diag/mode_only_frac"] == 0.0
        assert with_diag["actor/divclip/kl_full_diag/full_only_frac"] == 0.0
    if mode == "clip":  # the KL3 budget of [0.8, 1.28]
        kl3_delta = max(0.8 - 1 - math.log(0.8), 0.28 - math.log(1.28))
        full_at = (kl > kl3_delta) & pessimistic & mask
        assert with_diag["actor/divclip/kl_full_diag/full_only_frac_kl3delta"] == pytest.approx(
            float((full_at & ~mode_clipped).sum()) / n
        )
    if mode in ("kl_full", "dcpo"):  # no scalar ratio bounds: no KL3 budget to compare at
        assert "actor/divclip/kl_full_diag/mode_only_frac_kl3delta" not in with_diag
    # the diagnostic changes no loss value: the same metrics otherwise
    assert with_diag["actor/pg_clipfrac"] == without["actor/pg_clipfrac"]


# ----------------------------------------------------------------------------------------------
# Config checks
# ----------------------------------------------------------------------------------------------


def test_k_larger_than_the_logits_raises_naming_the_key():
    with pytest.raises(ValueError, match=r"kl_full_top_k=65"):
        topk_rows(torch.zeros(2, 64), 65)


def test_a_vocab_pass_step_whose_head_never_ran_raises() -> None:
    """Under the vocabulary pass the top-k comes from the head's observer: a step whose head never
    called it raises when the outputs are collected instead of storing nothing."""
    from verl_ext.engine.topk_capture import TopKStep

    step = TopKStep(micro_batch=None, capture_k=4, old_ids=None)
    assert step.requested_top_k(vocab=16) == 4
    with pytest.raises(ValueError, match=r"kl_full_top_k=4 must lie in \[1, vocabulary size 3\]"):
        step.requested_top_k(vocab=3)
    with pytest.raises(RuntimeError, match="head never ran"):
        step.model_outputs()
