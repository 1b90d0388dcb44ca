"""How stale a trained batch is, per token: how far the behaviour policy mu (the rollout's log-probs) is from
pi_old (the trainer's recompute).

In verl's asynchronous trainer modes the samples of a step come from older weights, so mu differs from pi_old;
rollout correction reweights by pi_old / mu, and the divclip trust region (pi_theta / pi_old) decides how much
of the update trusts it. This figure makes that distance visible in every run (docs/experiments.md, "Trainer
modes").
"""

from __future__ import annotations

import torch

from verl_ext.core.divergences import kl3


def behaviour_divergence(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """mu against pi_old over the valid tokens: the mean of KL3 = w - 1 - log w with w = pi_old / mu (the k3
    estimate of KL(mu || pi_old) from mu's samples, >= 0 per token) and the largest ``|log w|``.

    Args:
        old_log_prob: ``(batch, response)`` log pi_old of the sampled tokens.
        rollout_log_prob: ``(batch, response)`` log mu of the same tokens, as the rollout returned them.
        mask: ``(batch, response)`` valid response tokens.
    """
    valid = mask.bool()
    if not valid.any():
        return {}
    log_w = (old_log_prob.double() - rollout_log_prob.double())[valid]
    return {"behaviour_kl3_mean": float(kl3(log_w).mean()), "behaviour_log_ratio_abs_max": float(log_w.abs().max())}
