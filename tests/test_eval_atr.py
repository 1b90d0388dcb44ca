"""recipe.eval for the ATR paper: the ``atr`` preset (Table 4), the prompt vLLM receives for a
non-thinking Qwen3 checkpoint, and ``score --aggregate`` (mean ± std over runs, Table 3).

Real rows: AIME24 (``../shared/data/eval/aime24.klear.jsonl``) and the AMC 2023 problems of
``amc23.qwen.jsonl`` in the AI-MO ``aimo-validation-amc`` layout, converted by data_prep itself.
"""

from __future__ import annotations

import json
import statistics
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from data_prep.__main__ import main as data_prep_main
from recipe.eval.cli import main as eval_main
from recipe.eval.presets import PRESET_CHAT_TEMPLATE_KWARGS, canonical_benchmark, resolve_sampling
from recipe.eval.problems import load_eval_parquet
from tests.chat_templates import QWEN3_STYLE_TEMPLATE

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO_ROOT.parent / "shared/data/eval"


@pytest.fixture(scope="module")
def atr_parquets(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("atr_eval")
    assert data_prep_main(["aime24", "--input", str(EVAL_DIR / "aime24.klear.jsonl"), "--output", str(out)]) == 0
    amc = [json.loads(line) for line in (EVAL_DIR / "amc23.qwen.jsonl").read_text().splitlines() if line.strip()]
    aimo = out / "aimo.jsonl"
    aimo.write_text("".join(json.dumps({k: r[k] for k in ("id", "problem", "answer", "url")}) + "\n" for r in amc))
    assert data_prep_main(["aimo-amc", "--input", str(aimo), "--output", str(out)]) == 0
    return [out / "aime24.parquet", out / "aimo_amc.parquet"]


def test_atr_preset_is_table_4() -> None:
    for benchmark in ("aime24", "aime25", "aimo_amc", "amc23", "math500"):
        spec = resolve_sampling(benchmark, "atr")
        assert (spec.n, spec.temperature, spec.top_p, spec.max_tokens) == (8, 0.3, 0.95, 32768), benchmark
    assert PRESET_CHAT_TEMPLATE_KWARGS["atr"] == {"enable_thinking": False}
    assert canonical_benchmark("aimo-validation-amc") == "aimo_amc"


class FakeLLM:
    """vLLM's ``LLM`` as far as ``vllm_sampler`` uses it. ``chat`` has vLLM's signature and does
    what vLLM does with it: the model's HF chat template, ``add_generation_prompt=True`` and the
    ``chat_template_kwargs``, rendered to the text the engine tokenises."""

    made: list[dict[str, Any]] = []
    prompts: list[str] = []

    def __init__(
        self, model: str, tensor_parallel_size: int = 1, seed: int = 0, max_model_len: int | None = None
    ) -> None:
        from transformers import AutoTokenizer

        FakeLLM.made.append({"model": model, "max_model_len": max_model_len})
        self.tokenizer = AutoTokenizer.from_pretrained(model)

    def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None, chat_template=None,
             chat_template_content_format="auto", add_generation_prompt=True, continue_final_message=False,
             tools=None, chat_template_kwargs=None, mm_processor_kwargs=None):  # fmt: skip
        outputs = []
        for conversation in messages:
            prompt = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            FakeLLM.prompts.append(prompt)
            text = "Answer: 0"
            outputs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(text=text)] * sampling_params.n))
        return outputs


class FakeSamplingParams:
    def __init__(self, n: int, temperature: float, top_p: float, max_tokens: int, seed: int) -> None:
        self.n, self.temperature, self.top_p, self.max_tokens, self.seed = n, temperature, top_p, max_tokens, seed


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    from recipe.smoke.task import build_tokenizer

    module = types.ModuleType("vllm")
    module.LLM = FakeLLM  # type: ignore[attr-defined]
    module.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.made.clear()
    FakeLLM.prompts.clear()
    model = tmp_path / "qwen3-like"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    tokenizer.save_pretrained(model)
    (model / "config.json").write_text("{}")
    return model


