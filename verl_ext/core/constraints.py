"""The constraints of the unified operator (ATR-GRPO Eq. 5), each method a few lines: Clip / Clip-Higher, GPPO,
KL3, KL1, KL2, IS-KL3, TRGPPO, sequence-level KL3 (Sec. 6.5), ``kl_full`` (Eq. 4) and DCPO. Everything else is the
shared operator, :mod:`verl_ext.core.surrogate`, which imports this module so that every definition is present.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_ext.core import divergences
from verl_ext.core.region import ConstraintInputs, TrustRegion, define_constraint, interval

KL_FULL_NEEDS_TOPK = (
    "policy_loss.loss_mode='kl_full' needs pi_old's top-k (stored by the old-log-prob pass) and pi_theta's "
    "log-probs on it, which verl's policy-loss registry does not pass: run training through "
    "`python -m recipe.main` (its trainer stores the top-k and installs the actor loss that reads it)"
)

#: verl's actor clip epsilons as the ratio modes read them: ``clip_ratio_low/high``, each falling back to
#: ``clip_ratio`` when null (:func:`verl_ext.config.actor_clip_ratios`).
EPSILONS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio")


@define_constraint(
    "clip",
    reads=EPSILONS,
    summary="1 − ε_l ≤ w ≤ 1 + ε_h (GRPO Clip / DAPO Clip-Higher, exact PPO: no dual-clip)",
)
def clip_region(inputs: ConstraintInputs) -> TrustRegion:
    """GRPO Clip / DAPO Clip-Higher: 1 - eps_low <= w <= 1 + eps_high (actor.clip_ratio_low/high)."""
    return interval(inputs, 1.0 - inputs.clip_ratio_low, 1.0 + inputs.clip_ratio_high)


@define_constraint(
    "gppo",
    on_violation="preserve",
    reads=(*EPSILONS, "gppo_beta_low", "gppo_beta_high"),
    summary="`clip` bounds, violations keep a β·bound gradient (GPPO, Klear-Reasoner)",
)
def gppo_region(inputs: ConstraintInputs) -> TrustRegion:
    """GPPO: the ``clip`` interval; violations keep a scaled gradient (gppo_beta_low/high)."""
    return clip_region(inputs)


@define_constraint("kl3", delta_budget=True, reads=("delta",), summary="w − 1 − log w ≤ δ (ATR-GRPO)")
def kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """ATR-GRPO: KL3_t = w - 1 - log w <= delta, i.e. w in [l_delta, u_delta] (Theorem 4.2)."""
    return interval(inputs, *_cached_bounds("kl3", inputs.policy.delta))


@define_constraint("kl1", delta_budget=True, reads=("delta",), summary="|log w| ≤ δ")
def kl1_region(inputs: ConstraintInputs) -> TrustRegion:
    """|k1| = |log w| <= delta, i.e. w in [e^-delta, e^delta] (symmetric in log-ratio)."""
    return interval(inputs, *_cached_bounds("kl1", inputs.policy.delta))


@define_constraint("kl2", delta_budget=True, reads=("delta",), summary="½(log w)² ≤ δ")
def kl2_region(inputs: ConstraintInputs) -> TrustRegion:
    """k2 = (log w)^2 / 2 <= delta, i.e. w in [e^-sqrt(2 delta), e^sqrt(2 delta)]."""
    return interval(inputs, *_cached_bounds("kl2", inputs.policy.delta))


@define_constraint("is_kl3", delta_budget=True, reads=("delta",), summary="w log w − w + 1 ≤ δ")
def is_kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """Importance-weighted KL3: w * k3(1/w) = w log w - w + 1 <= delta (see divergences)."""
    return interval(inputs, *_cached_bounds("is_kl3", inputs.policy.delta))


@define_constraint(
    "trgppo",
    delta_budget=True,
    reads=("delta", *EPSILONS),
    summary='Bernoulli KL(q ‖ q w) ≤ δ, or inside the ε clip (TRGPPO "full KL-guided")',
)
def trgppo_region(inputs: ConstraintInputs) -> TrustRegion:
    """TRGPPO "full KL-guided" bounds: w in [min(l, 1-eps_low), max(u, 1+eps_high)] where l, u
    solve KL(Bern(q) || Bern(q w)) = delta per token. Both intervals contain 1, so membership of their
    union needs no roots (KL within budget, or w within the epsilon clip); the roots, interpolated from a
    per-delta table, only feed the ``ratio_lower/upper`` metrics."""
    eps_inside = (inputs.ratio >= 1.0 - inputs.clip_ratio_low) & (inputs.ratio <= 1.0 + inputs.clip_ratio_high)
    # Only the (usually few) tokens outside the epsilon band need the KL: evaluated there, scattered back
    # (one nonzero + index_put: boolean-mask indexing costs tens of elementwise passes on CPU).
    beyond_eps = (~eps_inside).reshape(-1).nonzero().squeeze(1)
    within_budget = divergences.bernoulli_kl_within(
        inputs.old_log_prob.reshape(-1)[beyond_eps], inputs.log_ratio.reshape(-1)[beyond_eps], inputs.policy.delta
    )
    inside = eps_inside.reshape(-1).index_put((beyond_eps,), within_budget).view_as(eps_inside)
    lower, upper = divergences.trgppo_ratio_bounds_interpolated(metric_sample(inputs), inputs.policy.delta)
    lower = torch.clamp(lower, max=1.0 - inputs.clip_ratio_low)
    upper = torch.clamp(upper, min=1.0 + inputs.clip_ratio_high)
    return TrustRegion(inside, lower, upper, bounds_sampled=True)


@define_constraint(
    "seq_kl3",
    level="sequence",
    delta_budget=True,
    reads=("delta",),
    summary="s_i − 1 − log s_i ≤ δ on GSPO's sequence ratio s_i = exp(mean_t log w) (ATR-GRPO §6.5)",
)
def seq_kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """Sequence-level ATR (ATR-GRPO Sec. 6.5): KL3(s_i) <= delta for GSPO's s_i = exp(mean_t log w_{i,t}),
    ``kl3``'s bounds on s_i, which the operator passes (broadcast over the tokens) as ``inputs.ratio``."""
    return kl3_region(inputs)


