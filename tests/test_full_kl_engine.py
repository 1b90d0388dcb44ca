"""kl_full inside verl's real actor stack (TrainingWorker -> FSDPEngineWithLMHead, FSDP2 on gloo, CPU).

* the old-log-prob pass stores pi_old's top-k for the response tokens, row-aligned: with k = vocabulary
  the stored log-mass of each sampled token is verl's own old log-prob;
* on-policy (same weights, identical packing) the coarsened KL is exactly 0 and nothing is clipped,
  under verl's default bf16 (remove-padding on and off) and fp32, and the diagnostic on kl3 reports
  no disagreement;
* off-policy, the update's per-micro-batch mean coarsened KL is the one computed directly from the two
  models' logits (pi_theta evaluated on the stored ids at the right rows);
* the same through the vocabulary pass (``policy_loss.vocab_pass``: no logits tensor in either pass):
  on-policy exactly 0 under bf16 (remove-padding, padded, ERC with 2:1 dynamic batching), the stored
  top-k equals the materialised one in fp32, and the off-policy KL matches the direct computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from recipe.bench.harness import (
    FP32_MIXED_PRECISION,
    TinyQwen3Spec,
    WorkerOptions,
    build_actor_worker,
    compute_log_prob,
    make_actor_config,
    make_rollout_batch,
    save_tiny_qwen3,
    update_actor,
)
from tests.helpers import EXACT_SGD, run_ranks

SPEC = TinyQwen3Spec()
PROMPT_LENS = [3, 5, 4, 6]
RESPONSE_LENS = [9, 4, 7, 6]
K = 16
BF16_DEFAULT: Optional[dict[str, str]] = None  # verl's default mixed precision (bf16)


def kl_full_config(mode: str = "kl_full", **policy: Any) -> Any:
    from verl_ext.config import DivClipPolicyLossConfig

    return make_actor_config(
        policy_loss=DivClipPolicyLossConfig(loss_mode=mode, kl_full_top_k=K, **policy),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )


def with_old(batch: Any, old: dict[str, torch.Tensor]) -> Any:
    out = batch.clone()
    for key, value in old.items():
        out[key] = value
    return out


def on_policy(model_path: str, options: WorkerOptions, batch: Any, cfg: Any) -> dict[str, Any]:
    from verl_ext.actor_loss import build_actor_loss

    worker = build_actor_worker(model_path, options)
    worker.set_loss_fn(build_actor_loss(cfg))
    old = compute_log_prob(worker, batch, old_topk=K)
    return {"metrics": update_actor(worker, with_old(batch, old), calculate_entropy=True), "old": old}


def direct_logits(model_path: str, batch: Any) -> list[torch.Tensor]:
    """Each sequence's response-predicting logit rows from a plain fp32 transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids, response_len in zip(batch["input_ids"].unbind(), RESPONSE_LENS, strict=False):
            logits = model(ids[None]).logits[0]
            rows.append(logits[len(ids) - response_len - 1 : len(ids) - 1])
    return rows


def job(rank: int, world_size: int, model_path: str, other_path: str) -> dict[str, Any]:
    from verl_ext.actor_loss import build_actor_loss

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    sgd: dict[str, Any] = dict(EXACT_SGD)
    out: dict[str, Any] = {}
    for name, options in {
        "bf16/rmpad": WorkerOptions(mixed_precision=BF16_DEFAULT, **sgd),
        "bf16/padded": WorkerOptions(mixed_precision=BF16_DEFAULT, use_remove_padding=False, **sgd),
        "fp32/rmpad": WorkerOptions(mixed_precision=dict(FP32_MIXED_PRECISION), **sgd),
    }.items():
        out[name] = on_policy(model_path, options, batch, kl_full_config())["metrics"]
    # with ERC the old-log-prob pass is packed as the update (verl_ext.onpolicy) and the top-k fields
    # are put back in the batch's order with the others: dynamic batching at a 2:1 budget
    dynamic = WorkerOptions(
        mixed_precision=BF16_DEFAULT,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=24,
        infer_max_token_len_per_gpu=48,
        **sgd,
    )
    out["bf16/erc/dynamic"] = on_policy(
        model_path, dynamic, batch, kl_full_config(erc_beta_low=0.05, erc_beta_high=0.05)
    )["metrics"]
    out["bf16/kl3_diagnostic"] = on_policy(
        model_path,
        WorkerOptions(mixed_precision=BF16_DEFAULT, **sgd),
        batch,
        kl_full_config("kl3", kl_full_diagnostic=True),
    )["metrics"]

    # k = vocabulary in fp32: the stored log-mass of the sampled token is verl's old log-prob
    fp32 = WorkerOptions(mixed_precision=dict(FP32_MIXED_PRECISION), **sgd)
    worker = build_actor_worker(model_path, fp32)
    worker.set_loss_fn(build_actor_loss(kl_full_config()))
    full = compute_log_prob(worker, batch, old_topk=SPEC.vocab_size)
    out["full_vocab"] = {key: value.values() for key, value in full.items()}
    out["responses"] = batch["responses"].values()

    # off-policy: pi_old = the model at model_path (top-k stored by its pass), pi_theta = other_path
    old = compute_log_prob(worker, batch, old_topk=K)
    other = build_actor_worker(other_path, fp32)
    other.set_loss_fn(build_actor_loss(kl_full_config(delta=0.005)))
    out["off_policy"] = update_actor(other, with_old(batch, old), calculate_entropy=True)
    out["topk_materialised"] = {key: value.values() for key, value in old.items()}
    out.update(job_vocab_pass(model_path, other_path, batch, sgd, dynamic, fp32))
    return out


