"""The divclip actor loss inside verl's real actor stack (TrainingWorker -> FSDPEngineWithLMHead,
FSDP2 on gloo, CPU platform), 1 and 2 ranks.

* every mode (and verl's own modes through the same loss) runs: loss finite, parameters move;
* ERC masks exactly the tokens whose entropy ratio leaves the band: its update equals the base
  mode's update on the same batch with those tokens' advantages set to 0 (no gradient, still
  in the denominator);
* a band too wide to trigger gives the base mode's update;
* remove-padding on/off and 1 vs 2 ranks give the same update (ERC on kl3, and seq_kl3, whose
  sequence ratio must not depend on how verl splits the batch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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
from tests.helpers import EXACT_SGD, param_delta, run_ranks, shard_for_rank

SPEC = TinyQwen3Spec()
PROMPT_LENS = [3, 5, 4, 6]
RESPONSE_LENS = [9, 4, 7, 6]
SGD = EXACT_SGD  # update = -lr * grad, so "same update" means "same gradient"
DIVCLIP_MODES = ["clip", "gppo", "kl3", "kl1", "kl2", "is_kl3", "trgppo", "dcpo", "seq_kl3"]
ENTROPY_SCALES = torch.tensor([0.5, 0.97, 1.0, 1.03, 1.5, 0.9, 1.2])  # H_new / H_old per token (cycled)


def actor_config(mode: str, **policy: Any) -> Any:
    from verl.workers.config import PolicyLossConfig

    from verl_ext.config import DivClipPolicyLossConfig

    policy_cfg = (
        DivClipPolicyLossConfig(loss_mode=mode, **policy) if mode in DIVCLIP_MODES else PolicyLossConfig(loss_mode=mode)
    )
    return make_actor_config(policy_loss=policy_cfg, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)


def run_update(model_path: str, cfg: Any, batch: Any, rmpad: bool = True) -> dict[str, Any]:
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.engine.request import request_of

    worker = build_actor_worker(model_path, WorkerOptions(use_remove_padding=rmpad, **SGD))
    loss = build_actor_loss(cfg)
    worker.set_loss_fn(loss)
    before = full_params(worker)
    metrics = update_actor(worker, batch, calculate_entropy=True)
    detached = request_of(loss).entropy_as_mask
    return {"metrics": metrics, "delta": param_delta(before, full_params(worker)), "detached": detached}


def make_batch(model_path: str) -> tuple[Any, torch.Tensor]:
    """A batch whose pi_old is the model's own (perturbed so ratios spread) and whose pi_old
    entropy is the model's entropy divided by ENTROPY_SCALES, so rho = H_new / H_old is known."""
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=3)
    old = compute_log_prob(build_actor_worker(model_path, WorkerOptions(**SGD)), batch)
    gen = torch.Generator().manual_seed(11)
    batch["old_log_probs"] = torch.nested.as_nested_tensor(
        [lp + 0.6 * torch.randn(lp.shape, generator=gen) for lp in old["old_log_probs"].unbind()], layout=torch.jagged
    )
    n_tokens = sum(RESPONSE_LENS)
    rho = ENTROPY_SCALES.repeat(n_tokens // len(ENTROPY_SCALES) + 1)[:n_tokens]
    batch["entropy"] = torch.nested.as_nested_tensor(
        list((old["entropy"].values() / rho).split(RESPONSE_LENS)), layout=torch.jagged
    )
    return batch, rho


def with_zero_advantages(batch: Any, zero: torch.Tensor) -> Any:
    out = batch.clone()
    adv = batch["advantages"].values().clone()
    adv[zero] = 0.0
    out["advantages"] = torch.nested.as_nested_tensor(list(adv.split(RESPONSE_LENS)), layout=torch.jagged)
    return out


def job_single_rank(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    batch, rho = make_batch(model_path)
    out: dict[str, Any] = {"rho": rho, "batch": batch}
    for mode in DIVCLIP_MODES + ["vanilla", "sapo"]:
        out[f"base/{mode}"] = run_update(model_path, actor_config(mode), batch)
    outside = (rho <= 0.95) | (rho >= 1.05)
    for mode in ("clip", "kl3", "gppo"):
        out[f"erc/{mode}"] = run_update(model_path, actor_config(mode, erc_beta_low=0.05, erc_beta_high=0.05), batch)
        out[f"zeroed/{mode}"] = run_update(model_path, actor_config(mode), with_zero_advantages(batch, outside))
    dump = str(Path(model_path).parent / "tokens_{rank}.jsonl")
    out["dump_path"] = dump.replace("{rank}", "0")
    out["dump/kl3"] = run_update(
        model_path,
        actor_config(
            "kl3",
            erc_beta_low=0.05,
            erc_beta_high=0.05,
            token_dump_path=dump,
            token_dump_every_n_steps=1,
            token_dump_max_tokens=1000,
        ),
        batch,
    )
    out["wide/kl3"] = run_update(model_path, actor_config("kl3", erc_beta_low=0.99, erc_beta_high=1e6), batch)
    out["erc/kl3/padded"] = run_update(
        model_path, actor_config("kl3", erc_beta_low=0.05, erc_beta_high=0.05), batch, rmpad=False
    )
    return out


def job_two_ranks(rank: int, world_size: int, model_path: str, batch: Any) -> dict[str, Any]:
    shard = shard_for_rank(batch, rank, world_size)
    return {
        "erc/kl3": run_update(model_path, actor_config("kl3", erc_beta_low=0.05, erc_beta_high=0.05), shard),
        "base/seq_kl3": run_update(model_path, actor_config("seq_kl3"), shard),
    }


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny_qwen3_divclip")), SPEC, seed=0)


@pytest.fixture(scope="module")
def key_reads_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the ``single`` run records the verl keys the product reads (a run of ``python -m
    recipe.verl_key_reads`` keeps its own folder)."""
    from verl_ext.core.key_reads import record_dir

    return record_dir() or tmp_path_factory.mktemp("key_reads")


@pytest.fixture(scope="module")
def single(model_path: str, key_reads_dir: Path, monkeypatch_module: pytest.MonkeyPatch) -> dict[str, Any]:
    from verl_ext.core.key_reads import RECORD_ENV

    monkeypatch_module.setenv(RECORD_ENV, str(key_reads_dir))  # the spawned rank inherits it
    return run_ranks(job_single_rank, 1, model_path)[0]


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def assert_same_delta(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-7) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def moved(delta: dict[str, torch.Tensor]) -> bool:
    return any((d != 0).any() for d in delta.values())


@pytest.mark.parametrize("mode", DIVCLIP_MODES + ["vanilla", "sapo"])
def test_every_mode_trains(single: dict[str, Any], mode: str) -> None:
    result = single[f"base/{mode}"]
    assert all(math.isfinite(float(v)) for v in result["metrics"]["loss"])
    assert all(torch.isfinite(d).all() for d in result["delta"].values())
    assert moved(result["delta"])
    if mode in DIVCLIP_MODES:
        assert "actor/divclip/kl3_mean" in result["metrics"]
        assert not result["detached"]
    if mode == "seq_kl3":
        assert all(float(v) > 0 for v in result["metrics"]["actor/divclip/seq_kl3_mean"])
        assert all(float(v) == 0.07 for v in result["metrics"]["actor/divclip/delta"])


@pytest.mark.parametrize("mode", ["clip", "kl3", "gppo"])
def test_erc_masks_exactly_the_out_of_band_tokens(single: dict[str, Any], mode: str) -> None:
    erc, zeroed, base = single[f"erc/{mode}"], single[f"zeroed/{mode}"], single[f"base/{mode}"]
    assert erc["detached"], "ERC without an entropy bonus must use the detached entropy path"
    assert_same_delta(erc["delta"], zeroed["delta"])
    assert any(not torch.allclose(erc["delta"][k], base["delta"][k], atol=1e-6) for k in base["delta"])
    rho = single["rho"]
    upper = float((rho >= 1.05).float().mean())
    lower = float((rho <= 0.95).float().mean())
    # metrics are per micro-batch means; the token-weighted mean over micro-batches is the batch mean
    assert sum(map(float, erc["metrics"]["actor/divclip/erc/clipfrac_upper"])) > 0
    ratio_max = max(map(float, erc["metrics"]["actor/divclip/erc/ratio_max"]))
    ratio_min = min(map(float, erc["metrics"]["actor/divclip/erc/ratio_min"]))
    assert ratio_max == pytest.approx(float(rho.max()), rel=1e-4)
    assert ratio_min == pytest.approx(float(rho.min()), rel=1e-4)
    assert 0 < upper < 1 and 0 < lower < 1


def test_wide_band_gives_the_base_update(single: dict[str, Any]) -> None:
    assert_same_delta(single["wide/kl3"]["delta"], single["base/kl3"]["delta"])


def test_remove_padding_does_not_change_the_erc_update(single: dict[str, Any]) -> None:
    assert_same_delta(single["erc/kl3/padded"]["delta"], single["erc/kl3"]["delta"], atol=1e-6)


def test_two_ranks_match_one_rank(model_path: str, single: dict[str, Any]) -> None:
    rank0, rank1 = run_ranks(job_two_ranks, 2, model_path, single["batch"])
    for name in ("erc/kl3", "base/seq_kl3"):
        assert_same_delta(rank0[name]["delta"], rank1[name]["delta"], atol=0.0)
        assert_same_delta(rank0[name]["delta"], single[name]["delta"], atol=1e-6)


def test_token_dump_writes_the_erc_scatter_rows(single: dict[str, Any]) -> None:
    import json

    rows = [json.loads(line) for line in Path(single["dump_path"]).read_text().splitlines()]
    assert len(rows) == sum(RESPONSE_LENS)  # budget 1000 > tokens: every valid token once
    ratios = sorted(r["entropy_ratio"] for r in rows)
    torch.testing.assert_close(torch.tensor(ratios), single["rho"].sort().values, rtol=1e-4, atol=1e-6)
    for r in rows:
        assert r["clipped"] == (r["entropy_ratio"] <= 0.95 or r["entropy_ratio"] >= 1.05)
        assert 0.0 < r["prob"] <= 1.0
    assert_same_delta(single["dump/kl3"]["delta"], single["erc/kl3"]["delta"], atol=0.0)  # dumping changes nothing


#: What the ``single`` run must read through the product: the loss mode and clip range (every mode), the entropy
#: bonus (ERC's check), and the engine settings the fp32 entropy of ERC reads through the guard.
ENGINE_RUN_CORE = {
    "actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile",
    "actor_rollout_ref.model.use_fused_kernels",
}


def test_the_run_reads_only_recorded_keys_and_the_core_set(single: dict[str, Any], key_reads_dir: Path) -> None:
    """The engine run above, recorded (verl_ext.core.key_reads): every verl key the product read is in the
    committed record (recipe/verl_keys_read.json), whose rows the key table gives."""
    from recipe.verl_key_reads import read_keys
    from recipe.verl_keys import is_divclip_key
    from verl_ext.core.key_reads import read_records

    recorded = {key for key in read_records(key_reads_dir) if not is_divclip_key(key)}
    assert ENGINE_RUN_CORE <= recorded, ENGINE_RUN_CORE - recorded
    unknown = recorded - frozenset(read_keys())
    assert not unknown, (
        f"read by the product, not in recipe/verl_keys_read.json: {unknown} (python -m recipe.verl_key_reads)"
    )
