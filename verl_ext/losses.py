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

``kl_full`` (ATR-GRPO Eq. 4, the exact per-token trust region) evaluates C_t = KL(pi_theta || pi_old)
<= delta over pi_old's stored top-k plus a tail bucket (:mod:`verl_ext.full_kl`); the same KL feeds
an opt-in diagnostic on every mode: where the mode's decision and the full-KL rule's disagree.

A constraint registered with ``level="sequence"`` (``seq_kl3``, ATR-GRPO Sec. 6.5) is
evaluated on GSPO's sequence ratio s_i = exp(mean_t log w_{i,t}) instead of w_t: every
token of sequence i carries the ratio s_i (value s_i, d s_i / d log pi_t = s_i, GSPO-token
form), and a violating sequence's ratio is replaced by 1 inside the same pessimistic min.

All masks are explicit ``torch.where`` selections: ``torch.minimum``/``maximum`` split the
gradient half-half on ties, which would silently halve it at the bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, register_policy_loss

from verl_ext import divergences
from verl_ext.config import (
    CONFIG_TARGET,
    POLICY_LOSS_KEY,
    DivClipPolicyLossConfig,
    actor_clip_ratios,
    register_mode_check,
)
from verl_ext.full_kl import (
    NOT_AVERAGED as FULL_KL_NOT_AVERAGED,
    TopKLogMasses,
    diagnostic_sums,
    finish_full_kl_metrics,
    full_kl_sums,
)
from verl_ext.erc import (
    EntropyBand,
    entropy_band_sums,
    entropy_ratio_band,
    finish_entropy_band_metrics,
    gate_log_prob_gradient,
)

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
    full_kl: Optional[torch.Tensor] = None  # per-token coarsened KL (kl_full_direction), when pi_old's top-k is stored


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
    """A registered constraint: how to evaluate C_t and what a violation does.

    ``level``: ``"token"`` evaluates C_t on w_t; ``"sequence"`` on the sequence ratio s_i,
    which then also replaces w_t in the surrogate. ``delta_budget``: the constraint is a
    divergence budget ``policy_loss.delta`` (logged as ``actor/divclip/delta``; the modes
    the adaptive-delta controller may drive). ``budget_metric``: the ``actor/divclip/<name>`` metric
    that measures what delta bounds (the adaptive-delta controller's measurement). ``needs_old_topk``:
    C_t reads pi_old's stored top-k (:mod:`verl_ext.full_kl`), which verl's policy-loss registry cannot
    pass: the mode runs only through the actor loss (``python -m recipe.main``).
    """

    name: str
    region: ConstraintFn
    on_violation: Literal["drop", "preserve"] = "drop"
    level: Literal["token", "sequence"] = "token"
    delta_budget: bool = False
    budget_metric: str = "kl3_mean"
    needs_old_topk: bool = False


CONSTRAINTS: dict[str, ConstraintSpec] = {}


def register_constraint(
    name: str,
    on_violation: Literal["drop", "preserve"] = "drop",
    level: Literal["token", "sequence"] = "token",
    delta_budget: bool = False,
    budget_metric: Optional[str] = None,
    needs_old_topk: bool = False,
) -> Callable[[ConstraintFn], ConstraintFn]:
    """Register a constraint and expose it to verl as ``policy_loss.loss_mode=<name>``."""
    if level == "sequence" and on_violation != "drop":
        raise ValueError(f"constraint {name!r}: sequence-level constraints only drop violations")
    metric = budget_metric or ("seq_kl3_mean" if level == "sequence" else "kl3_mean")

    def decorator(region: ConstraintFn) -> ConstraintFn:
        CONSTRAINTS[name] = ConstraintSpec(name, region, on_violation, level, delta_budget, metric, needs_old_topk)
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
    """The ``DivClipPolicyLossConfig`` inside an actor config, checked against the mode registry
    (:func:`check_policy_config`), or a clear error."""
    policy = config.policy_loss if hasattr(config, "policy_loss") else config["policy_loss"]
    if isinstance(policy, DivClipPolicyLossConfig):
        check_policy_config(policy)  # it may have been built before this module registered the check
        return policy
    if isinstance(policy, Mapping) and policy.get("_target_") == CONFIG_TARGET:
        fields = {k: v for k, v in policy.items() if k != "_target_"}
        return DivClipPolicyLossConfig(**fields)  # __post_init__ runs check_policy_config
    raise TypeError(
        f"loss_mode={policy.get('loss_mode')!r} is a divclip mode and needs "
        f"actor_rollout_ref.actor.policy_loss._target_={CONFIG_TARGET} (got {type(policy).__name__}); "
        "verl's PolicyLossConfig cannot carry delta / dual_clip_c / ERC knobs"
    )