@define_constraint(
    "kl_full",
    delta_budget=True,
    budget_metric="kl_full_mean",
    needs_old_topk=True,
    reads=("delta", "kl_full_top_k", "kl_full_direction"),
    summary="KL(π_θ ‖ π_old) ≤ δ per token over π_old's stored top-k + a tail bucket (ATR-GRPO Eq. 4; a lower bound "
    "of the full-vocabulary KL; `reverse`: Truly PPO)",
)
def kl_full_region(inputs: ConstraintInputs) -> TrustRegion:
    """ATR-GRPO Eq. 4's trust region on pi_old's top-k: KL_t <= delta, KL_t the coarsened KL in
    ``kl_full_direction`` (:func:`verl_ext.core.coarsened_kl.coarsened_kl`). Not a ratio interval (it depends on
    the whole distribution), so no ratio bounds are reported."""
    if inputs.full_kl is None:
        raise ValueError(KL_FULL_NEEDS_TOPK)
    no_bounds = inputs.ratio.new_zeros(0)
    return TrustRegion(inputs.full_kl <= inputs.policy.delta, no_bounds, no_bounds, bounds_sampled=True)


@define_constraint(
    "dcpo",
    reads=(*EPSILONS, "dcpo_cap"),
    summary="DCPO dynamic bounds from q = π_old(token), the upper one capped",
)
def dcpo_region(inputs: ConstraintInputs) -> TrustRegion:
    """DCPO dynamic clipping, q = pi_old(token): w in [1/2 + 1/2 sqrt(max(0, 1 - 4 eps_low/q)),
    min(1/2 + 1/2 sqrt(1 + 4 eps_high/q), cap)]. Squared, a root-free test: for w >= 1/2,
    -eps_low <= q w (w - 1) <= eps_high (and w <= cap); the bounds only feed the ``ratio_lower/upper`` metrics."""
    ratio = inputs.ratio
    spread = torch.exp(inputs.old_log_prob) * ratio * (ratio - 1.0)
    inside = (
        (ratio >= 0.5)
        & (ratio <= inputs.policy.dcpo_cap)
        & (spread >= -inputs.clip_ratio_low)
        & (spread <= inputs.clip_ratio_high)
    )
    lower, upper = divergences.dcpo_ratio_bounds(
        metric_sample(inputs), inputs.clip_ratio_low, inputs.clip_ratio_high, inputs.policy.dcpo_cap
    )
    return TrustRegion(inside, lower, upper, bounds_sampled=True)


METRIC_SAMPLE = 1024


def metric_sample(inputs: ConstraintInputs) -> torch.Tensor:
    """Old log-probs of the valid tokens among at most ``METRIC_SAMPLE`` evenly strided positions: TRGPPO's and
    DCPO's bound metrics are means over it, costing O(METRIC_SAMPLE) rather than a pass over the batch."""
    old = inputs.old_log_prob.reshape(-1)
    stride = max(1, -(-old.numel() // METRIC_SAMPLE))
    return old[::stride][inputs.response_mask.reshape(-1)[::stride]]


_SCALAR_BOUNDS: dict[str, Callable[[float], tuple[float, float]]] = {
    "kl3": divergences.kl3_ratio_bounds,
    "kl1": divergences.kl1_ratio_bounds,
    "kl2": divergences.kl2_ratio_bounds,
    "is_kl3": divergences.is_kl3_ratio_bounds,
}
_BOUNDS_CACHE: dict[tuple[str, float], tuple[float, float]] = {}


def _cached_bounds(kind: str, delta: float) -> tuple[float, float]:
    """Ratio bounds of a scalar constraint, computed once per (kind, delta)."""
    key = (kind, float(delta))
    if key not in _BOUNDS_CACHE:
        _BOUNDS_CACHE[key] = _SCALAR_BOUNDS[kind](float(delta))
    return _BOUNDS_CACHE[key]
