"""The on-policy gauge: before a step's first optimizer step pi_theta is pi_old, so every importance and ERC
entropy ratio should be exactly 1; :func:`on_policy_gauge` measures how far they are and how many tokens the clip
rules would drop for it (``actor/divclip/onpolicy/*``, on micro-batches the seam marks on-policy). Detached.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_ext.core.erc import entropy_ratio, outside_band


@torch.no_grad()
def on_policy_gauge(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    erc_band: Optional[tuple[float, float, float]] = None,
    outside: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """``onpolicy/*`` metrics of an on-policy micro-batch, over valid tokens:

    * ``log_ratio_abs_max``: max |log pi_theta - log pi_old| (0 when both passes agree);
    * ``ratio_clipfrac``: the tokens ``outside`` the mode's trust region (its own rule, bool like ``log_prob``),
      without ``outside`` w outside the actor's clip range (1 - eps_low, 1 + eps_high);
    * with both entropies, ``erc_ratio_dev_max`` = max |rho - 1|; with ``erc_band = (beta_low, beta_high, eps)``,
      ``erc_masked_frac``: the tokens ERC would drop (:func:`verl_ext.core.erc.outside_band`, NaN included).
    """
    valid = response_mask.bool()
    n_valid = max(int(valid.sum()), 1)
    log_ratio = torch.where(valid, log_prob.detach().float() - old_log_prob.detach().float(), 0.0)
    ratio = log_ratio.exp()
    if outside is None:
        outside = (ratio < 1.0 - clip_ratio_low) | (ratio > 1.0 + clip_ratio_high)
    out = {
        "onpolicy/log_ratio_abs_max": float(log_ratio.abs().max()) if valid.any() else 0.0,
        "onpolicy/ratio_clipfrac": float((outside.bool() & valid).sum()) / n_valid,
    }
    if old_entropy is not None and entropy is not None:
        eps = erc_band[2] if erc_band is not None else 1e-8
        rho = entropy_ratio(old_entropy, entropy, response_mask, eps)  # exactly 1 on padding
        out["onpolicy/erc_ratio_dev_max"] = float((rho - 1.0).abs().max())
        if erc_band is not None:
            beta_low, beta_high, _ = erc_band
            out["onpolicy/erc_masked_frac"] = float((outside_band(rho, beta_low, beta_high) & valid).sum()) / n_valid
    return out
