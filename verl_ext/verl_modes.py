"""ERC on verl's own policy losses (``vanilla``, ``gspo``, ``sapo``, ``clip_cov``, ...).

The divclip modes apply ERC inside the unified operator (Eq. 5) as a *hard* violation. verl's own
losses are separate functions in its registry; ERC composes with any of them the same way the ERC
paper describes it ("integrates orthogonally with various reinforcement learning objectives", §3.2;
"orthogonal [to sequence-level clipping] and can be used simultaneously", §5.7):

    rho_t = (H(pi_theta, t) + eps) / (H(pi_old, t) + eps)
    log pi_theta(y_t)  ->  sg[log pi_theta(y_t)]   where rho_t <= 1 - beta_l or rho_t >= 1 + beta_h

A token outside the entropy band therefore contributes **no gradient through its own log-prob**,
while every forward value -- its loss term, its place in the aggregation denominator, and any
sequence-level quantity it enters (GSPO's sequence ratio, geo_mean's geometric mean) -- is exactly
verl's. For token-separable losses (vanilla, sapo, cispo, gpg, dro, dppo_*) the other tokens'
gradients are unchanged; for GSPO the masked tokens drop out of the gradient of the sequence ratio
but not out of its value; for clip_cov / kl_cov the covariance selection is computed from values,
so it is unchanged. Per-mode readings: docs/losses.md.

Dual-clip on verl's modes is verl's own: ``vanilla`` applies ``actor.clip_ratio_c``; the divclip modes'
``policy_loss.dual_clip_c`` is refused on every verl mode (:func:`verl_ext.registry.check_verl_mode_options`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.core.erc import (
    EntropyBand,
    entropy_band_sums,
    entropy_ratio_band,
    finish_entropy_band_metrics,
    gate_log_prob_gradient,
)


def verl_policy_loss(
    mode: str,
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    policy: Optional[DivClipPolicyLossConfig],
    rollout_is_weights: Optional[torch.Tensor] = None,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's registered ``mode`` with the divclip ERC band applied (see module doc; the divclip dual-clip is
    refused on verl's modes).

    ``policy`` is None for a plain verl config: the call is then exactly verl's. With ERC on,
    ``old_entropy``/``entropy`` (padded like ``log_prob``) are required and ``actor/divclip/erc/*``
    metrics are added under the same names as the divclip modes report them.
    """
    erc_metrics: dict[str, Any] = {}
    if policy is not None and policy.erc_enabled:
        if old_entropy is None or entropy is None:
            raise ValueError(f"ERC on loss_mode={mode!r} needs pi_old's and pi_theta's per-token entropies")
        # the divclip operator's own band test and gradient gate: the same tokens leave the band,
        # and lose their gradient the same way, in every mode
        band = entropy_ratio_band(old_entropy, entropy, response_mask, policy, torch.float32)
        log_prob = gate_log_prob_gradient(log_prob, band)
        erc_metrics = _erc_metrics(band, response_mask)
    pg_loss, pg_metrics = get_policy_loss_fn(mode)(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    return pg_loss, {**pg_metrics, **erc_metrics}


def _erc_metrics(band: EntropyBand, response_mask: torch.Tensor) -> dict[str, float]:
    """ERC metrics as the divclip operator names them (means over valid tokens; min/max extremes),
    with one host sync."""
    with torch.no_grad():  # every sum is a float of the band's dtype: one stack, one host sync
        sums = {"n_valid": response_mask.sum(dtype=band.rho.dtype), **entropy_band_sums(band)}
        values = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
    n = values.pop("n_valid")
    if n == 0:
        return {}
    finish_entropy_band_metrics(values, band, n)
    extremes = ("erc/ratio_min", "erc/ratio_max")
    return {f"actor/divclip/{name}": value if name in extremes else value / n for name, value in values.items()}
