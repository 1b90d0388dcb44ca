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
    from verl_ext.entropy import entropy_fp32, entropy_fp32_compiled

    logits = peaky_logits(256, 151_936, torch.bfloat16).cuda()
    compiled = entropy_fp32_compiled(logits)
    assert_matches_fp64(compiled.cpu(), logits.cpu())
    assert_matches_fp64(entropy_fp32(logits).cpu(), logits.cpu())


def test_compiled_rows_do_not_depend_on_the_batch() -> None:
    from verl_ext.entropy import entropy_fp32_compiled

    logits = peaky_logits(3000, 32_000, torch.bfloat16, seed=2).cuda()
    whole = entropy_fp32_compiled(logits)
    for lo, hi in ((0, 1000), (17, 1234), (2999, 3000), (5, 2051)):
        assert torch.equal(whole[lo:hi], entropy_fp32_compiled(logits[lo:hi])), (lo, hi)


def test_gpu_probe_small_model(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.bench", "gpu", "--tokens", "4096", "--sequences", "4", "--layers", "2",
         "--repeats", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
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
        [sys.executable, "-m", "recipe.bench", "gpu", "--tokens", "4096", "--sequences", "4", "--layers", "2",
         "--repeats", "1", "--strategies", "fsdp,fsdp2", "--variants", "divclip_erc,divclip_erc_dynamic",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
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