def test_vllm_receives_the_non_thinking_prompt(fake_vllm: Path, atr_parquets: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "gen"
    argv = ["generate", "--model", str(fake_vllm), "--data", *map(str, atr_parquets), "--output", str(out),
            "--preset", "atr"]  # fmt: skip
    assert eval_main(argv) == 0  # the real vllm_sampler, on the fake engine
    _, aime = load_eval_parquet(atr_parquets[0])
    _, amc = load_eval_parquet(atr_parquets[1])
    assert len(FakeLLM.prompts) == len(aime) + len(amc) == 30 + 40
    first = FakeLLM.prompts[0]
    user = aime[0].messages[-1]["content"]
    assert first == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert all(p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in FakeLLM.prompts)
    rows = [json.loads(line) for line in (out / "aimo_amc.jsonl").read_text().splitlines()]
    assert rows[0]["sampling"] == {"n": 8, "temperature": 0.3, "top_p": 0.95, "max_tokens": 32768}


def test_thinking_mode_is_one_flag_away(fake_vllm: Path, atr_parquets: list[Path], tmp_path: Path) -> None:
    argv = ["generate", "--model", str(fake_vllm), "--data", str(atr_parquets[0]), "--output", str(tmp_path / "g"),
            "--preset", "atr", "--chat-template-kwargs", '{"enable_thinking": true}']  # fmt: skip
    assert eval_main(argv) == 0
    assert FakeLLM.prompts[0].endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- score --aggregate


def _generate_run(folder: Path, parquet: Path, right_per_problem: list[int], n: int = 8) -> Path:
    """A ``generate`` output folder whose problem i has ``right_per_problem[i]`` correct responses."""
    benchmark, problems = load_eval_parquet(parquet)
    folder.mkdir(parents=True)
    with open(folder / f"{benchmark}.jsonl", "w") as handle:
        for problem, right in zip(problems, right_per_problem, strict=True):
            acc = [True] * right + [False] * (n - right)
            preds = [problem.ground_truth] * right + ["-1"] * (n - right)
            handle.write(json.dumps({"problem_id": problem.problem_id, "benchmark": benchmark,
                                     "ground_truth": problem.ground_truth, "responses": ["x"] * n,
                                     "acc": acc, "preds": preds}) + "\n")  # fmt: skip
    return folder


def test_aggregate_three_seeds_mean_and_std(atr_parquets: list[Path], tmp_path: Path, capsys) -> None:
    aime = atr_parquets[0]
    # seed s: the first 3*s problems of 30 have all 8 right, the rest none -> mean@8 = s/10
    runs = [_generate_run(tmp_path / f"atr_seed{s}", aime, [8] * (3 * s) + [0] * (30 - 3 * s)) for s in (1, 2, 3)]
    clip = [_generate_run(tmp_path / f"clip_seed{s}", aime, [4] * 30) for s in (1, 2)]
    out_json = tmp_path / "agg.json"
    assert eval_main(["score", "--aggregate", "--k", "8", *map(str, runs + clip), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["rows"] == ["atr", "clip"]
    atr = result["results"]["atr"]
    assert atr["runs"] == 3
    cell = atr["final"]["mean@8"]["aime24"]
    assert cell["values"] == pytest.approx([0.1, 0.2, 0.3])
    assert cell["mean"] == pytest.approx(0.2) and cell["std"] == pytest.approx(statistics.stdev([0.1, 0.2, 0.3]))
    assert atr["final"]["pass@8"]["aime24"]["mean"] == pytest.approx(0.2)
    clip_cell = result["results"]["clip"]["final"]["mean@8"]["avg"]
    assert clip_cell["mean"] == pytest.approx(0.5) and clip_cell["std"] == 0.0
    assert "| atr | 3 | 20.0 ± 10.0 | 20.0 ± 10.0 |" in text


def _verl_dump(folder: Path, parquet: Path, step_right: dict[int, int]) -> Path:
    """verl ``validation_data_dir`` with one ``<step>.jsonl`` per step; ``step_right[step]`` problems
    (of the first 10) are answered right by all 8 samples."""
    _, problems = load_eval_parquet(parquet)
    folder.mkdir(parents=True)
    for step, right in step_right.items():
        with open(folder / f"{step}.jsonl", "w") as handle:
            for i, problem in enumerate(problems[:10]):
                for j in range(8):
                    ok = i < right
                    handle.write(json.dumps({"input": problem.messages[-1]["content"], "output": "o",
                                             "gts": problem.ground_truth, "score": float(ok), "step": step,
                                             "acc": ok, "pred": problem.ground_truth if ok else "-1",
                                             "uid": f"p{i}_{j}_0"}) + "\n")  # fmt: skip
    return folder


def test_aggregate_final_and_best_checkpoint(atr_parquets: list[Path], tmp_path: Path) -> None:
    aime = atr_parquets[0]
    run1 = _verl_dump(tmp_path / "kl3_seed1", aime, {25: 2, 50: 6, 75: 4})  # best 0.6 at step 50, final 0.4
    run2 = _verl_dump(tmp_path / "kl3_seed2", aime, {25: 3, 50: 5, 75: 8})  # best = final = 0.8
    out_json = tmp_path / "agg.json"
    argv = ["score", "--aggregate", "--k", "8", "--benchmark", "aime24", str(run1), str(run2), "--json", str(out_json)]
    assert eval_main(argv) == 0
    row = json.loads(out_json.read_text())["results"]["kl3"]
    assert row["final"]["mean@8"]["aime24"]["values"] == pytest.approx([0.4, 0.8])
    assert row["best"]["mean@8"]["aime24"]["values"] == pytest.approx([0.6, 0.8])
    assert row["best"]["mean@8"]["avg"]["mean"] == pytest.approx(0.7)


def test_aggregate_rejects_runs_on_different_benchmarks(atr_parquets: list[Path], tmp_path: Path, capsys) -> None:
    a = _generate_run(tmp_path / "atr_seed1", atr_parquets[0], [1] * 30)
    b = _generate_run(tmp_path / "atr_seed2", atr_parquets[1], [1] * 40)
    assert eval_main(["score", "--aggregate", "--k", "8", str(a), str(b)]) == 2
    assert "every run of a row must be scored on the same benchmarks" in capsys.readouterr().err
    assert eval_main(["score", "--aggregate", "--labels", "x", str(a), str(b)]) == 2
    assert "--labels has 1 names for 2 runs" in capsys.readouterr().err