DUAL_CLIP_MODES = frozenset({"vanilla"})
"""verl modes whose own dual-clip constant (``actor.clip_ratio_c``) ``dual_clip_c`` replaces."""

NOT_COMPOSABLE = frozenset({"bypass_mode"})
"""verl modes ERC cannot stack on: bypass mode skips the old-log-prob pass that yields H(pi_old)."""


@register_mode_check
def check_policy_config(policy: DivClipPolicyLossConfig, prefix: str = POLICY_LOSS_KEY) -> None:
    """Raise ``ValueError`` naming the key where ``policy`` does not fit its ``loss_mode``: the mode
    is registered (a divclip constraint or verl's own), ``adaptive_delta_target`` is set only on a
    KL-budget mode, and on verl's modes ERC / dual-clip can apply (:func:`check_verl_mode_options`).

    The config dataclass checks its values alone (:mod:`verl_ext.config` does not import this
    module); this is the half that needs the registry. Registered with
    :func:`verl_ext.config.register_mode_check`, so it also runs in ``__post_init__`` of every
    config built once this module is imported; consumers (:func:`resolve_policy_config`, the
    actor loss, ``recipe.validation``, the adaptive-delta controller) call it as well.
    """
    mode = policy.loss_mode
    if mode not in CONSTRAINTS and mode not in POLICY_LOSS_REGISTRY:
        known = sorted(set(POLICY_LOSS_REGISTRY) | set(CONSTRAINTS))
        raise ValueError(f"{prefix}.loss_mode={mode!r} is not a registered policy loss; known: {known}")
    if policy.adaptive_delta_enabled and not (mode in CONSTRAINTS and CONSTRAINTS[mode].delta_budget):
        budget_modes = sorted(name for name, spec in CONSTRAINTS.items() if spec.delta_budget)
        raise ValueError(
            f"{prefix}.adaptive_delta_target adapts the KL budget delta, which loss_mode={mode!r} "
            f"does not have; the KL-budget modes are {budget_modes}"
        )
    if policy.kl_full_diagnostic and mode not in CONSTRAINTS:
        raise ValueError(
            f"{prefix}.kl_full_diagnostic compares a divclip mode's clip decisions with the full-KL rule; "
            f"verl's loss_mode={mode!r} makes none through the divclip operator: set it to false"
        )
    if mode not in CONSTRAINTS:  # verl's own mode: ERC / dual-clip compose with it
        check_verl_mode_options(policy, prefix)


