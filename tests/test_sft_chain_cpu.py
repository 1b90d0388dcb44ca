"""The SFT -> RL chain of the ATR paper on CPU: a few steps of verl 0.9.1's SFT trainer through
``launch/run_sft_openmath_qwen3_1.7b.sh`` (the same entry point, ``python -m recipe.sft``, with the
model and data swapped for the smoke task's tiny Qwen3 and its answered prompts), the LoRA merge into
a Hugging Face folder, and the CPU RL smoke (``launch/run_smoke_cpu.sh``) started from that folder.

Evidence that each stage hands over to the next: the SFT loss falls; the merged model is base + LoRA
(every adapted weight is exactly W + (alpha / r) B A); its greedy accuracy on the held-out prompts
jumps from the random model's 0; and the RL run's step-0 validation reports exactly that accuracy,
so RL started from the SFT output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from tests.test_smoke_cpu import (
    GPU_PACKING,
    SMOKE_TIMEOUT_S,
    assert_coarsened_kl_from_stored_top_k,
    assert_on_policy_exact,
    run_in_own_session,
    step_metrics,
)

ROOT = Path(__file__).resolve().parents[1]
SFT_STEPS = 48
RL_STEPS = 2
CPU_SFT_OVERRIDES = [
    "trainer.device=cpu",
    "engine.strategy=fsdp2",
    "engine.use_torch_compile=False",
    "engine.model_dtype=fp32",
    "+model.override_config.attn_implementation=sdpa",
    "data.train_batch_size=16",
    "data.num_workers=0",
    "data.max_length=64",
    f"trainer.total_training_steps={SFT_STEPS}",
    "trainer.logger=[console,file]",
    "optim.lr=1e-2",
    "optim.lr_warmup_steps_ratio=0",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GPUS_PER_NODE", "EXPERIMENT_NAME")}
    return {**env, "PYTHON": sys.executable, "VERL_PLATFORM": "cpu", "TOKENIZERS_PARALLELISM": "false", **extra}


def _run(args: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    proc = run_in_own_session(args, env, timeout)  # past its timeout, the run's whole session is killed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sft_chain")
    assets = out / "assets"
    _run([sys.executable, "-m", "recipe.smoke.task", "--out", str(assets), "--sft", "768"], _env(), 300)
    merged = out / "merged"
    sft_log = out / "sft_metrics.jsonl"
    _run(["bash", str(ROOT / "launch/run_sft_openmath_qwen3_1.7b.sh"), *CPU_SFT_OVERRIDES],
         _env(MODEL_PATH=str(assets / "model"), TRAIN_FILES=str(assets / "data/sft_train.parquet"),
              CKPT_DIR=str(out / "sft"), MERGED_DIR=str(merged), VERL_FILE_LOGGER_PATH=str(sft_log)),
         SMOKE_TIMEOUT_S)  # fmt: skip
    rl_out = out / "rl"
    # kl3 with the opt-in KL3-vs-trust-region diagnostic (pi_old's top-8 from verl's logits, stored by the
    # old-log-prob pass through TransferQueue), trained as GPU users run verl (bf16, dynamic batching 2:1,
    # shuffled mini-batches); the SFT model's logits are a trained model's, so its head is not scaled
    packing = {key: value for key, value in GPU_PACKING.items() if key != "HEAD_SCALE"}
    _run(["bash", str(ROOT / "launch/run_smoke_cpu.sh"), "actor_rollout_ref.actor.policy_loss.kl_full_diagnostic=True",
          "actor_rollout_ref.actor.policy_loss.kl_full_top_k=8"],
         _env(SMOKE_OUT=str(rl_out), SMOKE_MODEL=str(merged), LOSS="kl3", STEPS=str(RL_STEPS), SAVE_FREQ="-1",
              TEST_FREQ="-1", **packing),
         SMOKE_TIMEOUT_S)  # fmt: skip
    return {"assets": assets, "merged": merged, "sft_log": sft_log, "rl": rl_out, "ckpt": out / "sft"}


def _greedy_accuracy(model_path: Path, val: pd.DataFrame) -> float:
    """Greedy answers on the held-out prompts, scored as the smoke's validation scores them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipe.reward.score import compute_score

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    right = 0
    for _, row in val.iterrows():
        prompt = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        right += compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])["acc"]
    return right / len(val)


def test_sft_loss_falls(chain: dict[str, Any]) -> None:
    rows = [json.loads(line) for line in chain["sft_log"].read_text().splitlines() if line.strip()]
    losses = {r["step"]: r["data"]["train/loss"] for r in rows if "train/loss" in r["data"]}
    assert sorted(losses) == list(range(1, SFT_STEPS + 1))
    first, last4 = losses[1], [losses[s] for s in range(SFT_STEPS - 3, SFT_STEPS + 1)]
    assert sum(last4) / 4 < first - 0.3, losses


