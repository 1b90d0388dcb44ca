"""The vocabulary pass in verl's real actor stack on CPU (``TrainingWorker`` -> FSDP2 on gloo).

* One rank, fp32: the old-log-prob pass's log-probs and entropies and one exact-SGD update's
  parameter change equal the materialised path's (verl's ``ppo_loss``) -- remove-padding and padded,
  untied and tied heads, without and with an entropy bonus (the entropy's gradient through the pass).
* One rank, verl's default bf16: both paths are compared with the fp32 materialised run; the
  pass's error is at most the materialised bf16 path's (log-probs, entropies, update).
* ERC's on-policy invariant through the pass (confident model, bf16): old-log-prob pass then the
  update on the same batch with identical packing -- every entropy ratio and every policy ratio is
  exactly 1, ERC masks nothing, the update still moves the policy.
* Two ranks, FSDP2 with the untied head sharded (a ``DTensor`` of ``Shard(0)``): the pass's log-probs
  and update equal the materialised path's, so FSDP2 unshards, reshards and reduce-scatters the
  head around it; and a 2-rank Ulysses group gives the materialised path's log-probs too.
* The pass replaces verl's ``prepare_model_outputs``: on the same micro-batch of one engine both write the
  same model-output keys (padded and not, with and without the entropy and pi_old's top-k task).
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
    ppo_loss_fn,
    save_tiny_qwen3,
    update_actor,
)
from tests.helpers import EXACT_SGD, param_delta, run_ranks, shard_for_rank

SPEC = TinyQwen3Spec()
PROMPT_LENS = [3, 5, 4, 6, 2, 7]
RESPONSE_LENS = [12, 9, 14, 6, 10, 8]
BF16: Optional[dict[str, str]] = None  # WorkerOptions(mixed_precision=None): verl's default bf16


def run_both(
    model_path: str, options: WorkerOptions, batch: Any, entropy_coeff: float = 0.0, **update: Any
) -> dict[str, Any]:
    """Old-log-prob pass and one update, materialised (verl's ppo_loss) and through the pass."""
    import verl_ext.engine.vocab_pass_step as engine_hook
    from recipe.bench.features import uses_vocab_pass, with_vocab_pass
    from verl_ext.engine import seam

    seam.install()
    original = engine_hook.vocab_pass
    out: dict[str, Any] = {}
    for name in ("materialised", "vocab_pass"):
        worker = build_actor_worker(model_path, options)
        loss = ppo_loss_fn(make_actor_config(entropy_coeff=entropy_coeff))
        worker.set_loss_fn(with_vocab_pass(loss) if name == "vocab_pass" else loss)
        assert uses_vocab_pass(worker.engine) == (name == "vocab_pass")
        calls: list[int] = []  # tokens the head's pass saw (proves the logits were never built)
        engine_hook.vocab_pass = lambda hidden, *a, seen=calls, **k: (
            seen.append(hidden.shape[0]) or original(hidden, *a, **k)
        )
        try:
            old = compute_log_prob(worker, batch)
            before = full_params(worker)
            metrics = update_actor(worker, batch, calculate_entropy=True, **update)
        finally:
            engine_hook.vocab_pass = original
        out[name] = {
            "pass_calls": len(calls),
            "old": None if old is None else {k: v.values() for k, v in old.items()},
            "delta": param_delta(before, full_params(worker)),
            "loss": metrics.get("loss"),
        }
    return out


def job_single_rank(rank: int, world_size: int, untied: str, tied: str) -> dict[str, Any]:
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    sgd: dict[str, Any] = dict(EXACT_SGD)
    fp32 = dict(FP32_MIXED_PRECISION)
    return {
        "fp32/rmpad": run_both(untied, WorkerOptions(mixed_precision=fp32, **sgd), batch),
        "fp32/padded": run_both(untied, WorkerOptions(mixed_precision=fp32, use_remove_padding=False, **sgd), batch),
        "fp32/tied": run_both(tied, WorkerOptions(mixed_precision=fp32, **sgd), batch),
        "fp32/entropy_bonus": run_both(untied, WorkerOptions(mixed_precision=fp32, **sgd), batch, entropy_coeff=0.05),
        "fp32/temperature": run_both(untied, WorkerOptions(mixed_precision=fp32, **sgd), batch, temperature=0.7),
        "bf16/rmpad": run_both(untied, WorkerOptions(mixed_precision=BF16, **sgd), batch),
        "bf16/padded": run_both(untied, WorkerOptions(mixed_precision=BF16, use_remove_padding=False, **sgd), batch),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = Path(tmp_path_factory.mktemp("vocab_pass_models"))
    untied = save_tiny_qwen3(root / "untied", SPEC, seed=0)
    tied = save_tiny_qwen3(root / "tied", TinyQwen3Spec(tie_word_embeddings=True), seed=0)
    return untied, tied


@pytest.fixture(scope="module")
def single_rank(models: tuple[str, str]) -> dict[str, Any]:
    return run_ranks(job_single_rank, 1, *models)[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def max_delta_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-parameter ||a - b|| / ||b|| over the parameters the update moved."""
    return max(rel(a[k], b[k]) for k in b if b[k].abs().max() > 0)


@pytest.mark.parametrize(
    "variant", ["fp32/rmpad", "fp32/padded", "fp32/tied", "fp32/entropy_bonus", "fp32/temperature"]
)
def test_fp32_equals_materialised_path(single_rank: dict[str, Any], variant: str) -> None:
    mat, ours = single_rank[variant]["materialised"], single_rank[variant]["vocab_pass"]
    assert mat["pass_calls"] == 0 and ours["pass_calls"] >= 2  # old-log-prob pass + update
    for key in ("old_log_probs", "entropy"):
        torch.testing.assert_close(ours["old"][key], mat["old"][key], rtol=1e-5, atol=1e-6)
    assert any((d != 0).any() for d in ours["delta"].values())
    assert max_delta_rel(ours["delta"], mat["delta"]) <= 1e-5


@pytest.mark.parametrize("variant", ["bf16/rmpad", "bf16/padded"])
def test_bf16_error_at_most_the_materialised_paths(single_rank: dict[str, Any], variant: str) -> None:
    """Against the fp32 run (same model, same batch): both bf16 paths share the bf16 trunk's error;
    the materialised path adds the bf16 rounding of every logit, the pass does not."""
    reference = single_rank["fp32/rmpad"]["materialised"]
    mat, ours = single_rank[variant]["materialised"], single_rank[variant]["vocab_pass"]
    for key in ("old_log_probs", "entropy"):
        pass_error = float((ours["old"][key] - reference["old"][key]).abs().max())
        mat_error = float((mat["old"][key] - reference["old"][key]).abs().max())
        assert pass_error <= mat_error, (key, pass_error, mat_error)
    pass_error = max_delta_rel(ours["delta"], reference["delta"])
    mat_error = max_delta_rel(mat["delta"], reference["delta"])
    assert pass_error <= mat_error, (pass_error, mat_error)


# ------------------------------------------------------------------------------------------------
# ERC on-policy
# ------------------------------------------------------------------------------------------------


def job_erc_on_policy(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05, vocab_pass=True)
    actor_config = make_actor_config(policy_loss=policy, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    out: dict[str, Any] = {}
    for name, options in {
        "bf16/rmpad": WorkerOptions(mixed_precision=BF16, **EXACT_SGD),
        "bf16/padded": WorkerOptions(mixed_precision=BF16, use_remove_padding=False, **EXACT_SGD),
    }.items():
        worker = build_actor_worker(model_path, options)
        worker.set_loss_fn(build_actor_loss(actor_config))
        old = compute_log_prob(worker, batch)
        data = batch.clone()
        data["old_log_probs"], data["entropy"] = old["old_log_probs"], old["entropy"]
        before = full_params(worker)
        metrics = update_actor(worker, data, calculate_entropy=True)
        from recipe.bench.features import uses_vocab_pass

        out[name] = {
            "metrics": metrics,
            "old_entropy": old["entropy"].values(),
            "delta": param_delta(before, full_params(worker)),
            "uses_pass": uses_vocab_pass(worker.engine),
        }
    return out


def test_erc_on_policy_ratio_is_exactly_one_through_the_pass(tmp_path: Path) -> None:
    model = save_tiny_qwen3(tmp_path / "confident", SPEC, seed=0, head_scale=1000.0)
    results = run_ranks(job_erc_on_policy, 1, model)[0]
    for name, result in results.items():
        m = result["metrics"]
        assert result["uses_pass"], name
        assert float((result["old_entropy"] <= 1e-6).float().mean()) >= 0.3, name  # a confident policy
        for key in ("actor/divclip/erc/ratio_min", "actor/divclip/erc/ratio_max"):
            assert all(float(v) == 1.0 for v in m[key]), (name, key, m[key])
        for key in (
            "actor/divclip/erc/clipfrac_upper",
            "actor/divclip/erc/clipfrac_lower",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
        ):
            assert all(float(v) == 0.0 for v in m[key]), (name, key, m[key])
        assert any((d != 0).any() for d in result["delta"].values()), name


# ------------------------------------------------------------------------------------------------
# Two ranks: FSDP2 with the head sharded; Ulysses
# ------------------------------------------------------------------------------------------------


def job_two_ranks(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    # 3 sequences per rank: one micro-batch each
    options = WorkerOptions(mixed_precision=dict(FP32_MIXED_PRECISION), micro_batch_size_per_gpu=3, **EXACT_SGD)
    probe = build_actor_worker(model_path, options)
    head_weight = probe.engine.module.get_output_embeddings().weight
    sharded = isinstance(head_weight, DTensor) and head_weight.placements == (Shard(0),)
    local_rows = head_weight.to_local().shape[0] if isinstance(head_weight, DTensor) else None
    del probe
    dp = run_both(model_path, options, shard_for_rank(batch, rank, world_size), global_batch_size=len(PROMPT_LENS))
    ulysses = run_both(
        model_path,
        WorkerOptions(
            mixed_precision=dict(FP32_MIXED_PRECISION), ulysses_sequence_parallel_size=world_size, **EXACT_SGD
        ),
        batch,
        global_batch_size=len(PROMPT_LENS),
    )
    return {"sharded": sharded, "local_rows": local_rows, "dp": dp, "ulysses": ulysses}


@pytest.fixture(scope="module")
def two_ranks(models: tuple[str, str]) -> list[dict[str, Any]]:
    return run_ranks(job_two_ranks, 2, models[0])


def test_two_rank_fsdp2_with_sharded_head_equals_materialised(two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_ranks):
        assert result["sharded"] and result["local_rows"] == SPEC.vocab_size // 2, rank
        mat, ours = result["dp"]["materialised"], result["dp"]["vocab_pass"]
        for key in ("old_log_probs", "entropy"):
            torch.testing.assert_close(ours["old"][key], mat["old"][key], rtol=1e-5, atol=1e-6)
        assert max_delta_rel(ours["delta"], mat["delta"]) <= 1e-5
    # the head's gradient was reduce-scattered: both ranks applied the same full update
    first, second = two_ranks[0]["dp"]["vocab_pass"]["delta"], two_ranks[1]["dp"]["vocab_pass"]["delta"]
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_two_rank_ulysses_equals_materialised(two_ranks: list[dict[str, Any]]) -> None:
    result = two_ranks[0]["ulysses"]  # the group's outputs come back on its first rank
    mat, ours = result["materialised"], result["vocab_pass"]
    assert ours["old"]["old_log_probs"].numel() == sum(RESPONSE_LENS)
    for key in ("old_log_probs", "entropy"):
        torch.testing.assert_close(ours["old"][key], mat["old"][key], rtol=1e-5, atol=1e-6)
    for r in two_ranks:
        assert max_delta_rel(r["ulysses"]["vocab_pass"]["delta"], r["ulysses"]["materialised"]["delta"]) <= 1e-5


def test_refusals_name_the_key() -> None:
    from types import SimpleNamespace

    from verl_ext.engine.vocab_pass_step import VOCAB_PASS_KEY, output_head, refuse_fused_kernels

    fused = SimpleNamespace(model_config=SimpleNamespace(use_fused_kernels=True))
    with pytest.raises(ValueError, match="use_fused_kernels"):
        refuse_fused_kernels(fused)
    with_bias = torch.nn.Module()
    with_bias.get_output_embeddings = lambda: torch.nn.Linear(4, 8, bias=True)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=VOCAB_PASS_KEY.replace(".", r"\.") + ".*bias"):
        output_head(with_bias)


# ------------------------------------------------------------------------------------------------
# The pass replaces verl's prepare_model_outputs: the same keys on the same micro-batch
# ------------------------------------------------------------------------------------------------


def _zero_loss(model_output: dict[str, Any], data: Any, dp_group: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A loss for the update's step (evaluating pi_theta on pi_old's stored ids needs one); the keys are read
    from the step's output, not here."""
    return torch.zeros(()), {}


def job_model_output_keys(rank: int, world_size: int, model_path: str) -> dict[str, dict[str, Any]]:
    """verl's ``prepare_model_outputs`` and the vocabulary pass on one micro-batch each time (one engine,
    ``forward_step`` as verl's ``forward_backward_batch`` calls it): the model output's keys of both, per
    padding, ``calculate_entropy`` and pi_old's top-k task (none, the old pass's capture, the update's evaluation)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    from verl_ext.engine import seam
    from verl_ext.engine.request import STEP_PATH_KEY, EngineRequest
    from verl_ext.engine.topk_capture import CAPTURE_KEY, OLD_TOPK_IDS

    seam.install()
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=4)
    out: dict[str, dict[str, Any]] = {}
    for padding in ("rmpad", "padded"):
        options = WorkerOptions(use_remove_padding=padding == "rmpad", micro_batch_size_per_gpu=len(PROMPT_LENS))
        engine = build_actor_worker(model_path, options).engine
        stored_ids = None
        for task in ("none", "capture", "evaluate"):
            for calculate_entropy in (True, False):
                data = batch.clone()
                tu.assign_non_tensor(  # what TrainingWorker.infer_batch and the trainer set (one micro-batch)
                    data,
                    use_remove_padding=options.use_remove_padding,
                    use_dynamic_bsz=False,
                    use_fused_kernels=False,
                    max_token_len_per_gpu=options.max_token_len_per_gpu,
                    micro_batch_size_per_gpu=len(PROMPT_LENS),
                    calculate_entropy=calculate_entropy,
                    temperature=1.0,
                )
                if task == "capture":
                    tu.assign_non_tensor(data, **{CAPTURE_KEY: 4})
                if task == "evaluate":
                    data[OLD_TOPK_IDS] = stored_ids
                micro_batches, _ = prepare_micro_batches(data)
                assert len(micro_batches) == 1
                micro_batch = micro_batches[0]
                result: dict[str, Any] = {}
                for path, request in (("verl", EngineRequest()), ("vocab_pass", EngineRequest(vocab_pass=True))):
                    seam.set_features(engine, request)
                    with torch.no_grad(), engine.eval_mode():
                        _, output = engine.forward_step(
                            micro_batch, loss_function=_zero_loss if task == "evaluate" else None, forward_only=True
                        )
                    model_output = output["model_output"]
                    result[path] = sorted(model_output)
                    result[f"{path}/log_probs"] = model_output["log_probs"].values()
                    result[f"{path}/marked"] = tu.get_non_tensor_data(data=micro_batch, key=STEP_PATH_KEY, default={})[
                        "vocab_pass"
                    ]
                    if task == "capture" and path == "verl":
                        stored_ids = model_output[OLD_TOPK_IDS]
                out[f"{padding}/{task}/entropy={calculate_entropy}"] = result
    return out


def test_the_pass_writes_the_keys_verls_prepare_model_outputs_writes(models: tuple[str, str]) -> None:
    """The pass replaces verl's ``prepare_model_outputs`` for a step: on the same micro-batch it must write
    the same keys (none dropped, none added), with and without the entropy and pi_old's top-k task.
    (verl's keys that need the logits are refused before Ray: recipe/config_checks.py.)"""
    from verl_ext.engine.topk_capture import NEW_TOPK_LOG_PROBS, OLD_TOPK_IDS, OLD_TOPK_LOG_PROBS

    results = run_ranks(job_model_output_keys, 1, models[0])[0]
    assert len(results) == 12
    for variant, result in results.items():
        padding, task, entropy = variant.split("/")
        expected = {"log_probs"} | ({"entropy"} if entropy == "entropy=True" else set())
        expected |= {"capture": {OLD_TOPK_LOG_PROBS, OLD_TOPK_IDS}, "evaluate": {NEW_TOPK_LOG_PROBS}, "none": set()}[
            task
        ]
        assert set(result["verl"]) == expected, (variant, result["verl"])
        assert result["vocab_pass"] == result["verl"], variant
        assert result["verl/marked"] == 0.0 and result["vocab_pass/marked"] == 1.0, variant  # the pass did run
        torch.testing.assert_close(result["vocab_pass/log_probs"], result["verl/log_probs"], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# The config key, before Ray starts
# ------------------------------------------------------------------------------------------------

VOCAB_PASS_ON = "actor_rollout_ref.actor.policy_loss.vocab_pass=true"


def compose_config(*overrides: str) -> Any:
    from hydra import compose, initialize_config_dir

    from recipe.main import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="divclip_trainer", overrides=list(overrides))


def test_config_key_is_declared_and_reaches_the_loss() -> None:
    from recipe.config_checks import validate_divclip_config
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.engine.request import request_of

    off = validate_divclip_config(compose_config())
    assert off.policy_loss.vocab_pass is False and not request_of(build_actor_loss(off)).vocab_pass
    erc = [
        "actor_rollout_ref.actor.policy_loss.erc_beta_low=0.05",
        "actor_rollout_ref.actor.policy_loss.erc_beta_high=0.05",
        "actor_rollout_ref.actor.calculate_entropy=true",
    ]
    on = validate_divclip_config(compose_config(VOCAB_PASS_ON, *erc))
    loss = build_actor_loss(on)
    assert request_of(loss).vocab_pass
    assert request_of(loss).entropy_as_mask  # ERC's mask declaration is kept


VOCAB_PASS_KEY = "actor_rollout_ref.actor.policy_loss.vocab_pass"


def _lm_head_message(targets: str) -> str:
    return (
        f"{VOCAB_PASS_KEY}=true reads the LM head's own weight; actor_rollout_ref.model.target_modules={targets} "
        "puts a LoRA adapter on lm_head: drop lm_head from target_modules or set the vocabulary pass false"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor_rollout_ref.model.use_fused_kernels=true"],
            f"{VOCAB_PASS_KEY}=true and actor_rollout_ref.model.use_fused_kernels=true both replace the LM head's "
            "logits (verl's fused forward reads lm_head.weight outside the head and fails under FSDP2): set one of "
            "them false",
        ),
        (
            ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,lm_head]"],
            _lm_head_message("['q_proj', 'lm_head']"),
        ),
        (  # the smallest rank is a LoRA too
            ["actor_rollout_ref.model.lora_rank=1", "actor_rollout_ref.model.target_modules=[lm_head]"],
            _lm_head_message("['lm_head']"),
        ),
        (  # one module named as a string, not a list
            ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=lm_head"],
            _lm_head_message("['lm_head']"),
        ),
        (  # an adapter loaded from a path is a LoRA whatever lora_rank says
            [
                "actor_rollout_ref.model.lora_adapter_path=/adapters/a",
                "actor_rollout_ref.model.target_modules=[lm_head]",
            ],
            _lm_head_message("['lm_head']"),
        ),
    ],
)
def test_refused_combinations_name_the_key(overrides: list[str], message: str) -> None:
    """Each refusal, its message word for word."""
    from recipe.config_checks import ConfigError, validate_divclip_config

    with pytest.raises(ConfigError) as refused:
        validate_divclip_config(compose_config(VOCAB_PASS_ON, *overrides))
    assert str(refused.value) == message


def test_lm_head_in_the_targets_is_accepted_with_lora_off() -> None:
    """``lora_rank=0`` and no adapter path: no LoRA, whatever ``target_modules`` lists (the control: rank 8 with the
    same targets is refused above)."""
    from recipe.config_checks import validate_divclip_config

    targets = "actor_rollout_ref.model.target_modules=[q_proj,lm_head]"
    actor = validate_divclip_config(compose_config(VOCAB_PASS_ON, "actor_rollout_ref.model.lora_rank=0", targets))
    assert actor.policy_loss.vocab_pass is True


@pytest.mark.parametrize(
    "store_topk",
    [
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_full",
        "actor_rollout_ref.actor.policy_loss.kl_full_diagnostic=true",
    ],
)
def test_stored_topk_is_accepted_with_the_pass(store_topk: str) -> None:
    """kl_full's top-k comes from the pass's slices (tests/test_full_kl_engine.py runs it)."""
    from recipe.config_checks import validate_divclip_config

    actor = validate_divclip_config(compose_config(VOCAB_PASS_ON, store_topk))
    assert actor.policy_loss.vocab_pass is True and actor.policy_loss.stores_old_topk


def test_lora_elsewhere_is_accepted() -> None:
    from recipe.config_checks import validate_divclip_config

    actor = validate_divclip_config(compose_config(VOCAB_PASS_ON, "actor_rollout_ref.model.lora_rank=8"))
    assert actor.policy_loss.vocab_pass is True


def test_every_launch_script_passes_vocab_pass_through(tmp_path: Path) -> None:
    """``VOCAB_PASS`` is read by launch/common.sh (every ``divclip_launch`` script and the sweep) and
    by launch/run_smoke_cpu.sh; a bad value exits 2 naming the variable. (The script's dry run composed and
    validated in this process from the command line it builds: tests/test_launch.py's ``script_config``.)"""
    import os
    import subprocess

    from tests.test_launch import script_config, write_printer

    root = Path(__file__).resolve().parents[1]
    config = script_config(write_printer(tmp_path), "run_erc_dapo_1.5b.sh", "--dry-run", env={"VOCAB_PASS": "1"})
    assert config["actor_rollout_ref"]["actor"]["policy_loss"]["vocab_pass"] is True
    env = dict(os.environ)
    for script in ("run_grpo_7b.sh", "run_smoke_cpu.sh"):
        bad = subprocess.run(
            ["bash", str(root / "launch" / script), "--dry-run"],
            cwd="/",
            env={**env, "VOCAB_PASS": "yes", "PYTHON": "/bin/false"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and "VOCAB_PASS must be 1, true, 0 or false, got 'yes'" in bad.stderr, (
            script,
            bad.stderr,
        )
    scripts = [p for p in (root / "launch").glob("run_*.sh") if "sft" not in p.name]
    for path in scripts:  # the RL scripts: through divclip_launch, or the smoke script's own case
        text = path.read_text()
        assert "divclip_launch " in text or "VOCAB_PASS" in text, path.name
