"""ERC's entropies at the numerics users run (issue: "ERC on real numerics").

* ``verl_ext.entropy.entropy_fp32`` against an fp64 reference: 1e-4 relative for H >= 1e-6 and
  1e-10 absolute below, on bf16 and fp32 logits, confident rows down to H ~ 1e-30, ties and
  masked (-inf) vocabulary; rows are independent of chunking and batch composition, bit for bit.
* verl's real actor stack on CPU (``TrainingWorker`` -> FSDP2) under verl's **default bf16 mixed
  precision** and fp32, with a tiny Qwen3 whose head makes many tokens' entropy <= 1e-6: the
  old-log-prob pass, then one ERC-DAPO update on the same batch before any optimizer step. Every
  ratio is exactly 1 and ERC masks nothing (``erc/ratio_min == erc/ratio_max == 1``) -- with
  remove-padding, the padded path, verl's chunked entropy, ``entropy_checkpointing`` and dynamic
  batching with different token budgets for the two passes (``verl_ext.onpolicy`` packs the
  old-log-prob pass as the update, so both passes see the same micro-batches: bit-equality is what
  the code guarantees here; tests/test_onpolicy.py varies the packings). The mixed arrangement of the first release
  (pi_old from verl's function, pi_theta from ours) is kept as a control: it masks tokens.
* With the detached entropy, flash-attn's cross-entropy gets its in-place backward back: a spy on
  verl's ``logprobs_from_logits`` sees ``inplace_backward=True`` for ERC and ``False`` for verl's
  autograd entropy.
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
    full_params,
    make_actor_config,
    make_rollout_batch,
    save_tiny_qwen3,
    update_actor,
)
from tests.helpers import EXACT_SGD, param_delta, run_ranks

SPEC = TinyQwen3Spec()
HEAD_SCALE = 1000.0  # makes about half of the tokens' entropy <= 1e-6 nats
PROMPT_LENS = [3, 5, 4, 6, 2, 7]
RESPONSE_LENS = [12, 9, 14, 6, 10, 8]
BF16_DEFAULT: Optional[dict[str, str]] = None  # WorkerOptions(mixed_precision=None): verl's default (bf16)


def fp64_entropy(logits: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return -(log_p.exp() * log_p).nan_to_num(0.0).sum(dim=-1)


def peaky_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows from nearly uniform to entropy ~1e-30: random logits times a log-spaced temperature."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, vocab, generator=gen)
    scale = torch.logspace(-1, 2.6, rows).unsqueeze(1)
    return (base * scale).to(dtype)


def assert_matches_fp64(ours: torch.Tensor, logits: torch.Tensor) -> None:
    ref = fp64_entropy(logits)
    err = (ours.double() - ref).abs()
    big = ref >= 1e-6
    assert big.any() and (~big).any(), "the sample must cover both regimes"
    rel = err[big] / ref[big]
    assert rel.max() <= 1e-4, f"max relative error {rel.max():.3e} at H={ref[big][rel.argmax()]:.3e}"
    assert err[~big].max() <= 1e-10, f"max absolute error {err[~big].max():.3e} below H=1e-6"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [512, 151_936])
def test_entropy_fp32_matches_fp64_reference(dtype: torch.dtype, vocab: int) -> None:
    from verl_ext.core.entropy import entropy_fp32

    logits = peaky_logits(48, vocab, dtype)
    ours = entropy_fp32(logits)
    assert ours.dtype == torch.float32 and ours.shape == (48,)
    assert_matches_fp64(ours, logits)


def test_entropy_fp32_ties_masked_vocabulary_and_extremes() -> None:
    from verl_ext.core.entropy import entropy_fp32

    vocab = 1000
    rows = peaky_logits(6, vocab, torch.float32, seed=3)
    rows[0] = 0.0  # uniform: H = log V
    rows[1, :] = -50.0
    rows[1, :2] = 40.0  # an exact two-way tie on top of a near-certain pair: H = log 2
    rows[2, 100:] = float("-inf")  # masked vocabulary
    rows[3] = -1e4
    rows[3, 7] = 1e4  # certain: H = 0 exactly
    ours = entropy_fp32(rows)
    torch.testing.assert_close(ours[0].double(), torch.tensor(vocab, dtype=torch.float64).log(), rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[1].double(), torch.tensor(2.0, dtype=torch.float64).log(), rtol=1e-6, atol=0)
    assert ours[3].item() == 0.0
    assert torch.isfinite(ours).all()
    assert_matches_fp64(ours[[0, 1, 2, 4, 5, 3]], rows[[0, 1, 2, 4, 5, 3]])


def test_verl_bf16_formula_is_what_breaks() -> None:
    """The defect being fixed: verl's ``logsumexp(x) - sum(softmax(x) x)`` evaluated in bf16 returns
    0 (or noise) for confident tokens, where the fp64 entropy is small but not 0."""
    import verl.utils.torch_functional as verl_F

    logits = peaky_logits(48, 4096, torch.bfloat16)
    ref = fp64_entropy(logits)
    verl = verl_F.entropy_from_logits(logits).double()
    small = (ref > 0) & (ref < 1e-3)
    assert small.sum() >= 5
    assert ((verl[small] - ref[small]).abs() / ref[small]).max() > 0.5


def test_rows_are_independent_of_chunking_and_batch() -> None:
    from verl_ext.core.entropy import entropy_fp32

    logits = peaky_logits(37, 3000, torch.bfloat16, seed=5)
    whole = entropy_fp32(logits)
    assert torch.equal(whole, entropy_fp32(logits, chunk_size=1))
    assert torch.equal(whole, entropy_fp32(logits, chunk_size=7))
    assert torch.equal(whole[10:20], entropy_fp32(logits[10:20]))  # packed with other rows or not
    assert torch.equal(whole.reshape(1, 37), entropy_fp32(logits.reshape(1, 37, 3000)))  # (bsz, seq, vocab)
    with pytest.raises(ValueError, match="entropy_from_logits_chunk_size"):
        entropy_fp32(logits, chunk_size=0)


def test_eager_path_equals_the_compiled_formula_uncompiled() -> None:
    """The eager chunk kernel (buffers reused, arg-max zeroed) and the compile-friendly formula (tie
    count) are the same function of each row; on CPU they agree to the last bit or one ulp."""
    from verl_ext.core.entropy import _entropy_rows, entropy_fp32

    logits = peaky_logits(40, 2048, torch.bfloat16, seed=9)
    torch.testing.assert_close(entropy_fp32(logits), _entropy_rows(logits), rtol=3e-7, atol=1e-30)


def test_no_graph_and_logits_untouched() -> None:
    from verl_ext.core.entropy import entropy_fp32

    logits = peaky_logits(8, 256, torch.float32).requires_grad_(True)
    before = logits.detach().clone()
    out = entropy_fp32(logits)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(logits.detach(), before)


# ------------------------------------------------------------------------------------------------
# verl's actor stack on CPU
# ------------------------------------------------------------------------------------------------


def erc_actor_config(entropy_coeff: float = 0.0) -> Any:
    from verl_ext.config import DivClipPolicyLossConfig

    policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05)
    return make_actor_config(
        policy_loss=policy, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, entropy_coeff=entropy_coeff
    )


def with_old(batch: Any, old: dict[str, torch.Tensor]) -> Any:
    out = batch.clone()
    out["old_log_probs"] = old["old_log_probs"]
    out["entropy"] = old["entropy"]
    return out


class LogprobSpy:
    """Records the ``inplace_backward`` argument of every call to verl's ``logprobs_from_logits``
    from the FSDP engine (the argument flash-attn's cross-entropy gets on a GPU node)."""

    def __init__(self) -> None:
        import verl.workers.engine.fsdp.transformer_impl as impl

        self.impl = impl
        from verl_ext.engine.swap import verl_function

        self.previous = impl.logprobs_from_logits  # the seam's dispatcher once installed, restored on exit
        self.original = verl_function(impl, "logprobs_from_logits")
        self.calls: list[bool] = []

    def __enter__(self) -> LogprobSpy:
        def spy(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
            self.calls.append(bool(inplace_backward))
            return self.original(logits=logits, labels=labels, inplace_backward=inplace_backward)

        from verl_ext.engine.swap import install_dispatch

        self.impl.logprobs_from_logits = spy
        install_dispatch(self.impl, "logprobs_from_logits")  # the seam's per-step override still dispatches over it
        return self

    def __exit__(self, *exc: Any) -> None:
        self.impl.logprobs_from_logits = self.previous


def on_policy_erc(model_path: str, options: WorkerOptions, batch: Any) -> dict[str, Any]:
    """Old-log-prob pass, then one ERC-DAPO update on the same batch before any optimizer step."""
    from recipe.bench.features import entropy_path_of
    from verl_ext.actor_loss import build_actor_loss

    worker = build_actor_worker(model_path, options)
    worker.set_loss_fn(build_actor_loss(erc_actor_config()))
    old = compute_log_prob(worker, batch)
    before = full_params(worker)
    with LogprobSpy() as spy:
        metrics = update_actor(worker, with_old(batch, old), calculate_entropy=True)
    return {
        "metrics": metrics,
        "old_entropy": old["entropy"].values(),
        "delta": param_delta(before, full_params(worker)),
        "inplace_backward": spy.calls,
        "path": entropy_path_of(worker.engine).value,
    }


def job_on_policy(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    from verl.workers.utils.losses import ppo_loss

    from recipe.bench.harness import ppo_loss_fn
    from verl_ext.actor_loss import build_actor_loss

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    sgd: dict[str, Any] = dict(EXACT_SGD)
    variants = {
        "bf16/rmpad": WorkerOptions(mixed_precision=BF16_DEFAULT, **sgd),
        "bf16/padded": WorkerOptions(mixed_precision=BF16_DEFAULT, use_remove_padding=False, **sgd),
        "bf16/chunked": WorkerOptions(mixed_precision=BF16_DEFAULT, entropy_from_logits_with_chunking=True, **sgd),
        "bf16/entropy_checkpointing": WorkerOptions(mixed_precision=BF16_DEFAULT, entropy_checkpointing=True, **sgd),
        "bf16/padded/entropy_checkpointing": WorkerOptions(
            mixed_precision=BF16_DEFAULT, use_remove_padding=False, entropy_checkpointing=True, **sgd
        ),
        # dynamic batching with different budgets: 40 tokens for the update, 64 for the old-log-prob
        # pass, which verl_ext.onpolicy packs as the update (identical micro-batches)
        "bf16/dynamic": WorkerOptions(
            mixed_precision=BF16_DEFAULT,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=40,
            infer_max_token_len_per_gpu=64,
            **sgd,
        ),
        "fp32/rmpad": WorkerOptions(mixed_precision=dict(FP32_MIXED_PRECISION), **sgd),
    }
    out: dict[str, Any] = {name: on_policy_erc(model_path, opts, batch) for name, opts in variants.items()}

    # Control, the first release's arrangement: pi_old's entropy from verl's function (the engine
    # not marked), pi_theta's from the divclip path.
    verl_worker = build_actor_worker(model_path, variants["bf16/rmpad"])
    verl_worker.set_loss_fn(ppo_loss_fn(make_actor_config()))
    old_verl = compute_log_prob(verl_worker, batch)
    erc_worker = build_actor_worker(model_path, variants["bf16/rmpad"])
    erc_worker.set_loss_fn(build_actor_loss(erc_actor_config()))
    out["mixed_control"] = update_actor(erc_worker, with_old(batch, old_verl), calculate_entropy=True)

    # verl's own path keeps verl's autograd entropy and flash-attn's out-of-place backward.
    worker = build_actor_worker(model_path, variants["bf16/rmpad"])
    worker.set_loss_fn(ppo_loss_fn(make_actor_config()))
    with LogprobSpy() as spy:
        update_actor(worker, batch, calculate_entropy=True)
    out["verl_inplace_backward"] = spy.calls
    del ppo_loss
    return out


@pytest.fixture(scope="module")
def confident_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny_qwen3_confident")), SPEC, seed=0, head_scale=HEAD_SCALE)


@pytest.fixture(scope="module")
def on_policy(confident_model: str) -> dict[str, Any]:
    return run_ranks(job_on_policy, 1, confident_model)[0]


ON_POLICY_VARIANTS = [
    "bf16/rmpad",
    "bf16/padded",
    "bf16/chunked",
    "bf16/entropy_checkpointing",
    "bf16/padded/entropy_checkpointing",
    "bf16/dynamic",
    "fp32/rmpad",
]


@pytest.mark.parametrize("variant", ON_POLICY_VARIANTS)
def test_on_policy_erc_masks_nothing(on_policy: dict[str, Any], variant: str) -> None:
    result = on_policy[variant]
    m = result["metrics"]
    assert result["path"] == "divclip_fp32"
    # the model is confident: many tokens have an entropy at or below 1e-6 nats
    assert float((result["old_entropy"] <= 1e-6).float().mean()) >= 0.3
    assert all(float(v) == 1.0 for v in m["actor/divclip/erc/ratio_min"]), m["actor/divclip/erc/ratio_min"]
    assert all(float(v) == 1.0 for v in m["actor/divclip/erc/ratio_max"]), m["actor/divclip/erc/ratio_max"]
    for key in (
        "actor/divclip/erc/clipfrac_upper",
        "actor/divclip/erc/clipfrac_lower",
        "actor/divclip/no_grad_frac",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
    ):
        assert all(float(v) == 0.0 for v in m[key]), (key, m[key])
    assert any((d != 0).any() for d in result["delta"].values()), "the update must still move the policy"


def job_on_policy_ulysses(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    """Both ranks form one Ulysses group (data-parallel size 1): each gets the whole batch; verl
    returns the group's outputs from rank 0, which hands pi_old's pass to its peer as the driver
    would."""
    from recipe.bench.features import entropy_path_of
    from recipe.bench.harness import ppo_loss_fn
    from verl_ext.actor_loss import build_actor_loss

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    options = WorkerOptions(mixed_precision=BF16_DEFAULT, ulysses_sequence_parallel_size=world_size, **EXACT_SGD)
    worker = build_actor_worker(model_path, options)
    worker.set_loss_fn(build_actor_loss(erc_actor_config()))
    old = [compute_log_prob(worker, batch)]
    torch.distributed.broadcast_object_list(old, src=0)
    before = full_params(worker)
    metrics = update_actor(worker, with_old(batch, old[0]), calculate_entropy=True, global_batch_size=len(PROMPT_LENS))
    delta = param_delta(before, full_params(worker))
    # The control: pi_old's entropy from verl's function (a worker without the ERC loss).
    verl_worker = build_actor_worker(model_path, options)
    verl_worker.set_loss_fn(ppo_loss_fn(make_actor_config()))
    old_verl = [compute_log_prob(verl_worker, batch)]
    torch.distributed.broadcast_object_list(old_verl, src=0)
    erc_worker = build_actor_worker(model_path, options)
    erc_worker.set_loss_fn(build_actor_loss(erc_actor_config()))
    control = update_actor(
        erc_worker, with_old(batch, old_verl[0]), calculate_entropy=True, global_batch_size=len(PROMPT_LENS)
    )
    return {
        "metrics": metrics,
        "old_entropy": old[0]["entropy"].values(),
        "delta": delta,
        "path": entropy_path_of(worker.engine).value,
        "mixed_control": control,
    }


def test_on_policy_erc_masks_nothing_under_ulysses_sequence_parallelism(confident_model: str) -> None:
    """Ulysses SP (2 ranks, verl's default bf16): the sequence is sliced across ranks, each computes
    its shard's log-probs and entropies, verl gathers them; both passes still use one function.

    On CPU there is no flash-attn and verl's Ulysses patch replaces only the flash-attention
    forward, so attention itself runs per shard here: this exercises SP's slicing and gathering
    around the entropy (the path ERC depends on), not sequence-parallel attention."""
    results = run_ranks(job_on_policy_ulysses, 2, confident_model)
    assert [r["path"] for r in results] == ["divclip_fp32", "divclip_fp32"]
    assert results[0]["old_entropy"].numel() == sum(RESPONSE_LENS)  # gathered: the whole batch's tokens
    assert float((results[0]["old_entropy"] <= 1e-6).float().mean()) >= 0.3
    m = results[0]["metrics"]
    assert m["actor/divclip/erc/ratio_min"] and m["actor/divclip/erc/ratio_max"]
    assert all(float(v) == 1.0 for v in m["actor/divclip/erc/ratio_min"] + m["actor/divclip/erc/ratio_max"]), m
    for key in ("actor/divclip/erc/clipfrac_upper", "actor/divclip/erc/clipfrac_lower", "actor/ppo_kl"):
        assert all(float(v) == 0.0 for v in m[key]), (key, m[key])
    for result in results:  # the update moved the policy, identically on both ranks of the group
        assert any((d != 0).any() for d in result["delta"].values())
    assert all(torch.equal(results[0]["delta"][k], results[1]["delta"][k]) for k in results[0]["delta"])
    control = results[0]["mixed_control"]  # the test can fail: mixed functions mask on-policy tokens here too
    masked = sum(map(float, control["actor/divclip/erc/clipfrac_upper"] + control["actor/divclip/erc/clipfrac_lower"]))
    assert masked > 0.05, control


def test_entropy_checkpointing_changes_nothing(on_policy: dict[str, Any]) -> None:
    for plain, ckpt in (
        ("bf16/rmpad", "bf16/entropy_checkpointing"),
        ("bf16/padded", "bf16/padded/entropy_checkpointing"),
    ):
        a, b = on_policy[plain]["delta"], on_policy[ckpt]["delta"]
        assert all(torch.equal(a[k], b[k]) for k in a), ckpt


def test_mixed_entropy_functions_mask_on_policy_tokens(on_policy: dict[str, Any]) -> None:
    """The control: with pi_old's entropy from verl's bf16 function, ERC masks on-policy tokens."""
    m = on_policy["mixed_control"]
    masked = sum(map(float, m["actor/divclip/erc/clipfrac_upper"])) + sum(
        map(float, m["actor/divclip/erc/clipfrac_lower"])
    )
    assert masked > 0.05
    assert max(map(float, m["actor/divclip/erc/ratio_max"])) > 1.05


def test_detached_entropy_restores_inplace_backward(on_policy: dict[str, Any]) -> None:
    calls = on_policy["bf16/rmpad"]["inplace_backward"]
    assert calls and all(calls)
    verl_calls = on_policy["verl_inplace_backward"]
    assert verl_calls and not any(verl_calls)


def test_engine_path_selection_and_fused_kernels() -> None:
    """The loss asks, the engine decides: with verl's fused kernels the kernel's entropy serves both
    passes (consistent), the fp32 path stays inactive, and the log says so."""
    from types import SimpleNamespace

    from verl_ext.core.entropy import entropy_fp32
    from verl_ext.engine.request import (
        EngineRequest,
        EntropyPath,
        describe,
        entropy_as_mask,
        request_of,
        resolve_entropy_path,
    )
    from verl_ext.engine.seam import EngineFeatures, entropy_fn_for

    def loss(**_: Any) -> None: ...

    assert request_of(loss) == EngineRequest() and not request_of(loss).entropy_as_mask
    from verl_ext.config_rules.policy import check_entropy_as_mask

    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.entropy_coeff=0\.01"):
        check_entropy_as_mask(entropy_coeff=0.01)
    check_entropy_as_mask(entropy_coeff=0.0)
    masked = request_of(entropy_as_mask(loss))
    assert masked.entropy_as_mask
    assert resolve_entropy_path(masked, use_fused_kernels=False) is EntropyPath.DIVCLIP_FP32
    assert resolve_entropy_path(masked, use_fused_kernels=True) is EntropyPath.FUSED_KERNEL
    assert resolve_entropy_path(EngineRequest(), use_fused_kernels=False) is EntropyPath.VERL
    eager = SimpleNamespace(engine_config=SimpleNamespace(use_torch_compile=False))
    assert entropy_fn_for(eager) is entropy_fp32  # compiled only on CUDA with use_torch_compile
    assert "use_fused_kernels=True" in describe(masked, EntropyPath.FUSED_KERNEL)
    path = EngineFeatures(masked, EntropyPath.FUSED_KERNEL, None).step_path(False, old_log_prob_from_update=0.0)
    assert path["entropy_fp32"] == 0.0