def test_merged_model_is_base_plus_lora(chain: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    merged_dir, base_dir = chain["merged"], chain["assets"] / "model"
    assert (merged_dir / "config.json").is_file() and (merged_dir / "model.safetensors").is_file()
    assert (merged_dir / "tokenizer.json").is_file() and (merged_dir / "lora_adapter" / "adapter_config.json").is_file()
    adapter = json.loads((merged_dir / "lora_adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (32, 64)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    # verl's model_merger gathers the shards in bfloat16 (Qwen3's own dtype), so the tiny model's fp32
    # base comes back rounded to bfloat16: compare with the rounded base
    base = (
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(torch.bfloat16).to(torch.float32).eval()
    )
    # LoRA moved the linear layers; embeddings and norms are untouched
    m, b = merged.state_dict(), base.state_dict()
    assert not torch.equal(m["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(m["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert torch.equal(m["model.layers.0.input_layernorm.weight"], b["model.layers.0.input_layernorm.weight"])
    # every adapted layer is exactly W + (alpha / r) B A, in fp32, from the adapter the merge used
    from safetensors.torch import load_file

    lora = load_file(merged_dir / "lora_adapter" / "adapter_model.safetensors")
    targets = sorted(
        {k[len("base_model.model.") : -len(".lora_A.weight")] for k in lora if k.endswith(".lora_A.weight")}
    )
    assert len(targets) == 2 * 7  # all-linear: q, k, v, o, gate, up, down in both layers
    scale = adapter["lora_alpha"] / adapter["r"]
    for name in targets:
        a_ = lora[f"base_model.model.{name}.lora_A.weight"].float()
        b_ = lora[f"base_model.model.{name}.lora_B.weight"].float()
        assert torch.equal(m[f"{name}.weight"], b[f"{name}.weight"] + scale * b_ @ a_), name


def test_rl_starts_from_the_sft_model(chain: dict[str, Any]) -> None:
    val = pd.read_parquet(chain["assets"] / "data" / "val.parquet")
    base_acc = _greedy_accuracy(chain["assets"] / "model", val)
    sft_acc = _greedy_accuracy(chain["merged"], val)
    assert base_acc == 0.0 and sft_acc >= 0.5, (base_acc, sft_acc)
    metrics = {json.loads(line)["step"]: json.loads(line)["data"]
               for line in (chain["rl"] / "metrics.jsonl").read_text().splitlines() if line.strip()}  # fmt: skip
    # verl's validation before training (greedy, the same held-out prompts) sees the SFT model
    assert metrics[0]["val-core/smoke_echo/acc/mean@1"] == pytest.approx(sft_acc, abs=1e-9)
    assert 0.0 <= metrics[1]["critic/score/mean"] <= 1.0  # and one KL3 training step ran on it


def test_the_rl_steps_are_kl3_with_the_trust_region_diagnostic(chain: dict[str, Any]) -> None:
    """The RL steps on the SFT model are ATR's kl3 at delta 0.07 (ratio range [0.671, 1.422]), on-policy exact
    on their first mini-batch under bf16 and dynamic batching, with the diagnostic computed from pi_old's
    stored top-8."""
    metrics = step_metrics(chain["rl"])
    for step in range(1, RL_STEPS + 1):
        data = metrics[step]
        assert data["actor/divclip/ratio_lower"] == pytest.approx(0.671, abs=1e-3)
        assert data["actor/divclip/ratio_upper"] == pytest.approx(1.422, abs=1e-3)
        assert "actor/divclip/erc/ratio_mean" not in data
        assert_on_policy_exact(data, erc=False)
        assert_coarsened_kl_from_stored_top_k(data, "full_only_frac_kl3delta")


def test_merge_cli_on_any_lora_checkpoint(chain: dict[str, Any], tmp_path: Path) -> None:
    """``python -m recipe.sft merge`` (for RL checkpoints too) gives the same model as the SFT run's merge."""
    step = chain["ckpt"] / f"global_step_{SFT_STEPS}"
    _run([sys.executable, "-m", "recipe.sft", "merge", "--checkpoint", str(step), "--output", str(tmp_path / "m")],
         _env(), 300)  # fmt: skip
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (chain["merged"] / "model.safetensors").read_bytes()
    merge = [sys.executable, "-m", "recipe.sft", "merge", "--checkpoint", str(tmp_path / "none"), "--output"]
    proc = subprocess.run([*merge, str(tmp_path / "x")], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "is not a folder" in proc.stderr and not (tmp_path / "x").exists()