def job_vocab_pass(
    model_path: str, other_path: str, batch: Any, sgd: dict[str, Any], dynamic: WorkerOptions, fp32: WorkerOptions
) -> dict[str, Any]:
    """The variants above with ``policy_loss.vocab_pass=true``; counts the pass's bucket evaluations
    (each a chunked sweep of the head: the logits tensor is never built)."""
    import verl_ext.engine.topk_capture as topk_capture  # the pass's buckets, as the seam calls them
    from verl_ext.actor_loss import build_actor_loss

    original = topk_capture.bucket_log_masses
    calls: list[int] = []
    topk_capture.bucket_log_masses = lambda hidden, *a, **k: calls.append(hidden.shape[0]) or original(hidden, *a, **k)
    out: dict[str, Any] = {}
    try:
        for name, options, cfg in (
            ("vp/bf16/rmpad", WorkerOptions(mixed_precision=BF16_DEFAULT, **sgd), kl_full_config(vocab_pass=True)),
            (
                "vp/bf16/padded",
                WorkerOptions(mixed_precision=BF16_DEFAULT, use_remove_padding=False, **sgd),
                kl_full_config(vocab_pass=True),
            ),
            ("vp/bf16/erc/dynamic", dynamic, kl_full_config(vocab_pass=True, erc_beta_low=0.05, erc_beta_high=0.05)),
            (
                "vp/bf16/kl3_diagnostic",
                WorkerOptions(mixed_precision=BF16_DEFAULT, **sgd),
                kl_full_config("kl3", kl_full_diagnostic=True, vocab_pass=True),
            ),
        ):
            out[name] = on_policy(model_path, options, batch, cfg)["metrics"]
        worker = build_actor_worker(model_path, fp32)
        worker.set_loss_fn(build_actor_loss(kl_full_config(vocab_pass=True)))
        old = compute_log_prob(worker, batch, old_topk=K)
        out["topk_vocab_pass"] = {key: value.values() for key, value in old.items()}
        other = build_actor_worker(other_path, fp32)
        other.set_loss_fn(build_actor_loss(kl_full_config(delta=0.005, vocab_pass=True)))
        out["vp/off_policy"] = update_actor(other, with_old(batch, old), calculate_entropy=True)
    finally:
        topk_capture.bucket_log_masses = original
    out["bucket_rows_evaluated"] = sum(calls)
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = Path(tmp_path_factory.mktemp("tiny_qwen3_kl_full"))
    model_path = save_tiny_qwen3(root / "old", SPEC, seed=0, head_scale=4.0)
    other_path = save_tiny_qwen3(root / "new", SPEC, seed=1, head_scale=4.0)
    out = run_ranks(job, 1, model_path, other_path)[0]
    out["paths"] = (model_path, other_path)
    return out


@pytest.mark.parametrize(
    "variant",
    [
        "bf16/rmpad",
        "bf16/padded",
        "fp32/rmpad",
        "bf16/erc/dynamic",
        "vp/bf16/rmpad",
        "vp/bf16/padded",
        "vp/bf16/erc/dynamic",
    ],
)
def test_on_policy_kl_full_is_exactly_zero_and_clips_nothing(result: dict[str, Any], variant: str) -> None:
    m = result[variant]
    for key in (
        "actor/divclip/kl_full_mean",
        "actor/divclip/kl_full_max",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/divclip/no_grad_frac",
    ):
        assert all(float(v) == 0.0 for v in m[key]), (key, m[key])
    # the tail is a real bucket: k = 16 of 512 ids leave mass outside under both policies, equally
    assert all(0.0 < float(v) < 1.0 for v in m["actor/divclip/kl_full_tail_old"])
    assert m["actor/divclip/kl_full_tail_old"] == m["actor/divclip/kl_full_tail_new"]