def check_verl_mode_options(policy: DivClipPolicyLossConfig, prefix: str = POLICY_LOSS_KEY) -> None:
    """Raise ``ValueError`` naming the key if ``policy``'s ERC / dual-clip knobs cannot apply to its
    verl ``loss_mode`` (``verl_ext.verl_modes`` composes them). Part of :func:`check_policy_config`,
    for every non-divclip mode."""
    mode = policy.loss_mode
    if mode not in POLICY_LOSS_REGISTRY:
        return  # check_policy_config reports unknown modes
    if policy.erc_enabled and mode in NOT_COMPOSABLE:
        raise ValueError(
            f"{prefix}.erc_beta_low/erc_beta_high (ERC) cannot stack on loss_mode={mode!r}: it skips the "
            "old-log-prob pass that gives pi_old's entropy"
        )
    if policy.dual_clip_c is not None and mode not in DUAL_CLIP_MODES:
        raise ValueError(
            f"{prefix}.dual_clip_c applies to the divclip modes and to verl's {sorted(DUAL_CLIP_MODES)} "
            f"(where it replaces actor.clip_ratio_c); verl's loss_mode={mode!r} has no dual-clip rule to "
            "set: remove dual_clip_c"
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
        low, high = actor_clip_ratios(config)
        policy = resolve_policy_config(config)
        if policy.adaptive_delta_enabled:
            raise ValueError(_ADAPTIVE_NEEDS_TRAINER.format(mode=mode))
        if policy.kl_full_diagnostic:
            raise ValueError(_KL_FULL_NEEDS_TOPK.replace("loss_mode='kl_full'", "kl_full_diagnostic"))
        return constrained_policy_loss(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            mode=mode,
            policy=policy,
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


@register_constraint("kl3", delta_budget=True)
def kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """ATR-GRPO: KL3_t = w - 1 - log w <= delta, i.e. w in [l_delta, u_delta] (Theorem 4.2)."""
    return _interval(inputs, *_cached_bounds("kl3", inputs.policy.delta))


@register_constraint("kl1", delta_budget=True)
def kl1_region(inputs: ConstraintInputs) -> TrustRegion:
    """|k1| = |log w| <= delta, i.e. w in [e^-delta, e^delta] (symmetric in log-ratio)."""
    return _interval(inputs, *_cached_bounds("kl1", inputs.policy.delta))


@register_constraint("kl2", delta_budget=True)
def kl2_region(inputs: ConstraintInputs) -> TrustRegion:
    """k2 = (log w)^2 / 2 <= delta, i.e. w in [e^-sqrt(2 delta), e^sqrt(2 delta)]."""
    return _interval(inputs, *_cached_bounds("kl2", inputs.policy.delta))


@register_constraint("is_kl3", delta_budget=True)
def is_kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """Importance-weighted KL3: w * k3(1/w) = w log w - w + 1 <= delta (see divergences)."""
    return _interval(inputs, *_cached_bounds("is_kl3", inputs.policy.delta))


@register_constraint("trgppo", delta_budget=True)
def trgppo_region(inputs: ConstraintInputs) -> TrustRegion:
    """TRGPPO "full KL-guided" bounds: w in [min(l, 1-eps_low), max(u, 1+eps_high)] where l, u
    solve KL(Bern(q) || Bern(q w)) = delta per token.

    Both intervals contain 1, so membership of their union is decided without solving for
    l and u: the Bernoulli KL is within budget, or the ratio is within the epsilon clip.
    The roots only feed the ``ratio_lower/upper`` metrics (see ``metric_sample``), where
    they are interpolated from a per-delta table.
    """
    eps_inside = (inputs.ratio >= 1.0 - inputs.clip_ratio_low) & (inputs.ratio <= 1.0 + inputs.clip_ratio_high)
    # Only tokens outside the epsilon band can be rescued by the KL budget -- usually few --
    # so the Bernoulli KL is evaluated on that subset and scattered back.
    # (one nonzero + index_put: boolean-mask indexing costs tens of elementwise passes on CPU)
    beyond_eps = (~eps_inside).reshape(-1).nonzero().squeeze(1)
    within_budget = divergences.bernoulli_kl_within(
        inputs.old_log_prob.reshape(-1)[beyond_eps], inputs.log_ratio.reshape(-1)[beyond_eps], inputs.policy.delta
    )
    inside = eps_inside.reshape(-1).index_put((beyond_eps,), within_budget).view_as(eps_inside)
    lower, upper = divergences.trgppo_ratio_bounds_interpolated(metric_sample(inputs), inputs.policy.delta)
    lower = torch.clamp(lower, max=1.0 - inputs.clip_ratio_low)
    upper = torch.clamp(upper, min=1.0 + inputs.clip_ratio_high)
    return TrustRegion(inside, lower, upper, bounds_sampled=True)


@register_constraint("seq_kl3", level="sequence", delta_budget=True)
def seq_kl3_region(inputs: ConstraintInputs) -> TrustRegion:
    """Sequence-level ATR (ATR-GRPO Sec. 6.5): KL3(s_i) = s_i - 1 - log s_i <= delta for GSPO's
    s_i = exp(mean_t log w_{i,t}), i.e. s_i in [l_delta, u_delta] (the Lambert-W bounds of
    ``kl3``): the asymmetric counterpart of GSPO's symmetric clip of s_i. The operator passes
    s_i (broadcast over the sequence's tokens) as ``inputs.ratio``."""
    return kl3_region(inputs)


@register_constraint("kl_full", delta_budget=True, budget_metric="kl_full_mean", needs_old_topk=True)
def kl_full_region(inputs: ConstraintInputs) -> TrustRegion:
    """The exact trust region of ATR-GRPO Eq. 4 on pi_old's top-k: KL_t <= delta, where KL_t is
    KL(pi_theta || pi_old) (``kl_full_direction=forward``) or KL(pi_old || pi_theta) (``reverse``, Truly
    PPO's trigger) between the two policies' (k + 1)-bucket coarsenings (top-k ids + tail), a lower
    bound of the full-vocabulary KL (:func:`verl_ext.full_kl.coarsened_kl`).

    The region is not a ratio interval (it depends on the whole distribution), so no ratio bounds are
    reported."""
    if inputs.full_kl is None:
        raise ValueError(_KL_FULL_NEEDS_TOPK)
    no_bounds = inputs.ratio.new_zeros(0)
    return TrustRegion(inputs.full_kl <= inputs.policy.delta, no_bounds, no_bounds, bounds_sampled=True)


@register_constraint("dcpo")
def dcpo_region(inputs: ConstraintInputs) -> TrustRegion:
    """DCPO dynamic clipping with eps_low/eps_high = actor.clip_ratio_low/high and
    cap = policy_loss.dcpo_cap: w in [1/2 + 1/2 sqrt(max(0, 1 - 4 eps_low/q)),
    min(1/2 + 1/2 sqrt(1 + 4 eps_high/q), cap)], q = pi_old(token).

    Squaring the bounds gives a root-free test: for w >= 1/2 the interval is
    -eps_low <= q w (w - 1) <= eps_high (and w <= cap). The closed-form bounds only feed
    the ``ratio_lower/upper`` metrics (see ``metric_sample``).
    """
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
    """Old log-probs of the valid tokens among at most ``METRIC_SAMPLE`` evenly strided
    positions of the batch.

    Per-token bounds whose mask test needs no bounds (TRGPPO, DCPO) are reported as their
    mean over this sample, so the metric costs O(METRIC_SAMPLE), not a pass over the batch.
    """
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
    topk: Optional[TopKLogMasses] = None,
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
        topk: pi_old's stored top-k log-masses and pi_theta's on the same buckets, ``(batch,
            response_length, k + 1)``: required by ``kl_full``; with it every mode reports the coarsened
            KL's metrics, and with ``policy.kl_full_diagnostic`` the KL3-vs-trust-region diagnostic.

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
    erc = None
    if policy.erc_enabled:
        erc = entropy_ratio_band(old_entropy, entropy, response_mask, policy, compute_dtype)
        # ERC is a hard violation: a token outside the band keeps its value everywhere below and
        # loses its gradient, i.e. its log-prob enters the surrogate detached.
        log_prob = gate_log_prob_gradient(log_prob, erc)

    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio = log_ratio.detach()
    seq_log_ratio = None
    if spec.level == "sequence":
        seq_log_ratio = sequence_mean_log_ratio(token_log_ratio, mask)
        # GSPO-token: the value log s_i on every token, the gradient of the token's own log pi_t
        log_ratio = log_ratio - token_log_ratio + seq_log_ratio.unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    log_ratio_d, ratio_d = log_ratio.detach(), ratio.detach()

    full_kl = topk.kl(policy.kl_full_direction) if topk is not None else None
    region = spec.region(
        ConstraintInputs(
            log_ratio_d, ratio_d, old_log_prob, mask, clip_ratio_low, clip_ratio_high, policy, full_kl=full_kl
        )
    )
    # Pessimistic min of Eq. 5: a violation matters only when it lies on the side the
    # advantage pushes towards, i.e. (w - 1) * A > 0; on the other side min() keeps w * A
    # and its gradient.
    pessimistic_side = (ratio_d - 1.0) * advantages > 0
    clipped = ~region.inside & pessimistic_side
    upper_side = ratio_d > 1.0

    dual = None
    if policy.dual_clip_c is not None:
        dual = (advantages < 0) & (ratio_d > policy.dual_clip_c)

    if spec.on_violation == "preserve":
        if region.bounds_sampled:
            raise ValueError(f"constraint {mode!r} reports sampled bounds and cannot preserve gradients")
        # 0-d tensors of the compute dtype: where() on two Python floats would yield float32
        as_tensor = lambda v: torch.as_tensor(v, dtype=ratio.dtype, device=ratio.device)  # noqa: E731
        bound = torch.where(upper_side, as_tensor(region.upper), as_tensor(region.lower))
        slope = torch.where(
            upper_side,
            as_tensor(policy.gppo_beta_high * region.upper),
            as_tensor(policy.gppo_beta_low * region.lower),
        )
        # GPPO's bound / sg(w) * w in its general beta form: the forward value stays `bound`
        # (Clip-Higher) and d coef / d log pi = beta * bound. (x - sg(x)) is 0 with slope 1.
        coef = torch.where(clipped, bound + slope * (log_ratio - log_ratio_d), ratio)
        no_grad = _union(dual, erc.outside if erc is not None else None)
        if dual is not None:
            coef = torch.where(dual, policy.dual_clip_c, coef)
    else:
        # Every violating token takes a constant: w(theta_old) = 1 where the constraint clips, c
        # where dual-clip caps (it wins over the clip). One select in the autograd graph. (ERC's
        # tokens keep their ratio's value; their gradient is gated at the log-prob above.)
        frozen_mask = _union(clipped, dual)
        frozen = 1.0 if dual is None else torch.where(dual, policy.dual_clip_c, ratio_d.new_ones(()))
        coef = torch.where(frozen_mask, frozen, ratio)
        no_grad = _union(frozen_mask, erc.outside if erc is not None else None)

    # agg_loss is linear in the loss matrix: aggregate A * coef and negate the scalar.
    surrogate = advantages * coef
    if rollout_is_weights is not None:
        surrogate = surrogate * rollout_is_weights.detach().to(compute_dtype)

    batch_info = dict(global_batch_info or {})
    if not batch_info.get("batch_num_tokens") and not batch_info.get("global_batch_size") and not mask.any():
        # A micro-batch without a single valid token: agg_loss would divide 0 by 0.
        loss = (surrogate * 0.0).sum()
    else:
        loss = -agg_loss(loss_mat=surrogate, loss_mask=mask, loss_agg_mode=loss_agg_mode, **batch_info)
    vocab_sums = None
    if full_kl is not None:
        with torch.no_grad():
            vocab_sums = full_kl_sums(full_kl, topk, mask)
            if policy.kl_full_diagnostic:
                vocab_sums.update(
                    diagnostic_sums(full_kl, mask, clipped, pessimistic_side, _diagnostic_deltas(policy.delta, region))
                )
    metrics = _metrics(
        mask, token_log_ratio, region, clipped, upper_side, no_grad, dual, erc,
        sequence_log_ratio=seq_log_ratio, vocab_sums=vocab_sums,
    )
    if spec.delta_budget:
        metrics["actor/divclip/delta"] = float(policy.delta)
    return loss, metrics


def _diagnostic_deltas(delta: float, region: TrustRegion) -> dict[str, float]:
    """The budgets the diagnostic compares the mode with: the configured delta (suffix ``""``), and,
    for a mode with scalar ratio bounds [l, u], the KL3 budget those bounds amount to,
    max(KL3(l), KL3(u)) -- the smallest delta whose KL3 region holds the mode's interval (suffix
    ``_kl3delta``; for ``kl3`` it is delta itself)."""
    deltas = {"": float(delta)}
    lower, upper = region.lower, region.upper
    if not isinstance(lower, torch.Tensor) and not isinstance(upper, torch.Tensor) and lower > 0:
        kl3_at = lambda w: w - 1.0 - math.log(w)  # noqa: E731
        deltas["_kl3delta"] = max(kl3_at(float(lower)), kl3_at(float(upper)))
    return deltas


def sequence_mean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = mean over the valid tokens of row i of log w_{i,t} (GSPO's sequence ratio), shape
    (batch,); 0 for a row without valid tokens.

    The operator puts it on every token as log w_t - sg(log w_t) + sg(log s_i), so each token's
    coefficient has value s_i and d s_{i,t} / d log pi_t = s_i: with seq-mean-token-mean
    aggregation and one advantage per sequence that is GSPO's gradient (GSPO-token form)."""
    lengths = mask.sum(-1).clamp(min=1)
    return torch.where(mask, log_ratio.detach(), 0.0).sum(-1) / lengths


def _union(*masks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Elementwise OR of the masks that are present (``None`` if none is)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    union = present[0]
    for mask in present[1:]:
        union = union | mask
    return union


_ADAPTIVE_NEEDS_TRAINER = (
    "policy_loss.adaptive_delta_target turns on the adaptive delta for loss_mode={mode!r}, which the divclip "
    "trainer runs between actor updates; verl's own trainer would silently keep delta static. Run training "
    "through `python -m recipe.main`, or set adaptive_delta_target to null."
)

_KL_FULL_NEEDS_TOPK = (
    "policy_loss.loss_mode='kl_full' needs pi_old's top-k (stored by the old-log-prob pass) and pi_theta's "
    "log-probs on it, which verl's policy-loss registry does not pass: run training through "
    "`python -m recipe.main` (its trainer stores the top-k and installs the actor loss that reads it)"
)

_ERC_NEEDS_ENTROPY = (
    "policy_loss.erc_beta_low/erc_beta_high enable ERC for loss_mode={mode!r}, but no per-token "
    "entropies reached the loss: verl's policy-loss registry passes only log-probs, advantages and "
    "the mask. Run training through `python -m recipe.main` (it installs the entropy-aware actor "
    "loss on the actor workers with set_loss_fn and sets actor.calculate_entropy=True), or set "
    "erc_beta_low/erc_beta_high to null."
)


def _metrics(
    mask: torch.Tensor,
    log_ratio: torch.Tensor,
    region: TrustRegion,
    clipped: torch.Tensor,
    upper_side: torch.Tensor,
    no_grad: Optional[torch.Tensor],
    dual: Optional[torch.Tensor],
    erc: Optional[EntropyBand],
    sequence_log_ratio: Optional[torch.Tensor] = None,
    vocab_sums: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, float]:
    """Means over valid tokens, reduced with a single host sync.

    ``sequence_log_ratio`` (one log s_i per row, sequence-level constraints) adds
    ``seq_kl3_mean``/``seq_kl3_max``: KL3(s_i) over the sequences with a valid token.

    Fractions are counted on byte masks and per-token quantities summed once, so the
    metrics cost a few passes over the batch rather than one float tensor per metric.
    """
    # count_nonzero counts a bool mask in place; bool.sum() first copies it to int64
    count = torch.count_nonzero
    with torch.no_grad():
        clipped_valid = clipped & mask
        sums: dict[str, torch.Tensor] = {
            "n_valid": count(mask),
            "clipfrac_upper": count(clipped_valid & upper_side),
            "clipfrac_total": count(clipped_valid),
            "ppo_kl": -(log_ratio * mask).sum(),
        }
        kl3 = torch.where(mask, divergences.kl3(log_ratio), 0.0)
        sums["kl3_mean"] = kl3.sum()
        sums["kl3_max"] = kl3.max() if kl3.numel() else kl3.new_zeros(())
        if sequence_log_ratio is not None:
            has_tokens = mask.any(-1)
            seq_kl3 = torch.where(has_tokens, divergences.kl3(sequence_log_ratio), 0.0)
            sums["n_sequences"] = count(has_tokens)
            sums["seq_kl3_sum"] = seq_kl3.sum()
            sums["seq_kl3_max"] = seq_kl3.max() if seq_kl3.numel() else seq_kl3.new_zeros(())
        if no_grad is not None:
            sums["no_grad_frac"] = count(no_grad & mask)
        if dual is not None:
            sums["dualclip_frac"] = count(dual & mask)
        scalar_bounds: dict[str, float] = {}
        for name, bound in (("ratio_lower", region.lower), ("ratio_upper", region.upper)):
            if not isinstance(bound, torch.Tensor):
                scalar_bounds[name] = float(bound)
                continue
            # beyond e^{+-20} a bound is no bound (log-ratios are clamped there)
            bound = torch.clamp(bound, math.exp(-LOG_RATIO_CLAMP), math.exp(LOG_RATIO_CLAMP))
            if not region.bounds_sampled:
                sums[name] = (bound * mask).sum()
            elif bound.numel():  # a 1-D sample of valid tokens; none: the metric is left out
                sums[name] = bound.mean()
        if erc is not None and mask.numel():
            sums.update(entropy_band_sums(erc))
        if vocab_sums is not None:
            sums.update(vocab_sums)
        values = dict(zip(sums, torch.stack([v.double() for v in sums.values()]).tolist()))

    n_valid = values.pop("n_valid")
    finish_full_kl_metrics(values, n_valid)
    if "erc/ratio_mean" in values:
        finish_entropy_band_metrics(values, erc, n_valid)
    if "n_sequences" in values:
        values["seq_kl3_mean"] = values.pop("seq_kl3_sum") / max(values.pop("n_sequences"), 1.0)
    if n_valid == 0:  # extremes of an empty set are not reported
        values.pop("erc/ratio_min", None)
        values.pop("erc/ratio_max", None)
    n_valid = max(n_valid, 1.0)
    not_averaged = {"kl3_max", "seq_kl3_mean", "seq_kl3_max", "erc/ratio_min", "erc/ratio_max", *FULL_KL_NOT_AVERAGED}
    if region.bounds_sampled:
        not_averaged |= {"ratio_lower", "ratio_upper"}
    metrics = {
        f"actor/divclip/{name}": value if name in not_averaged else value / n_valid for name, value in values.items()
    }
    metrics.update({f"actor/divclip/{name}": value for name, value in scalar_bounds.items()})
    clipfrac_total = metrics.pop("actor/divclip/clipfrac_total")
    metrics["actor/divclip/clipfrac_lower"] = clipfrac_total - metrics["actor/divclip/clipfrac_upper"]
    metrics.setdefault("actor/divclip/no_grad_frac", 0.0)  # gradient-preserving, no dual-clip or ERC
    # verl's standard names, so existing dashboards keep working.
    metrics["actor/pg_clipfrac"] = clipfrac_total
    metrics["actor/ppo_kl"] = metrics.pop("actor/divclip/ppo_kl")
    return metrics
