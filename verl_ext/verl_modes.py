"""ERC on verl's own policy losses (ERC paper §3.2, §5.7): a token outside the entropy band enters verl's function
as sg[log pi_theta(y_t)], so every value is verl's and the token adds no gradient (docs/losses.md). Also
:data:`VERL_MODE_READS`: per verl mode, the knobs verl 0.9.1's function reads and its clip rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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

#: ``outside(log_ratio, old_log_prob, mask, eps_low, eps_high)``: the valid tokens a mode's clip rule puts
#: outside its trust region, whatever the advantage's sign (detached tensors; the on-policy gauge counts them).
ClipRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], torch.Tensor]


def _token_interval(
    log_ratio: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """PPO's clip (vanilla, clip_cov, cispo, bypass_mode): w outside [1 - eps_low, 1 + eps_high]."""
    ratio = log_ratio.exp()
    return (ratio < 1.0 - low) | (ratio > 1.0 + high)


def _sequence_interval(
    log_ratio: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """GSPO: the sequence ratio s_i = exp(mean_t log w) outside [1 - eps_low, 1 + eps_high], on every token of i."""
    seq = (torch.where(mask, log_ratio, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)).exp().unsqueeze(-1)
    return ((seq < 1.0 - low) | (seq > 1.0 + high)).expand_as(log_ratio)


def _log_interval(
    log_ratio: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """GMPO (geo_mean): log w clamped to [-eps_low, eps_high]."""
    return (log_ratio < -low) | (log_ratio > high)


def _tv_interval(
    log_ratio: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """DPPO-TV: p - p_old outside [-eps_low, eps_high]."""
    diff = (old + log_ratio).exp() - old.exp()
    return (diff > high) | (diff < -low)


def _binary_kl_interval(
    log_ratio: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """DPPO-KL: the Bernoulli KL(p_old || p) beyond eps_high where p rose, beyond eps_low where it fell (verl's
    expression, 1e-8 included)."""
    old_p, p = old.exp(), (old + log_ratio).exp()
    binary_kl = old_p * (-log_ratio) + (1 - old_p) * torch.log((1.0 - old_p + 1e-8) / (1.0 - p + 1e-8))
    return ((binary_kl > high) & (p > old_p)) | ((binary_kl > low) & (p < old_p))


@dataclass(frozen=True)
class VerlModeReads:
    """What verl's function for one mode reads (``reads``, names of :data:`verl_ext.knobs.KNOBS`) and needs set
    (``needs``, DRO's ``dro_beta``), its clip rule (``outside``, None for a soft gate or a penalty), and
    ``summary``, one line for the README's mode table."""

    reads: tuple[str, ...]
    summary: str
    outside: Optional[ClipRule] = None
    needs: dict[str, Any] = field(default_factory=dict)


#: verl's clip epsilons: ``clip_ratio_low/high``, each falling back to ``clip_ratio`` when null.
_EPSILONS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio")

#: The knobs each of verl 0.9.1's registered policy losses reads (``config.<knob>``, ``config.get("<knob>")``,
#: ``config.policy_loss.<knob>`` in its function; ``bypass_mode`` calls ``vanilla``'s).
VERL_MODE_READS: dict[str, VerlModeReads] = {
    "vanilla": VerlModeReads(
        (*_EPSILONS, "clip_ratio_c"), "verl's PPO clip, with dual-clip at `actor.clip_ratio_c`", _token_interval
    ),
    "dppo_tv": VerlModeReads(
        (*_EPSILONS, "clip_ratio_c"), "DPPO: a TV-divergence mask, ratio truncated at `clip_ratio_c`", _tv_interval
    ),
    "dppo_kl": VerlModeReads(
        (*_EPSILONS, "clip_ratio_c"), "DPPO: a binary-KL mask, ratio truncated at `clip_ratio_c`", _binary_kl_interval
    ),
    "gspo": VerlModeReads(_EPSILONS, "GSPO: the clip on the sequence ratio", _sequence_interval),
    "sapo": VerlModeReads(("tau_pos", "tau_neg"), "SAPO: a soft sigmoid gate instead of a clip"),
    "gpg": VerlModeReads((), "GPG: −A log π, no ratio"),
    "clip_cov": VerlModeReads(
        (*_EPSILONS, "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
        "Clip-Cov: PPO clip plus a covariance-picked mask",
        _token_interval,
    ),
    "kl_cov": VerlModeReads(("kl_cov_ratio", "ppo_kl_coef"), "KL-Cov: a |log w| penalty on covariance-picked tokens"),
    "geo_mean": VerlModeReads(_EPSILONS, "GMPO: the clip of log w, on the geometric mean of the ratios", _log_interval),
    "dro": VerlModeReads(("dro_beta",), "DRO: a quadratic log-ratio penalty", needs={"dro_beta": 0.1}),
    "cispo": VerlModeReads(_EPSILONS, "CISPO: a clipped, stop-gradient IS weight on −A log π", _token_interval),
    "bypass_mode": VerlModeReads(
        (*_EPSILONS, "clip_ratio_c"),
        "rollout correction in bypass mode (with verl's default `loss_type=ppo_clip`: `vanilla` on the rollout "
        "log-probs)",
        _token_interval,
    ),
}


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
    """verl's registered ``mode`` with the ERC band applied: exactly verl's call when ``policy`` is None; with ERC
    on, ``old_entropy``/``entropy`` (padded like ``log_prob``) are required and the divclip modes'
    ``actor/divclip/erc/*`` metrics are added."""
    erc_metrics: dict[str, Any] = {}
    if policy is not None and policy.erc_enabled:
        if old_entropy is None or entropy is None:
            raise ValueError(f"ERC on loss_mode={mode!r} needs pi_old's and pi_theta's per-token entropies")
        # the divclip operator's band test and gate: the same tokens lose their gradient in every mode
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
        values = dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=False))
    n = values.pop("n_valid")
    if n == 0:
        return {}
    finish_entropy_band_metrics(values, band, n)
    extremes = ("erc/ratio_min", "erc/ratio_max")
    return {f"actor/divclip/{name}": value if name in extremes else value / n for name, value in values.items()}
