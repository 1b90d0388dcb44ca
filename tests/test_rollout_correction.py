"""verl's rollout correction (``algorithm.rollout_correction``) reaches the divclip losses as verl's own loss
applies it, and the constraint stays on pi_theta / pi_old.

verl computes the importance weights pi_old / mu (token- or sequence-level, truncated or masked at its
thresholds) and the rejection mask on the driver, from the trainer's pi_old and the rollout's mu; the update's
batch then carries ``rollout_is_weights`` (and a ``response_mask`` with the rejected tokens removed). verl's
losses multiply each token's surrogate by its weight. So do the divclip losses, in every mode: with weights
``w > 0`` the loss is the one for the advantages ``A * w`` (values and gradients), while the constraint -- which
tokens lose their gradient -- is decided on pi_theta / pi_old alone, exactly as without weights. With verl's
dual-clip the ``clip`` mode is verl's ``vanilla``, and the two agree with weights too.

Through the trainer, in an asynchronous mode, the weights reach the loss (``actor/divclip/rollout_is_weight_mean``
differs from 1 where verl's own ``rollout_corr/*`` figures say they do): tests/test_trainer_modes_cpu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import FSDPActorConfig

from tests.test_full_kl import operator_batch
from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.surrogate import constrained_policy_loss

ERC = dict(erc_beta_low=0.05, erc_beta_high=0.05)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{mode: (mode, {}) for mode in sorted(CONSTRAINTS)},
    "clip+erc": ("clip", ERC),
    "kl3+erc": ("kl3", ERC),
    "clip+dual_clip": ("clip", dict(dual_clip_c=3.0)),
}


def weights_for(mask: torch.Tensor, seed: int) -> torch.Tensor:
    """Positive weights spread around 1, as truncated IS weights are (0.3 .. 2.0)."""
    gen = torch.Generator().manual_seed(seed)
    return 0.3 + 1.7 * torch.rand(mask.shape, generator=gen, dtype=torch.float64)


def run(
    mode: str,
    knobs: dict[str, Any],
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    topk: Any,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    log_prob = new.clone().requires_grad_(True)
    entropies = {}
    if "erc_beta_low" in knobs:
        gen = torch.Generator().manual_seed(3)
        old_entropy = torch.rand(mask.shape, generator=gen, dtype=torch.float64) + 0.1
        entropies = dict(
            old_entropy=old_entropy,
            entropy=old_entropy * (0.9 + 0.2 * torch.rand(mask.shape, generator=gen, dtype=torch.float64)),
        )
    loss, metrics = constrained_policy_loss(
        old,
        log_prob,
        adv,
        mask,
        mode=mode,
        policy=DivClipPolicyLossConfig(loss_mode=mode, **knobs),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        topk=topk,
        rollout_is_weights=weights,
        **entropies,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_weights_enter_every_mode_as_verl_applies_them_and_the_constraint_stays_on_the_ratio(variant: str) -> None:
    mode, knobs = VARIANTS[variant]
    old, new, adv, mask, topk = operator_batch(11)
    weights = weights_for(mask, 5)
    loss, grad, metrics = run(mode, knobs, old, new, adv, mask, topk, weights)
    # the same loss as the advantages times the weights (values and gradients; float64)
    loss_scaled, grad_scaled, metrics_scaled = run(mode, knobs, old, new, adv * weights, mask, topk, None)
    torch.testing.assert_close(loss, loss_scaled, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, grad_scaled, rtol=1e-12, atol=1e-15)
    # which tokens the constraint cuts is decided on pi_theta / pi_old alone: the same with or without weights
    _, grad_plain, metrics_plain = run(mode, knobs, old, new, adv, mask, topk, None)
    decisions = [
        name for name in metrics_plain if "clipfrac" in name or name.endswith("no_grad_frac") or "masked" in name
    ]
    assert decisions, sorted(metrics_plain)
    for name in decisions:
        assert metrics[name] == metrics_plain[name] == metrics_scaled[name], name
    assert (grad_plain != 0).any() and not torch.allclose(grad, grad_plain)  # the weights do change the gradient


def test_with_dual_clip_the_clip_mode_is_verls_vanilla_with_weights_too() -> None:
    old, new, adv, mask, topk = operator_batch(12)
    weights = weights_for(mask, 6)
    _, grad, _ = run("clip", dict(dual_clip_c=3.0), old, new, adv, mask, None, weights)
    log_prob = new.clone().requires_grad_(True)
    vanilla = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=vanilla,
        rollout_is_weights=weights,
    )
    loss.backward()
    torch.testing.assert_close(grad, log_prob.grad, rtol=1e-10, atol=1e-12)


INSTALLED_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "kl3": ("kl3", {}),
    "clip+erc": ("clip", ERC),
    "gppo": ("gppo", {}),
    "vanilla+erc": ("vanilla", ERC),  # ERC on verl's own mode: verl's function under the entropy gate
}


@pytest.mark.parametrize("variant", list(INSTALLED_VARIANTS))
def test_the_installed_loss_hands_the_weights_to_the_policy_term(variant: str) -> None:
    """Through the loss installed on the actor workers (``build_actor_loss``, which calls verl's ``ppo_loss``):
    each token's gradient is its weight times its gradient without weights (the constraint's decisions do not
    depend on the weights, token-mean's denominator neither), and the divclip modes report the weights' mean
    as their registered function received it."""
    from recipe.bench.harness import make_actor_config
    from tests.test_ppo_loss_parity import (
        CLIP_RATIOS,
        PROMPT_LENS,
        RESPONSE_LENS,
        ParityCase,
        make_micro_batch,
        model_output_values,
    )
    from verl_ext.actor_loss import build_actor_loss

    mode, knobs = INSTALLED_VARIANTS[variant]
    erc = "erc_beta_low" in knobs
    config = make_actor_config(policy_loss=DivClipPolicyLossConfig(loss_mode=mode, **knobs), **CLIP_RATIOS)
    loss_fn = build_actor_loss(config)
    offsets = torch.tensor([0] + [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=False)]).cumsum(0)
    weighted = make_micro_batch(ParityCase("rollout_is_weights", rollout_is_weights=True))
    plain = weighted.clone()
    del plain["rollout_is_weights"]
    values = model_output_values(weighted)
    if erc:  # pi_old's entropy: pi_theta's within a few percent, some tokens outside the 5 % band
        gen = torch.Generator().manual_seed(4)
        old_entropy = []
        start = 0
        for prompt, response in zip(PROMPT_LENS, RESPONSE_LENS, strict=False):
            current = values["entropy"][start + prompt - 1 : start + prompt - 1 + response]
            old_entropy.append(current * (0.9 + 0.2 * torch.rand(response, generator=gen)))
            start += prompt + response
        for batch in (weighted, plain):
            batch["entropy"] = torch.nested.as_nested_tensor(old_entropy, layout=torch.jagged)

    def gradient(data: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        leaves = {
            name: values[name].clone().requires_grad_(True)
            for name in (("log_probs", "entropy") if erc else ("log_probs",))
        }
        model_output = {
            name: torch.nested.nested_tensor_from_jagged(leaf, offsets=offsets) for name, leaf in leaves.items()
        }
        loss, metrics = loss_fn(model_output=model_output, data=data.clone())
        return torch.autograd.grad(loss, leaves["log_probs"])[0], metrics

    grad_weighted, metrics = gradient(weighted)
    grad_plain, _ = gradient(plain)
    # the weights per flat position of the engine's output (a response sits one to the left of its tokens)
    weights = torch.ones_like(grad_plain)
    start = 0
    for prompt, response, row in zip(PROMPT_LENS, RESPONSE_LENS, weighted["rollout_is_weights"].unbind(), strict=False):
        weights[start + prompt - 1 : start + prompt - 1 + response] = row
        start += prompt + response
    assert (grad_plain != 0).sum() >= 5
    assert not torch.allclose(grad_weighted, grad_plain)  # the weights change the gradient ...
    torch.testing.assert_close(grad_weighted, weights * grad_plain, rtol=1e-6, atol=1e-9)  # ... token by token
    if mode in CONSTRAINTS:
        mask = weighted["response_mask"].values().bool()
        expected = float(weighted["rollout_is_weights"].values()[mask].mean())
        assert metrics["actor/divclip/rollout_is_weight_mean"].values == [pytest.approx(expected)]
