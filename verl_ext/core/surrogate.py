"""The unified divergence-constrained surrogate (ATR-GRPO Eq. 5) and its constraints.

    L_t = -min(w_t A_t, w~_t A_t),   w~_t = w_t if C_t holds else 1            (Eq. 5)

One operator covers every clip rule: the gradient drops only on the side the advantage pushes towards, so
C_t = {l <= w <= u} is PPO's clip (Theorem 4.1) and C_t = {KL3_t <= delta} ATR-GRPO (Theorem 4.2). GPPO, ERC,
dual-clip, ``kl_full`` (Eq. 4) and ``seq_kl3`` (Sec. 6.5) are options of it, not copies (docs/losses.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import agg_loss

from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.core import constraints as _definitions  # noqa: F401  (defines every constraint)
from verl_ext.core import divergences
from verl_ext.core.coarsened_kl import (
    NOT_AVERAGED as FULL_KL_NOT_AVERAGED,
)
from verl_ext.core.coarsened_kl import (
    TopKLogMasses,
    diagnostic_sums,
    finish_full_kl_metrics,
    full_kl_sums,
)
from verl_ext.core.erc import (
    EntropyBand,
    entropy_band_sums,
    entropy_ratio_band,
    finish_entropy_band_metrics,
    gate_log_prob_gradient,
)
from verl_ext.core.region import CONSTRAINTS, ConstraintInputs, TrustRegion

# Same clamp as verl's losses: keeps exp() finite for any log-prob difference.
LOG_RATIO_CLAMP = 20.0


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
    """Divergence-constrained PPO surrogate (Eq. 5), aggregated with verl's ``agg_loss``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(batch, response_length)``, as verl's policy
            losses take them; ``log_prob`` carries the gradient.
        mode: a registered constraint (``CONSTRAINTS``); policy: its knobs; clip_ratio_low/high: verl's epsilons.
        loss_agg_mode, global_batch_info, rollout_is_weights: as in verl's losses (forwarded to ``agg_loss``).
        old_entropy, entropy: pi_old's and pi_theta's full-vocabulary entropy per token, required by ERC; a
            mask only, never differentiated.
        topk: pi_old's and pi_theta's log-masses on pi_old's top-k buckets, ``(batch, response_length, k + 1)``:
            required by ``kl_full``; with it every mode reports the coarsened KL (and the diagnostic).

    Returns:
        The scalar loss and the ``actor/...`` metrics (floats).
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
        # ERC is hard: outside the band a token keeps its value but its log-prob enters detached.
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
    # Eq. 5's min: a violation counts only on the side the advantage pushes towards; elsewhere w * A stays.
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
        # A violating token takes a constant: 1 where the constraint clips, c where dual-clip caps (it wins).
        # One select in the autograd graph; ERC's tokens keep their ratio (gated at the log-prob above).
        frozen_mask = _union(clipped, dual)
        frozen = 1.0 if dual is None else torch.where(dual, policy.dual_clip_c, ratio_d.new_ones(()))
        coef = torch.where(frozen_mask, frozen, ratio)
        no_grad = _union(frozen_mask, erc.outside if erc is not None else None)

    # agg_loss is linear in the loss matrix: aggregate A * coef and negate the scalar.
    surrogate = advantages * coef
    if rollout_is_weights is not None:
        surrogate = surrogate * rollout_is_weights.detach().to(compute_dtype)

    if not mask.any():
        # A micro-batch without a single valid token adds nothing to any aggregate. (agg_loss would divide 0 by 0
        # where its mode's global count -- tokens or sequences -- is not given and it counts the micro-batch's own.)
        loss = (surrogate * 0.0).sum()
    else:
        loss = -agg_loss(loss_mat=surrogate, loss_mask=mask, loss_agg_mode=loss_agg_mode, **(global_batch_info or {}))
    vocab_sums = None
    if full_kl is not None:
        with torch.no_grad():
            vocab_sums = full_kl_sums(full_kl, topk, mask)
            if policy.kl_full_diagnostic:
                vocab_sums.update(
                    diagnostic_sums(full_kl, mask, clipped, pessimistic_side, _diagnostic_deltas(policy.delta, region))
                )
    metrics = _metrics(
        mask,
        token_log_ratio,
        region,
        clipped,
        upper_side,
        no_grad,
        dual,
        erc,
        sequence_log_ratio=seq_log_ratio,
        vocab_sums=vocab_sums,
    )
    if spec.delta_budget:
        metrics["actor/divclip/delta"] = float(policy.delta)
    return loss, metrics


@torch.no_grad()
def outside_trust_region(
    mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    policy: DivClipPolicyLossConfig,
    clip_ratio_low: float,
    clip_ratio_high: float,
    topk: Optional[TopKLogMasses] = None,
) -> torch.Tensor:
    """The valid tokens outside ``mode``'s trust region C_t, whatever the advantage's sign (bool, detached): the
    constraint's own region, evaluated as the operator evaluates it (on the sequence ratio s_i for a sequence-level
    mode, on the coarsened KL for ``kl_full``). The on-policy gauge counts them (``onpolicy/ratio_clipfrac``)."""
    spec = CONSTRAINTS[mode]
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    old = old_log_prob.detach().to(dtype)
    mask = response_mask.bool()
    log_ratio = torch.clamp(log_prob.detach().to(dtype) - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if spec.level == "sequence":
        log_ratio = sequence_mean_log_ratio(log_ratio, mask).unsqueeze(-1).expand_as(log_ratio).contiguous()
    full_kl = topk.kl(policy.kl_full_direction) if topk is not None else None
    region = spec.region(
        ConstraintInputs(
            log_ratio, log_ratio.exp(), old, mask, clip_ratio_low, clip_ratio_high, policy, full_kl=full_kl
        )
    )
    return ~region.inside & mask


def _diagnostic_deltas(delta: float, region: TrustRegion) -> dict[str, float]:
    """The budgets the diagnostic compares the mode with: delta (suffix ``""``) and, for scalar ratio bounds
    [l, u], max(KL3(l), KL3(u)), the smallest KL3 budget holding [l, u] (suffix ``_kl3delta``)."""
    deltas = {"": float(delta)}
    lower, upper = region.lower, region.upper
    if not isinstance(lower, torch.Tensor) and not isinstance(upper, torch.Tensor) and lower > 0:
        kl3_at = lambda w: w - 1.0 - math.log(w)  # noqa: E731
        deltas["_kl3delta"] = max(kl3_at(float(lower)), kl3_at(float(upper)))
    return deltas


def sequence_mean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i, the mean of row i's valid log w_{i,t} (GSPO's sequence ratio), ``(batch,)``; 0 for an empty row.
    The operator uses log w_t - sg(log w_t) + sg(log s_i) per token (GSPO-token: value s_i, gradient s_i)."""
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
    """Means over valid tokens, reduced with a single host sync; ``sequence_log_ratio`` (log s_i per row) adds
    ``seq_kl3_mean/max`` over the sequences with a valid token. Fractions are counted on byte masks, so the
    metrics cost a few passes over the batch rather than one float tensor each."""
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
        values = dict(zip(sums, torch.stack([v.double() for v in sums.values()]).tolist(), strict=False))

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