@pytest.mark.parametrize("variant", ["bf16/kl3_diagnostic", "vp/bf16/kl3_diagnostic"])
def test_on_policy_diagnostic_on_kl3_reports_no_disagreement(result: dict[str, Any], variant: str) -> None:
    m = result[variant]
    for key in (
        "actor/divclip/kl_full_diag/mode_only_frac",
        "actor/divclip/kl_full_diag/full_only_frac",
        "actor/divclip/kl_full_diag/mode_only_frac_kl3delta",
        "actor/divclip/kl_full_diag/full_only_frac_kl3delta",
        "actor/divclip/kl_full_mean",
        "actor/pg_clipfrac",
    ):
        assert all(float(v) == 0.0 for v in m[key]), (key, m[key])


def test_stored_topk_is_row_aligned_with_verls_log_probs(result: dict[str, Any]) -> None:
    full = result["full_vocab"]
    masses, ids = full["divclip_old_topk_log_probs"], full["divclip_old_topk_ids"]
    assert masses.shape == (sum(RESPONSE_LENS), SPEC.vocab_size + 1) and ids.dtype == torch.int32
    assert torch.isneginf(masses[:, -1]).all()  # k = vocabulary: an empty tail
    column = (ids.long() == result["responses"][:, None]).float().argmax(-1, keepdim=True)  # the token's slot
    at_token = masses.gather(-1, column).squeeze(-1)
    torch.testing.assert_close(at_token, full["old_log_probs"], rtol=0, atol=2e-5)
    assert (masses[:, :-2] >= masses[:, 1:-1]).all()  # sorted, most likely first


def test_vocab_pass_stores_the_materialised_top_k(result: dict[str, Any]) -> None:
    """fp32: the pass's top-k ids are the materialised logits' (as sets: ties may order differently)
    and each log-mass agrees to float32 logit rounding; the pass evaluated the buckets of every response
    row: 4 on-policy runs x (old pass + update) + the fp32 old pass + the off-policy update."""
    mat, vp = result["topk_materialised"], result["topk_vocab_pass"]
    ids_mat, ids_vp = mat["divclip_old_topk_ids"].long(), vp["divclip_old_topk_ids"].long()
    assert ids_vp.shape == ids_mat.shape == (sum(RESPONSE_LENS), K) and vp["divclip_old_topk_ids"].dtype == torch.int32
    assert torch.equal(ids_vp.sort(-1).values, ids_mat.sort(-1).values)
    order_mat, order_vp = ids_mat.argsort(-1), ids_vp.argsort(-1)
    masses_mat, masses_vp = mat["divclip_old_topk_log_probs"], vp["divclip_old_topk_log_probs"]
    torch.testing.assert_close(
        masses_vp[:, :-1].gather(1, order_vp), masses_mat[:, :-1].gather(1, order_mat), rtol=0, atol=2e-5
    )
    torch.testing.assert_close(masses_vp[:, -1], masses_mat[:, -1], rtol=0, atol=2e-5)
    assert result["bucket_rows_evaluated"] == (4 * 2 + 1 + 1) * sum(RESPONSE_LENS)


@pytest.mark.parametrize("variant", ["off_policy", "vp/off_policy"])
def test_off_policy_kl_matches_the_two_models_logits(result: dict[str, Any], variant: str) -> None:
    from verl_ext.core.coarsened_kl import coarsened_kl, log_masses_rows, topk_rows

    model_path, other_path = result["paths"]
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    old_rows, new_rows = direct_logits(model_path, batch), direct_logits(other_path, batch)
    per_sequence = []
    for old, new in zip(old_rows, new_rows, strict=False):
        old_masses, ids = topk_rows(old, K)
        per_sequence.append(coarsened_kl(log_masses_rows(new, ids), old_masses, "forward"))
    m = result[variant]
    # micro-batches of 2 sequences (the harness' micro_batch_size_per_gpu): verl averages their token means
    expected = sum(torch.cat(per_sequence[i : i + 2]).mean().item() for i in (0, 2)) / 2
    (got,) = [float(v) for v in m["actor/divclip/kl_full_mean"]]
    assert got == pytest.approx(expected, rel=1e-4)
    assert got > 0.01  # two different random models: a real divergence
    assert any(float(v) > 0 for v in m["actor/pg_clipfrac"])
