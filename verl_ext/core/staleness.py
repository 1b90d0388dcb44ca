"""How stale a trained batch is: the distance of the behaviour policy mu (the rollout's log-probs) from pi_old
(the trainer's recompute), which verl's asynchronous modes make non-zero (docs/experiments.md, "Trainer modes").
"""

from __future__ import annotations

import torch

from verl_ext.core.divergences import kl3


def behaviour_divergence(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """mu against pi_old over the valid tokens (all ``(batch, response)``): the mean of KL3 = w - 1 - log w,
    w = pi_old / mu (the k3 estimate of KL(mu || pi_old) from mu's samples, >= 0 per token), and the largest
    ``|log w|``."""
    valid = mask.bool()
    if not valid.any():
        return {}
    log_w = (old_log_prob.double() - rollout_log_prob.double())[valid]
    return {"behaviour_kl3_mean": float(kl3(log_w).mean()), "behaviour_log_ratio_abs_max": float(log_w.abs().max())}
