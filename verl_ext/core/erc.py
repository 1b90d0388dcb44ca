"""Entropy Ratio Clipping's band (ERC paper, Eq. 3-4):

    rho_t = (H(pi_theta, t) + eps) / (H(pi_old, t) + eps)
    log pi_theta(y_t)  ->  sg[log pi_theta(y_t)]   where rho_t <= 1 - beta_l or rho_t >= 1 + beta_h

One implementation for the divclip operator (a hard violation of ATR-GRPO Eq. 5) and verl's own modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verl_ext.config import DivClipPolicyLossConfig


@dataclass(frozen=True)
class EntropyBand:
    """ERC's band test of a micro-batch (Eq. 3-4): rho_t and the valid tokens outside (1 - beta_l, 1 + beta_h).
    ``rho`` is 1 on padding (inside the band), so the counts cover valid tokens only."""

    rho: torch.Tensor  #: detached, the loss's compute dtype; exactly 1.0 where response_mask is 0
    keep: torch.Tensor  #: 1.0 inside the band (and on padding), 0.0 outside: gates the log-prob gradient
    n_above: torch.Tensor  #: 0-d, valid tokens with rho >= 1 + beta_h
    n_below: torch.Tensor  #: 0-d, valid tokens with rho <= 1 - beta_l
    response_mask: torch.Tensor  #: the mask the band was computed with (any dtype)

    @property
    def outside(self) -> torch.Tensor:
        """bool, the valid tokens outside the band (they lose their gradient)."""
        return self.keep == 0.0


def entropy_ratio(
    old_entropy: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """ERC's rho_t = (H_t + eps) / (H_old,t + eps) (Eq. 3), detached, in ``dtype``: the one place it is computed
    (band, gauge, token dump, benchmarks). The mask enters as (H m + eps) / (H_old m + eps): exact on valid
    tokens, eps / eps = 1 on padding."""
    eps_t = torch.full((), eps, dtype=dtype, device=entropy.device)
    mask = response_mask.detach().to(dtype)
    rho = torch.addcmul(eps_t, entropy.detach().to(dtype), mask)
    return rho.div_(torch.addcmul(eps_t, old_entropy.detach().to(dtype), mask))


def outside_band(rho: torch.Tensor, beta_low: float, beta_high: float) -> torch.Tensor:
    """bool: rho outside the open band (1 - beta_l, 1 + beta_h) -- the tokens ERC masks. A NaN ratio
    (a NaN entropy) is outside: it never keeps a gradient and counts as masked everywhere."""
    return ~((rho > 1.0 - beta_low) & (rho < 1.0 + beta_high))


def entropy_ratio_band(
    old_entropy: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    policy: DivClipPolicyLossConfig,
    dtype: torch.dtype,
) -> EntropyBand:
    """ERC's band for ``policy.erc_beta_low/high`` and ``erc_eps`` (:func:`entropy_ratio`,
    :func:`outside_band`); the entropies are never differentiated. A NaN ratio counts as outside the
    band on both sides (``n_above`` and ``n_below``)."""
    rho = entropy_ratio(old_entropy, entropy, response_mask, policy.erc_eps, dtype)
    not_above = rho < 1.0 + policy.erc_beta_high
    not_below = rho > 1.0 - policy.erc_beta_low
    numel = rho.numel()
    n_above = numel - not_above.sum(dtype=dtype)
    n_below = numel - not_below.sum(dtype=dtype)
    keep = (not_above & not_below).to(dtype)  # == ~outside_band(rho, ...), as the gate's multiplier
    return EntropyBand(rho, keep, n_above, n_below, response_mask)


def gate_log_prob_gradient(log_prob: torch.Tensor, band: EntropyBand) -> torch.Tensor:
    """``log_prob``'s values, its gradient through the result multiplied by ``band.keep``: a token outside the
    band enters as sg[log pi_theta(y_t)]. A hook on a view, not ``torch.where``: the same gradient without two
    selects, the loss's costliest elementwise kernels on CPU. Other uses of ``log_prob`` (a KL loss) keep theirs."""
    if not log_prob.requires_grad:
        return log_prob
    keep = band.keep if band.keep.dtype == log_prob.dtype else band.keep.to(log_prob.dtype)
    gated = log_prob.view_as(log_prob)
    gated.register_hook(lambda grad: grad * keep)
    return gated


def entropy_band_sums(band: EntropyBand) -> dict[str, torch.Tensor]:
    """ERC's metric reductions as 0-d tensors, for the caller's single host sync; turned into the
    ``erc/*`` metrics by :func:`finish_entropy_band_metrics`."""
    ratio_min, ratio_max = torch.aminmax(band.rho)
    return {
        "erc/ratio_mean": band.rho.sum(),  # a sum, padding's 1s included
        "erc/clipfrac_upper": band.n_above,
        "erc/clipfrac_lower": band.n_below,
        "erc/ratio_min": ratio_min,  # min(valid min, 1) when there is padding
        "erc/ratio_max": ratio_max,  # max(valid max, 1) likewise
    }


def finish_entropy_band_metrics(values: dict[str, float], band: EntropyBand, n_valid: float) -> None:
    """In place on :func:`entropy_band_sums`' host values: the sum (the caller divides by ``n_valid``) and the
    exact extremes over valid tokens. Padding's 1 hides a valid extreme only when every valid ratio lies on one
    side of 1; then one more reduction over the valid tokens finds it."""
    n_padding = band.rho.numel() - n_valid
    values["erc/ratio_mean"] -= n_padding
    if n_padding == 0 or n_valid == 0:
        return
    low, high = values["erc/ratio_min"], values["erc/ratio_max"]
    if low == 1.0 and high > 1.0:
        valid = band.response_mask.bool()
        values["erc/ratio_min"] = torch.where(valid, band.rho, math.inf).amin().item()
    elif high == 1.0 and low < 1.0:
        valid = band.response_mask.bool()
        values["erc/ratio_max"] = torch.where(valid, band.rho, -math.inf).amax().item()
