"""The unified divergence-constrained surrogate (ATR-GRPO Eq. 5) and its constraints.

One operator covers every token-level clip rule. For each token t a constraint C_t(theta)
is evaluated on the detached importance ratio w_t = pi_theta / pi_old. Where it holds the
token contributes the plain surrogate w_t * A_t. Where it is violated the ratio is replaced
by the constant w(theta_old) = 1 *inside PPO's pessimistic min*:

    L_t = -min(w_t A_t, w~_t A_t),   w~_t = w_t if C_t holds else 1            (Eq. 5)

so the gradient is dropped only when the update would move further outside the trust
region (w > u with A > 0, or w < l with A < 0). With C_t = {l <= w <= u} this has exactly
the gradient of PPO's ratio clipping (Theorem 4.1); with C_t = {KL3_t <= delta} it is
ATR-GRPO, equivalent to an asymmetric ratio clip (Theorem 4.2).

Three further behaviours are explicit options of the same operator, not copies of it:

* ``preserve`` violations (GPPO, Klear-Reasoner): instead of dropping, a clipped token
  keeps the Clip-Higher forward value bound * A and back-propagates beta * bound * A
  (the bound / sg(w) gradient-preserving form, with GPPO's general beta_1 / beta_2).
* ``hard`` violations (ERC): a token whose entropy ratio H_new / H_old leaves
  (1 - beta_l, 1 + beta_h) loses its gradient whatever the sign of A. Its loss value is
  kept (detached) and it still counts in the aggregation denominator, as in the reference
  ERC implementation, so ERC changes which tokens push the policy, not the loss scale.
* dual-clip (opt-in ``dual_clip_c``): for A < 0 and w > c the ratio is the constant c.

All masks are explicit ``torch.where`` selections: ``torch.minimum``/``maximum`` split the
gradient half-half on ties, which would silently halve it at the bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from verl_ext import divergences
from verl_ext.config import CONFIG_TARGET, DivClipPolicyLossConfig, check_clip_ratios

# Same clamp as verl's losses: keeps exp() finite for any log-prob difference.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class ConstraintInputs:
    """What a constraint may look at. All tensors are detached, float32 or wider."""

    log_ratio: torch.Tensor
    ratio: torch.Tensor
    old_log_prob: torch.Tensor
    response_mask: torch.Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    policy: DivClipPolicyLossConfig


@dataclass(frozen=True)
class TrustRegion:
    """Where C_t(theta) holds, and the ratio interval it amounts to.

    ``lower``/``upper`` are scalars or per-token tensors shaped like ``inside``. A constraint
    whose bounds are expensive and not needed to decide ``inside`` may instead return them
    for a sample of valid tokens (1-D) with ``bounds_sampled=True``; they then only feed the
    ``ratio_lower/upper`` metrics, and the constraint cannot use ``preserve`` violations.
    """

    inside: torch.Tensor
    lower: torch.Tensor | float
    upper: torch.Tensor | float
    bounds_sampled: bool = False


ConstraintFn = Callable[[ConstraintInputs], TrustRegion]


@dataclass(frozen=True)
class ConstraintSpec:
    """A registered constraint: how to evaluate C_t and what a violation does."""

    name: str
    region: ConstraintFn
    on_violation: Literal["drop", "preserve"] = "drop"


CONSTRAINTS: dict[str, ConstraintSpec] = {}


def register_constraint(
    name: str, on_violation: Literal["drop", "preserve"] = "drop"
) -> Callable[[ConstraintFn], ConstraintFn]:
    """Register a constraint and expose it to verl as ``policy_loss.loss_mode=<name>``."""

    def decorator(region: ConstraintFn) -> ConstraintFn:
        CONSTRAINTS[name] = ConstraintSpec(name, region, on_violation)
        register_policy_loss(name)(_make_registry_loss(name))
        return region

    return decorator


def _interval(inputs: ConstraintInputs, lower: float, upper: float) -> TrustRegion:
    ratio = inputs.ratio
    return TrustRegion((ratio >= lower) & (ratio <= upper), lower, upper)


# ----------------------------------------------------------------------------------------
# verl registry adapters.
# ----------------------------------------------------------------------------------------


def resolve_policy_config(config: Any) -> DivClipPolicyLossConfig:
    """The ``DivClipPolicyLossConfig`` inside an actor config, or a clear error."""
    policy = config.policy_loss if hasattr(config, "policy_loss") else config["policy_loss"]
    if isinstance(policy, DivClipPolicyLossConfig):
        return policy
    if isinstance(policy, Mapping) and policy.get("_target_") == CONFIG_TARGET:
        fields = {k: v for k, v in policy.items() if k != "_target_"}
        return DivClipPolicyLossConfig(**fields)
    raise TypeError(
        f"loss_mode={policy.get('loss_mode')!r} is a divclip mode and needs "
        f"actor_rollout_ref.actor.policy_loss._target_={CONFIG_TARGET} (got {type(policy).__name__}); "
        "verl's PolicyLossConfig cannot carry delta / dual_clip_c / ERC knobs"
    )


def _make_registry_loss(mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
        old_entropy: Optional[torch.Tensor] = None,
        entropy: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if config is None:
            raise ValueError(f"policy loss {mode!r} needs the actor config (config=None)")
        clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
        clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
        low, high = check_clip_ratios(clip_low, clip_high)
        return constrained_policy_loss(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            mode=mode,
            policy=resolve_policy_config(config),
            clip_ratio_low=low,
            clip_ratio_high=high,
            loss_agg_mode=loss_agg_mode,
            global_batch_info=config.get("global_batch_info", None),
            rollout_is_weights=rollout_is_weights,
            old_entropy=old_entropy,
            entropy=entropy,
        )

    policy_loss.__name__ = policy_loss.__qualname__ = f"compute_policy_loss_{mode}"
    policy_loss.__doc__ = f"verl policy loss ``{mode}``: the divclip operator with constraint {mode!r}."
    return policy_loss


# ----------------------------------------------------------------------------------------
# Constraints. Each is a few lines; everything else is the shared operator below.
# ----------------------------------------------------------------------------------------


@register_constraint("clip")
def clip_region(inputs: ConstraintInputs) -> TrustRegion:
    """GRPO Clip / DAPO Clip-Higher: 1 - eps_low <= w <= 1 + eps_high (actor.clip_ratio_low/high)."""
    return _interval(inputs, 1.0 - inputs.clip_ratio_low, 1.0 + inputs.clip_ratio_high)


@register_constraint("gppo", on_violation="preserve")
def gppo_region(inputs: ConstraintInputs) -> TrustRegion:
    """GPPO: the ``clip`` interval; violations keep a scaled gradient (gppo_beta_low/high)."""
    return clip_region(inputs)


@register_constraint("kl3")
def kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """ATR-GRPO: KL3_t = w - 1 - log w <= delta, i.e. w in [l_delta, u_delta] (Theorem 4.2)."""
    return _interval(inputs, *_cached_bounds("kl3", inputs.policy.delta))


@register_constraint("kl1")
def kl1_region(inputs: ConstraintInputs) -> TrustRegion:
    """|k1| = |log w| <= delta, i.e. w in [e^-delta, e^delta] (symmetric in log-ratio)."""
    return _interval(inputs, *_cached_bounds("kl1", inputs.policy.delta))


@register_constraint("kl2")
def kl2_region(inputs: ConstraintInputs) -> TrustRegion:
    """k2 = (log w)^2 / 2 <= delta, i.e. w in [e^-sqrt(2 delta), e^sqrt(2 delta)]."""
    return _interval(inputs, *_cached_bounds("kl2", inputs.policy.delta))


@register_constraint("is_kl3")
def is_kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """Importance-weighted KL3: w * k3(1/w) = w log w - w + 1 <= delta (see divergences)."""
    return _interval(inputs, *_cached_bounds("is_kl3", inputs.policy.delta))


@register_constraint("trgppo")
def trgppo_region(inputs: ConstraintInputs) -> TrustRegion:
    """TRGPPO "full KL-guided" bounds: w in [min(l, 1-eps_low), max(u, 1+eps_high)] where l, u
    solve KL(Bern(q) || Bern(q w)) = delta per token.

    Both intervals contain 1, so membership of their union is decided without solving for
    l and u: the Bernoulli KL is within budget, or the ratio is within the epsilon clip.
    The per-token roots are only needed for the ``ratio_lower/upper`` metrics; they are
    interpolated from a per-delta table for an evenly strided sample of at most
    ``TRGPPO_METRIC_SAMPLE`` valid tokens.
    """
    eps_inside = (inputs.ratio >= 1.0 - inputs.clip_ratio_low) & (inputs.ratio <= 1.0 + inputs.clip_ratio_high)
    # Only tokens outside the epsilon band can be rescued by the KL budget -- usually few --
    # so the Bernoulli KL is evaluated on that subset and scattered back.
    beyond_eps = ~eps_inside
    kl_ok = divergences.bernoulli_kl(inputs.old_log_prob[beyond_eps], inputs.log_ratio[beyond_eps]) <= inputs.policy.delta
    inside = eps_inside.masked_scatter(beyond_eps, kl_ok)
    valid_old = inputs.old_log_prob[inputs.response_mask]
    stride = max(1, -(-valid_old.numel() // TRGPPO_METRIC_SAMPLE))
    lower, upper = divergences.trgppo_ratio_bounds_interpolated(valid_old[::stride], inputs.policy.delta)
    lower = torch.clamp(lower, max=1.0 - inputs.clip_ratio_low)
    upper = torch.clamp(upper, min=1.0 + inputs.clip_ratio_high)
    return TrustRegion(inside, lower, upper, bounds_sampled=True)


TRGPPO_METRIC_SAMPLE = 1024


@register_constraint("dcpo")
def dcpo_region(inputs: ConstraintInputs) -> TrustRegion:
    """DCPO dynamic clipping: per-token bounds from q = pi_old(token) with
    eps_low/eps_high = actor.clip_ratio_low/high and cap = policy_loss.dcpo_cap."""
    lower, upper = divergences.dcpo_ratio_bounds(
        inputs.old_log_prob, inputs.clip_ratio_low, inputs.clip_ratio_high, inputs.policy.dcpo_cap
    )
    ratio = inputs.ratio
    return TrustRegion((ratio >= lower) & (ratio <= upper), lower, upper)


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


# ----------------------------------------------------------------------------------------
# The operator (Eq. 5).
# ----------------------------------------------------------------------------------------


def constrained_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    policy: DivClipPolicyLossConfig,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Optional[Mapping[str, Any]] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Divergence-constrained PPO surrogate, aggregated with verl's ``agg_loss``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (batch, response_length), as in
            verl's policy losses. ``log_prob`` carries the gradient.
        mode: a registered constraint name (``CONSTRAINTS``).
        policy: the ``DivClipPolicyLossConfig`` with delta, dual-clip, GPPO and ERC knobs.
        clip_ratio_low, clip_ratio_high: verl's actor clip epsilons.
        loss_agg_mode, global_batch_info: forwarded to ``agg_loss`` so token-mean,
            seq-mean-token-mean and Dr.GRPO's seq-mean-token-sum-norm stay correct under
            data parallelism.
        rollout_is_weights: optional per-token rollout-correction weights (verl).
        old_entropy, entropy: per-token entropies of pi_old and pi_theta over the full
            vocabulary, required when ERC is on. Only used as a mask, never differentiated.

    Returns:
        The scalar loss and a dict of ``actor/...`` metrics (floats).
    """
    spec = CONSTRAINTS.get(mode)
    if spec is None:
        raise ValueError(f"policy_loss.loss_mode={mode!r} is not a divclip mode; known: {sorted(CONSTRAINTS)}")
    if policy.erc_enabled and (old_entropy is None or entropy is None):
        raise ValueError(_ERC_NEEDS_ENTROPY.format(mode=mode))

    compute_dtype = torch.promote_types(log_prob.dtype, torch.float32)
    log_prob = log_prob.to(compute_dtype)
    old_log_prob = old_log_prob.detach().to(compute_dtype)
    advantages = advantages.detach().to(compute_dtype)
    mask = response_mask.bool()

    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    log_ratio_d, ratio_d = log_ratio.detach(), ratio.detach()

    region = spec.region(
        ConstraintInputs(log_ratio_d, ratio_d, old_log_prob, mask, clip_ratio_low, clip_ratio_high, policy)
    )
    outside = ~region.inside
    positive, negative = advantages > 0, advantages < 0
    # Pessimistic min of Eq. 5: a violation matters only when it lies on the side the
    # advantage pushes towards; on the other side min() keeps w * A and its gradient.
    clipped_upper = outside & (ratio_d > 1.0) & positive
    clipped_lower = outside & (ratio_d < 1.0) & negative
    clipped = clipped_upper | clipped_lower

    if spec.on_violation == "preserve":
        if region.bounds_sampled:
            raise ValueError(f"constraint {mode!r} reports sampled bounds and cannot preserve gradients")
        bound = torch.where(clipped_upper, _as_tensor(region.upper, ratio), _as_tensor(region.lower, ratio))
        beta = torch.where(clipped_upper, policy.gppo_beta_high, policy.gppo_beta_low)
        # value 1, d/dlog_ratio 1: the forward value stays `bound` (Clip-Higher), the gradient
        # is beta * bound * A -- GPPO's bound / sg(w) * w in its general beta form.
        grad_carrier = torch.exp(log_ratio - log_ratio_d)
        clipped_coef = bound * (1.0 + beta * (grad_carrier - 1.0))
        no_grad = torch.zeros_like(mask)
    else:
        clipped_coef = torch.ones_like(ratio)  # w(theta_old) = 1, a constant
        no_grad = clipped
    coef = torch.where(clipped, clipped_coef, ratio)

    dual = None
    if policy.dual_clip_c is not None:
        dual = negative & (ratio_d > policy.dual_clip_c)
        coef = torch.where(dual, torch.full_like(coef, policy.dual_clip_c), coef)
        no_grad = no_grad | dual

    erc = None
    if policy.erc_enabled:
        erc = _entropy_ratio_band(old_entropy, entropy, policy, compute_dtype)
        erc_out = erc[1] | erc[2]
        coef = torch.where(erc_out, coef.detach(), coef)  # hard: value kept, gradient gone
        no_grad = no_grad | erc_out

    loss_mat = -advantages * coef
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach().to(compute_dtype)

    batch_info = dict(global_batch_info or {})
    if not batch_info.get("batch_num_tokens") and not batch_info.get("global_batch_size") and not mask.any():
        # A micro-batch without a single valid token: agg_loss would divide 0 by 0.
        loss = (loss_mat * 0.0).sum()
    else:
        loss = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **batch_info)
    metrics = _metrics(mask, log_ratio_d, region, clipped_upper, clipped_lower, no_grad, dual, erc)
    return loss, metrics


