"""Checks that need a CUDA GPU (``-m gpu``). On the CPU machines (CI) every test here is *skipped*:
a skip is not a pass, and docs/benchmarks.md says which GPU figures were measured where.

* the compiled ``entropy_fp32`` (verl's default ``use_torch_compile`` on GPU) matches an fp64
  reference and gives every row the same bits whatever the batch it is computed in;
* the GPU probe (``python -m recipe.bench gpu``) at a small shape: ERC's on-policy invariant holds
  with the compiled and the eager path, and every variant reports its ratios;
* ERC's on-policy check under FSDP1 (``actor.strategy=fsdp``, what the launch scripts resolve to) and
  FSDP2, with the ERC configs' 2:1 dynamic-batching budgets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_entropy_numerics import assert_matches_fp64, peaky_logits

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU test; skipped is not passed)"),
]


def test_compiled_entropy_matches_fp64_on_gpu() -> None:
    from verl_ext.core.entropy import entropy_fp32, entropy_fp32_compiled

    logits = peaky_logits(256, 151_936, torch.bfloat16).cuda()
    compiled = entropy_fp32_compiled(logits)
    assert_matches_fp64(compiled.cpu(), logits.cpu())
    assert_matches_fp64(entropy_fp32(logits).cpu(), logits.cpu())


def test_compiled_rows_do_not_depend_on_the_batch() -> None:
    from verl_ext.core.entropy import entropy_fp32_compiled

    logits = peaky_logits(3000, 32_000, torch.bfloat16, seed=2).cuda()
    whole = entropy_fp32_compiled(logits)
    for lo, hi in ((0, 1000), (17, 1234), (2999, 3000), (5, 2051)):
        assert torch.equal(whole[lo:hi], entropy_fp32_compiled(logits[lo:hi])), (lo, hi)


def test_gpu_probe_small_model(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipe.bench",
            "gpu",
            "--tokens",
            "4096",
            "--sequences",
            "4",
            "--layers",
            "2",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(results) >= {"no_entropy", "verl_compiled", "verl_eager", "divclip_erc", "divclip_erc_eager"}
    for name in ("divclip_erc", "divclip_erc_eager"):
        assert results[name]["on_policy_invariant"] is True, results[name]
        assert results[name]["entropy_path"] == "divclip_fp32"
    assert all("time_vs_no_entropy" in r and "peak_vs_no_entropy" in r for r in results.values())


def test_erc_on_policy_under_fsdp1_and_fsdp2(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipe.bench",
            "gpu",
            "--tokens",
            "4096",
            "--sequences",
            "4",
            "--layers",
            "2",
            "--repeats",
            "1",
            "--strategies",
            "fsdp,fsdp2",
            "--variants",
            "divclip_erc,divclip_erc_dynamic",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {(r["strategy"], r["variant"]) for r in results} == {
        (s, v) for s in ("fsdp", "fsdp2") for v in ("no_entropy", "divclip_erc", "divclip_erc_dynamic")
    }
    for r in results:
        if r["variant"] != "no_entropy":
            assert r["on_policy_invariant"] is True, r
            assert r["first_update"]["actor/divclip/onpolicy/erc_masked_frac"] == [0.0], r


def test_the_vocabulary_pass_on_tensor_cores_matches_its_float32_path() -> None:
    """bf16 operands on CUDA: the TF32 logits equal the float32 ones up to summation order, so log-probs,
    entropies and the top-k agree within float32 tolerance, and the gradients within TF32's 2^-11 rounding
    of the logit gradient."""
    from verl_ext.core.vocab_pass import bucket_log_masses, tensor_core_matmuls, vocab_pass

    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(2048, 1536, generator=gen)).to(torch.bfloat16).cuda().requires_grad_()
    weight = (torch.randn(151_936, 1536, generator=gen) * 0.05).to(torch.bfloat16).cuda().requires_grad_()
    labels = torch.randint(0, 151_936, (2048,), generator=gen).cuda()
    assert tensor_core_matmuls(hidden, weight)
    runs = {}
    for name, tensor_cores in (("tf32", None), ("fp32", False)):
        out = vocab_pass(hidden, weight, labels, 0.7, top_k=8, tensor_cores=tensor_cores)
        out.log_probs.sum().backward()
        runs[name] = (
            out,
            hidden.grad.clone(),
            weight.grad.clone(),
            bucket_log_masses(hidden.detach(), weight.detach(), out.top_ids, 0.7, tensor_cores=tensor_cores),
        )
        hidden.grad, weight.grad = None, None
    (tf32, dh_tf32, dw_tf32, buckets_tf32), (fp32, dh_fp32, dw_fp32, buckets_fp32) = runs["tf32"], runs["fp32"]
    torch.testing.assert_close(tf32.log_probs, fp32.log_probs, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tf32.entropy, fp32.entropy, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(buckets_tf32, buckets_fp32, rtol=1e-5, atol=1e-4)
    same_ids = (tf32.top_ids.sort(-1).values == fp32.top_ids.sort(-1).values).all(-1).float().mean()
    assert same_ids > 0.999  # a near-tie may swap order within summation tolerance
    torch.testing.assert_close(dh_tf32.float(), dh_fp32.float(), rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(dw_tf32.float(), dw_fp32.float(), rtol=2e-2, atol=1e-3)
    assert torch.backends.cuda.matmul.fp32_precision in ("none", "ieee")  # restored to the default


def test_acceptance_on_policy_invariant_through_the_tensor_core_pass(tmp_path: Path) -> None:
    """The acceptance run at a small shape: through the vocabulary pass on tensor cores ERC masks nothing
    and every ratio is exactly 1 before the first optimizer step, under FSDP1 and FSDP2; the CUDA allocator's
    figures per phase, the MFU against the device's peak and the searched longest micro-batch are reported."""
    out = tmp_path / "acceptance"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipe.bench",
            "gpu",
            "--acceptance",
            "--tokens",
            "4096",
            "--sequences",
            "4",
            "--layers",
            "2",
            "--search-seconds",
            "30",
            "--allow-unmeasured",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a target missed, reported
    report = json.loads((out / "acceptance.json").read_text())
    assert report["errors"] == {}, report["errors"]
    for strategy in ("fsdp", "fsdp2"):
        gauge = report["on_policy"][strategy]
        assert gauge["divclip_erc_vocab_pass"]["holds"] is True, gauge
        assert gauge["divclip_erc_vocab_pass"]["tensor_cores"] is True, gauge
        for name, f in report["figures"][strategy]["losses"].items():
            assert f["held_bytes"] > 0 and f["loss_peak_bytes"] > 0 and f["optimizer_peak_bytes"] > 0, (name, f)
            assert 0 < f["mfu"] < 1, (name, f["mfu"])
            if "longest" in f:
                assert f["longest"]["tokens"] >= 4096, (name, f["longest"])
