"""ERC on verl's own policy losses (``verl_ext.verl_modes``), and dual-clip left to verl there.

Loss level, every verl mode, against verl's function itself:
* a band too wide to trigger gives exactly verl's loss and gradient;
* with entropies forced out of the band, the loss *value* is exactly verl's, those tokens' gradient
  is exactly 0 and every other token's gradient is exactly verl's (every verl mode qualifies: GSPO's
  and geo_mean's sequence terms and clip_cov/kl_cov's selections are functions of values);
* ``dual_clip_c`` (the divclip modes' key) is refused on every verl mode, naming the key verl reads
  (``actor.clip_ratio_c``).
Engine level (verl's actor stack on CPU, verl's default bf16 mixed precision): for vanilla, gspo and
sapo the wide band gives verl's update bit for bit, and the forced band gives the update of the same
mode with those tokens' advantages set to 0 (no gradient from them), with ``erc/*`` metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from recipe.bench.harness import (
    TinyQwen3Spec,
    WorkerOptions,
    build_actor_worker,
    compute_log_prob,
    full_params,
    make_actor_config,
    make_rollout_batch,
    save_tiny_qwen3,
    update_actor,
)
from tests.helpers import EXACT_SGD, param_delta, run_ranks

VERL_MODES = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo"]
WIDE = dict(erc_beta_low=0.99, erc_beta_high=1e6)
NARROW = dict(erc_beta_low=0.05, erc_beta_high=0.05)


def policy_config(mode: str, **knobs: Any) -> Any:
    from verl_ext.config import DivClipPolicyLossConfig

    extra = {"dro_beta": 0.1} if mode == "dro" else {}
    return DivClipPolicyLossConfig(loss_mode=mode, **extra, **knobs)


def actor(mode: str, **knobs: Any) -> Any:
    cfg = make_actor_config(policy_loss=policy_config(mode, **knobs), clip_ratio_low=0.2, clip_ratio_high=0.28)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    return cfg


def loss_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 16
    old = -3.0 * torch.rand(b, t, generator=gen)
    new = old + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, t).clone()
    adv[:, ::5] *= -1.0  # both signs inside a sequence too
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 12:] = False
    mask[4, 9:] = False
    old_entropy = 0.1 + 2.0 * torch.rand(b, t, generator=gen)
    scale = torch.ones(b, t)
    scale.view(-1)[::3] = 1.3  # every third token: rho = 1.3, above the band
    scale.view(-1)[1::7] = 0.7  # and some below it
    return {
        "old": old,
        "new": new,
        "adv": adv,
        "mask": mask,
        "old_entropy": old_entropy,
        "entropy": old_entropy * scale,
        "outside": (scale != 1.0) & mask,
    }


def run_loss(mode: str, inputs: dict[str, torch.Tensor], policy_knobs: Optional[dict[str, Any]]) -> tuple:
    """(loss, d loss / d log_prob, metrics) through verl_policy_loss; ``None`` knobs = plain verl."""
    from verl_ext.verl_modes import verl_policy_loss

    cfg = actor(mode, **(policy_knobs or {}))
    log_prob = inputs["new"].clone().requires_grad_(True)
    torch.manual_seed(0)  # clip_cov draws a random subset
    loss, metrics = verl_policy_loss(
        mode,
        old_log_prob=inputs["old"],
        log_prob=log_prob,
        advantages=inputs["adv"],
        response_mask=inputs["mask"],
        loss_agg_mode="token-mean",
        config=cfg,
        policy=cfg.policy_loss if policy_knobs is not None else None,
        old_entropy=inputs["old_entropy"],
        entropy=inputs["entropy"],
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("mode", VERL_MODES)
def test_wide_band_is_exactly_verl(mode: str) -> None:
    inputs = loss_inputs()
    plain = run_loss(mode, inputs, None)
    wide = run_loss(mode, inputs, WIDE)
    assert torch.equal(plain[0], wide[0]) and torch.equal(plain[1], wide[1])
    assert wide[2]["actor/divclip/erc/clipfrac_upper"] == 0.0 and "actor/divclip/erc/clipfrac_upper" not in plain[2]


@pytest.mark.parametrize("mode", VERL_MODES)
def test_out_of_band_tokens_lose_exactly_their_own_gradient(mode: str) -> None:
    inputs = loss_inputs()
    outside = inputs["outside"]
    plain_loss, plain_grad, _ = run_loss(mode, inputs, None)
    loss, grad, metrics = run_loss(mode, inputs, NARROW)
    assert torch.equal(loss, plain_loss), "ERC keeps every forward value"
    assert (grad[outside] == 0).all()
    assert torch.equal(grad[~outside], plain_grad[~outside])
    assert (plain_grad[outside] != 0).any(), "the test must mask tokens that had a gradient"
    n = inputs["mask"].sum()
    assert metrics["actor/divclip/erc/clipfrac_upper"] == pytest.approx(
        float(((inputs["entropy"] > inputs["old_entropy"] * 1.05) & inputs["mask"]).sum() / n)
    )
    assert metrics["actor/divclip/erc/ratio_max"] == pytest.approx(1.3, rel=1e-6)
    assert metrics["actor/divclip/erc/ratio_min"] == pytest.approx(0.7, rel=1e-6)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "sapo", "cispo"])
def test_dual_clip_c_is_refused_on_verls_modes(mode: str) -> None:
    """One name per mode family: verl's modes read verl's actor.clip_ratio_c (vanilla applies it), the divclip
    modes policy_loss.dual_clip_c."""
    with pytest.raises(ValueError) as refused:
        policy_config(mode, dual_clip_c=10.0)
    assert str(refused.value) == (
        "actor_rollout_ref.actor.policy_loss.dual_clip_c is the divclip modes' dual-clip cap; "
        f"verl's loss_mode={mode!r} reads its own (actor_rollout_ref.actor.clip_ratio_c, which verl's vanilla "
        "applies; the other verl modes have no dual-clip rule): remove dual_clip_c"
    )


def test_erc_is_refused_on_bypass_mode() -> None:
    with pytest.raises(ValueError) as refused:
        policy_config("bypass_mode", **NARROW)
    assert str(refused.value) == (
        "actor_rollout_ref.actor.policy_loss.erc_beta_low/erc_beta_high (ERC) cannot stack on loss_mode='bypass_mode': "
        "it skips the old-log-prob pass that gives pi_old's entropy"
    )


# ------------------------------------------------------------------------------------------------
# verl's actor stack on CPU, verl's default bf16 mixed precision
# ------------------------------------------------------------------------------------------------

SPEC = TinyQwen3Spec()
PROMPT_LENS = [3, 5, 4, 6]
RESPONSE_LENS = [9, 4, 7, 6]
ENGINE_MODES = ["vanilla", "gspo", "sapo"]
RHO = torch.tensor([0.5, 0.97, 1.0, 1.03, 1.5, 0.9, 1.2])  # H_new / H_old per token (cycled)


def engine_update(model_path: str, cfg: Any, batch: Any) -> dict[str, Any]:
    from verl_ext.actor_loss import build_actor_loss

    worker = build_actor_worker(model_path, WorkerOptions(mixed_precision=None, **EXACT_SGD))
    worker.set_loss_fn(build_actor_loss(cfg))
    before = full_params(worker)
    metrics = update_actor(worker, batch, calculate_entropy=True)
    return {"metrics": metrics, "delta": param_delta(before, full_params(worker))}


def job_engine(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    from verl.workers.config import PolicyLossConfig

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=5)
    probe = build_actor_worker(model_path, WorkerOptions(mixed_precision=None, **EXACT_SGD))
    from verl_ext.actor_loss import build_actor_loss

    probe.set_loss_fn(build_actor_loss(actor("vanilla", **NARROW)))  # the divclip entropy path, as ERC runs
    old = compute_log_prob(probe, batch)
    n = sum(RESPONSE_LENS)
    rho = RHO.repeat(n // len(RHO) + 1)[:n]
    batch["old_log_probs"] = old["old_log_probs"]
    batch["entropy"] = torch.nested.as_nested_tensor(
        list((old["entropy"].values() / rho).split(RESPONSE_LENS)), layout=torch.jagged
    )
    outside = (rho <= 0.95) | (rho >= 1.05)
    zeroed = batch.clone()
    adv = batch["advantages"].values().clone()
    adv[outside] = 0.0
    zeroed["advantages"] = torch.nested.as_nested_tensor(list(adv.split(RESPONSE_LENS)), layout=torch.jagged)
    out: dict[str, Any] = {"outside_frac": float(outside.float().mean())}
    for mode in ENGINE_MODES:
        plain = make_actor_config(
            policy_loss=PolicyLossConfig(loss_mode=mode), clip_ratio_low=0.2, clip_ratio_high=0.28
        )
        out[f"{mode}/plain"] = engine_update(model_path, plain, batch)
        out[f"{mode}/wide"] = engine_update(model_path, actor(mode, **WIDE), batch)
        out[f"{mode}/erc"] = engine_update(model_path, actor(mode, **NARROW), batch)
        out[f"{mode}/zeroed"] = engine_update(model_path, plain, zeroed)
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_path = save_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny_qwen3_verl_modes")), SPEC, seed=0)
    return run_ranks(job_engine, 1, model_path)[0]


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_engine_wide_band_is_verls_update(engine: dict[str, Any], mode: str) -> None:
    plain, wide = engine[f"{mode}/plain"]["delta"], engine[f"{mode}/wide"]["delta"]
    assert all(torch.equal(plain[k], wide[k]) for k in plain)


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_engine_erc_drops_the_out_of_band_tokens(engine: dict[str, Any], mode: str) -> None:
    erc, zeroed, plain = engine[f"{mode}/erc"], engine[f"{mode}/zeroed"], engine[f"{mode}/plain"]
    for k in erc["delta"]:
        torch.testing.assert_close(erc["delta"][k], zeroed["delta"][k], rtol=1e-5, atol=1e-8)
    assert any(not torch.allclose(erc["delta"][k], plain["delta"][k]) for k in plain["delta"])
    m = erc["metrics"]
    masked = sum(map(float, m["actor/divclip/erc/clipfrac_upper"])) + sum(
        map(float, m["actor/divclip/erc/clipfrac_lower"])
    )
    assert masked == pytest.approx(engine["outside_frac"], rel=1e-6)
    assert max(map(float, m["actor/divclip/erc/ratio_max"])) == pytest.approx(1.5, rel=1e-5)


def test_extremes_aggregate_as_extremes_across_micro_batches_and_ranks() -> None:
    """``erc/ratio_min``, ``erc/ratio_max``, ``kl3_max`` are reported with verl's MIN/MAX aggregation,
    so the logged value is the extreme over micro-batches and ranks, not an average of extremes."""
    from verl.utils.metric import Metric

    from verl_ext.actor_loss import _aggregation_of

    micro_batches = [
        {
            "actor/divclip/erc/ratio_min": 0.9,
            "actor/divclip/erc/ratio_max": 1.1,
            "actor/divclip/kl3_max": 0.2,
            "actor/divclip/erc/clipfrac_upper": 0.1,
        },
        {
            "actor/divclip/erc/ratio_min": 0.7,
            "actor/divclip/erc/ratio_max": 1.3,
            "actor/divclip/kl3_max": 0.4,
            "actor/divclip/erc/clipfrac_upper": 0.3,
        },
    ]
    per_rank = []
    for rank in range(2):
        merged = {k: Metric(aggregation=_aggregation_of(k)) for k in micro_batches[0]}
        for mb in micro_batches:
            for k, v in mb.items():
                merged[k].append(Metric(aggregation=_aggregation_of(k), value=v - 0.05 * rank))
        per_rank.append(merged)
    reduced = {k: Metric.aggregate_dp([r[k] for r in per_rank]) for k in micro_batches[0]}
    assert reduced["actor/divclip/erc/ratio_min"] == pytest.approx(0.65)
    assert reduced["actor/divclip/erc/ratio_max"] == pytest.approx(1.3)
    assert reduced["actor/divclip/kl3_max"] == pytest.approx(0.4)
    assert reduced["actor/divclip/erc/clipfrac_upper"] == pytest.approx(0.175)  # a mean stays a mean