_ERC_NEEDS_ENTROPY = (
    "policy_loss.erc_beta_low/erc_beta_high enable ERC for loss_mode={mode!r}, but no per-token "
    "entropies reached the loss: verl's policy-loss registry passes only log-probs, advantages and "
    "the mask. Run training through `python -m recipe.main` (it installs the entropy-aware actor "
    "loss on the actor workers with set_loss_fn and sets actor.calculate_entropy=True), or set "
    "erc_beta_low/erc_beta_high to null."
)


def _as_tensor(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.full_like(like, value)


def _entropy_ratio_band(
    old_entropy: torch.Tensor,
    entropy: torch.Tensor,
    policy: DivClipPolicyLossConfig,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ERC: rho_t = (H_new + eps) / (H_old + eps); returns (rho, rho >= 1+b_h, rho <= 1-b_l)."""
    eps = policy.erc_eps
    rho = (entropy.detach().to(dtype) + eps) / (old_entropy.detach().to(dtype) + eps)
    return rho, rho >= 1.0 + policy.erc_beta_high, rho <= 1.0 - policy.erc_beta_low


def _metrics(
    mask: torch.Tensor,
    log_ratio: torch.Tensor,
    region: TrustRegion,
    clipped_upper: torch.Tensor,
    clipped_lower: torch.Tensor,
    no_grad: torch.Tensor,
    dual: Optional[torch.Tensor],
    erc: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> dict[str, float]:
    """Per-micro-batch means over valid tokens, reduced with a single host sync."""
    with torch.no_grad():
        weight = mask.to(log_ratio.dtype)
        count = weight.sum()
        kl3 = divergences.kl3(log_ratio)
        names = ["clipfrac_upper", "clipfrac_lower", "no_grad_frac", "kl3_mean", "ppo_kl"]
        rows = [clipped_upper, clipped_lower, no_grad, kl3, -log_ratio]
        scalar_bounds = {}
        for name, bound in (("ratio_lower", region.lower), ("ratio_upper", region.upper)):
            if isinstance(bound, torch.Tensor):  # per-token bounds: report their mean
                # beyond e^{+-20} a bound is no bound (log-ratios are clamped there)
                bound = torch.clamp(bound, math.exp(-LOG_RATIO_CLAMP), math.exp(LOG_RATIO_CLAMP))
                if region.bounds_sampled:
                    if bound.numel():  # no valid token, no sample: the metric is left out
                        scalar_bounds[name] = bound.mean().item()
                else:
                    names.append(name)
                    rows.append(bound)
            else:
                scalar_bounds[name] = float(bound)
        if dual is not None:
            names.append("dualclip_frac")
            rows.append(dual)
        if erc is not None:
            names += ["erc/ratio_mean", "erc/clipfrac_upper", "erc/clipfrac_lower"]
            rows += list(erc)
        stacked = torch.stack([row.to(weight.dtype) for row in rows])
        sums = (stacked * weight).flatten(1).sum(-1) / count.clamp(min=1)
        extremes = [torch.where(mask, kl3, torch.zeros_like(kl3)).max()]
        if erc is not None:
            rho = erc[0]
            extremes += [torch.where(mask, rho, torch.full_like(rho, math.inf)).min(),
                         torch.where(mask, rho, torch.full_like(rho, -math.inf)).max()]
        values = torch.cat([sums, torch.stack(extremes), count.reshape(1)]).tolist()

    n_valid = values[-1]
    metrics = {f"actor/divclip/{name}": value for name, value in zip(names, values)}
    metrics.update({f"actor/divclip/{name}": value for name, value in scalar_bounds.items()})
    metrics["actor/divclip/kl3_max"] = values[len(names)]
    if erc is not None and n_valid > 0:
        metrics["actor/divclip/erc/ratio_min"] = values[len(names) + 1]
        metrics["actor/divclip/erc/ratio_max"] = values[len(names) + 2]
    # verl's standard names, so existing dashboards keep working.
    metrics["actor/pg_clipfrac"] = metrics["actor/divclip/clipfrac_upper"] + metrics["actor/divclip/clipfrac_lower"]
    metrics["actor/ppo_kl"] = metrics.pop("actor/divclip/ppo_kl")
    return metrics
