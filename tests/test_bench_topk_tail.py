"""``python -m recipe.bench topk-tail``: pi's mass outside its top-k on teacher-forced real solutions.

A tiny Qwen3 with the smoke task's tokenizer, the first real MATH-500 rows: the tail masses are the
direct computation's (fp64 sort and sum over the vocabulary), non-increasing in k and exactly 0 at
k = vocabulary; bad input names the option, the file and the row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from recipe.bench import topk_tail
from recipe.smoke.task import save_model_and_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
MATH500 = REPO_ROOT.parent / "shared/data/eval/math500.h4.jsonl"
needs_math500 = pytest.mark.skipif(not MATH500.is_file(), reason=f"real eval data absent: {MATH500}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model_and_tokenizer(tmp_path_factory.mktemp("topk_tail_model"), seed=0)


def test_tail_log_masses_are_the_direct_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 300, generator=gen) * torch.logspace(-1, 1.5, 7).unsqueeze(1)
    monkeypatch.setattr(topk_tail, "ROWS_PER_CHUNK", 3)  # rows in chunks of 3, 3 and 1
    log_probs = torch.log_softmax(logits, dim=-1)
    ks = [1, 3, 32, 300]
    got = topk_tail.tail_log_masses(log_probs, ks)
    ranked = log_probs.double().sort(dim=-1, descending=True).values
    for column, k in enumerate(ks):
        expected = (
            torch.logsumexp(ranked[:, k:], dim=-1) if k < 300 else torch.full((7,), -math.inf, dtype=torch.float64)
        )
        torch.testing.assert_close(got[:, column], expected, rtol=1e-12, atol=0)


@needs_math500
def test_probe_on_real_solutions(model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    from verl_ext.core.coarsened_kl import stored_bytes_per_token

    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    argv = ["--model", model_dir, "--data", str(MATH500), "--k", f"1,4,16,{vocab}", "--max-tokens", "300", "--json"]
    assert topk_tail.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] >= 300 and result["sequences"] >= 1 and result["vocab_size"] == vocab
    means = [row["tail_mean"] for row in result["per_k"]]
    assert all(a >= b for a, b in zip(means, means[1:], strict=False)) and means[0] > 0.5  # a random model: broad
    last = result["per_k"][-1]
    assert last["k"] == vocab and last["tail_max"] == 0.0
    assert [row["bytes_per_token"] for row in result["per_k"]] == [stored_bytes_per_token(k) for k in (1, 4, 16, vocab)]
    assert result["suggested_k"] == topk_tail.smallest_k(result, "tail_p99", 1e-2) == vocab


def test_bad_input_is_named(model_dir: str, tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    with pytest.raises(FileNotFoundError, match=r"--data .*none\.jsonl: no such file"):
        topk_tail.main(["--model", model_dir, "--data", str(missing)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n" + json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 has no non-empty string 'solution'"):
        topk_tail.main(["--model", model_dir, "--data", str(bad)])
    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n{problem: 1}\n")
    with pytest.raises(ValueError, match=r"not_json\.jsonl:2 is not JSON"):
        topk_tail.main(["--model", model_dir, "--data", str(not_json)])
    with pytest.raises(SystemExit, match="--k '0,4': every k must be >= 1"):
        topk_tail.main(["--model", model_dir, "--data", str(bad), "--k", "0,4"])
    with pytest.raises(SystemExit, match="--model .*: not a local checkpoint directory"):
        topk_tail.main(["--model", str(tmp_path / "hub/id"), "--data", str(bad)])
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"--k=100000 must lie in \[1, vocabulary size \d+\]"):
        topk_tail.main(["--model", model_dir, "--data", str(good), "--k", "100000"])
