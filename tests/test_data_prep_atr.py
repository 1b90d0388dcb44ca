"""data_prep for the ATR paper: the 83-problem AI-MO AMC set (``aimo-amc``) and the
OpenMathReasoning SFT set (``openmathreasoning``), on fixtures in the exact upstream schemas.

The AMC fixture is built from the real AMC 2023 rows of ``../shared/data/eval/amc23.qwen.jsonl``
(Qwen's copy of AI-MO/aimo-validation-amc's 2023 problems), reduced to the AI-MO columns and
dtypes: ``id`` int64, ``problem`` string, ``answer`` float64, ``url`` string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.__main__ import main as cli_main
from data_prep.convert import convert
from data_prep.io import DataPrepError
from tests.chat_templates import QWEN3_STYLE_TEMPLATE

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO_ROOT.parent / "shared/data/eval"
AMC23 = EVAL_DIR / "amc23.qwen.jsonl"

AIMO_SCHEMA = pa.schema([("id", pa.int64()), ("problem", pa.string()), ("answer", pa.float64()), ("url", pa.string())])


def amc_rows() -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in AMC23.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{"id": r["id"], "problem": r["problem"], "answer": r["answer"], "url": r["url"]} for r in rows]


def write_aimo(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=AIMO_SCHEMA), path)
    return path


def test_aimo_amc_is_its_own_dataset(tmp_path: Path) -> None:
    rows = amc_rows()
    source = write_aimo(tmp_path / "train-00000-of-00001.parquet", rows)
    summary = convert("aimo-amc", str(source), tmp_path / "out")
    assert Path(summary.output).name == "aimo_amc.parquet"
    assert summary.rows_read == summary.rows_written == len(rows) == 40
    out = pd.read_parquet(summary.output)
    assert set(out["data_source"]) == {"aimo_amc"}
    # float answers lose their .0: 27.0 -> "27"
    assert out["reward_model"][0]["ground_truth"] == "27"
    assert out["extra_info"][0]["source_id"] == str(rows[0]["id"])
    assert out["prompt"][0][0]["content"].startswith(rows[0]["problem"])
    assert out["prompt"][0][0]["content"].endswith("\\boxed{}.")
    # every answer is the float of the upstream row, as text
    for row, truth in zip(rows, out["reward_model"], strict=False):
        assert float(truth["ground_truth"]) == row["answer"]


def test_aimo_amc_reads_jsonl_too(tmp_path: Path) -> None:
    rows = amc_rows()[:3]
    source = tmp_path / "amc.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert cli_main(["aimo-amc", "--input", str(source), "--output", str(tmp_path)]) == 0
    assert len(pd.read_parquet(tmp_path / "aimo_amc.parquet")) == 3


def test_aimo_amc_row_without_answer_is_an_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    good = write_aimo(tmp_path / "good.parquet", amc_rows())
    convert("aimo-amc", str(good), out_dir)
    before = (out_dir / "aimo_amc.parquet").read_bytes()

    rows = amc_rows()
    rows[5]["answer"] = None
    bad = write_aimo(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataPrepError, match=r"bad\.parquet: row 5 \(id 5\): missing answer; .*nothing was written"):
        convert("aimo-amc", str(bad), out_dir)
    assert cli_main(["aimo-amc", "--input", str(bad), "--output", str(out_dir)]) == 2
    assert "row 5 (id 5): missing answer" in capsys.readouterr().err
    assert (out_dir / "aimo_amc.parquet").read_bytes() == before  # nothing already written is lost


def test_aimo_amc_needs_the_upstream_columns(tmp_path: Path) -> None:
    rows = [{k: v for k, v in r.items() if k != "url"} for r in amc_rows()[:2]]
    source = tmp_path / "no_url.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DataPrepError, match=r"no_url\.jsonl: aimo-amc needs column\(s\) \['url'\]"):
        convert("aimo-amc", str(source), tmp_path)
    assert not (tmp_path / "aimo_amc.parquet").exists()


def test_aimo_amc_duplicate_problem_is_an_error(tmp_path: Path) -> None:
    rows = amc_rows()[:3]
    rows.append({**rows[0], "id": 99})
    with pytest.raises(DataPrepError, match="duplicate problem"):
        convert("aimo-amc", str(write_aimo(tmp_path / "dup.parquet", rows)), tmp_path)


# ---------------------------------------------------------------- OpenMathReasoning (SFT set)

from data_prep.openmath import (  # noqa: E402
    EVAL_OVERLAP,
    NO_THINK_CLOSE,
    NO_VERIFIABLE_ANSWER,
    NOT_COT,
    OTHER_SOLUTION,
    TOO_LONG,
    convert_openmath,
)

#: nvidia/OpenMathReasoning's columns and dtypes (dataset card, splits cot/tir/genselect/additional_problems)
OMR_SCHEMA = pa.schema(
    [
        ("expected_answer", pa.string()),
        ("problem_type", pa.string()),
        ("problem_source", pa.string()),
        ("generation_model", pa.string()),
        ("pass_rate_72b_tir", pa.string()),
        ("problem", pa.string()),
        ("generated_solution", pa.string()),
        ("inference_mode", pa.string()),
        ("used_in_kaggle", pa.bool_()),
    ]
)


def omr_row(problem: str, answer: str | None, solution: str, mode: str = "cot",
            problem_type: str = "has_answer_extracted") -> dict[str, Any]:  # fmt: skip
    return {"expected_answer": answer, "problem_type": problem_type, "problem_source": "aops_c4_high_school_math",
            "generation_model": "DeepSeek-R1", "pass_rate_72b_tir": "0.5", "problem": problem,
            "generated_solution": solution, "inference_mode": mode, "used_in_kaggle": False}  # fmt: skip


def char_tokenizer(chat_template: str) -> Any:
    """A character-level tokenizer over printable ASCII with ChatML specials (decode(encode(s)) == s),
    built locally: no hub. One token per character, so token counts are character counts."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {token: i for i, token in enumerate([*specials, *dict.fromkeys(string.printable)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>", additional_special_tokens=specials[1:3],
                                        model_max_length=100_000, clean_up_tokenization_spaces=False)  # fmt: skip
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def qwen3_like_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    char_tokenizer(QWEN3_STYLE_TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("evalsets")
    assert cli_main(["aime24", "--input", str(EVAL_DIR / "aime24.klear.jsonl"), "--output", str(out)]) == 0
    return out


def omr_fixture(path: Path) -> tuple[Path, str]:
    aime_problem = json.loads((EVAL_DIR / "aime24.klear.jsonl").read_text().splitlines()[0])["messages"][0]["content"]
    rows = [
        omr_row("Find 1+1.", "2", "<think>\nlong trace 1+1...\n</think>\nWe add: 1+1=2, so \\boxed{2}."),
        omr_row("Find 1+1.", "2", "<think>\nother\n</think>\n1+1 = \\boxed{2}."),  # shorter: this one is kept
        omr_row("Find 2+3.", "5", "<think>\n...\n</think>\nThe sum is \\boxed{5}.", mode="tir"),
        omr_row("Find 2+4.", "6", "<think>\n...\n</think>\nThe sum is \\boxed{6}.", problem_type="no_answer_extracted"),
        omr_row("Find 3+4.", "7", "<think>\nnever closed"),
        omr_row(aime_problem.replace("$", " $ "), "73", "<think>x</think>\nThe answer is \\boxed{73}."),
        omr_row("Find 9+9.", "18", "<think>x</think>\n" + "Add the numbers carefully. " * 200 + "\\boxed{18}"),
        omr_row("Compute 6*7.", "42", "<think>x</think>\n6*7 = \\boxed{42}."),
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=OMR_SCHEMA), path)
    return path, aime_problem


def test_openmathreasoning_sft_rows(tmp_path: Path, qwen3_like_tokenizer: Path, eval_dir: Path) -> None:
    source, _ = omr_fixture(tmp_path / "cot-00000-of-00144.parquet")
    summary = convert_openmath(str(source), tmp_path / "out", str(qwen3_like_tokenizer), [str(eval_dir)],
                               sample=10, max_tokens=2048)  # fmt: skip
    assert summary.rows_read == 8 and summary.rows_written == 2
    assert summary.dropped == {NOT_COT: 1, NO_VERIFIABLE_ANSWER: 1, NO_THINK_CLOSE: 1, EVAL_OVERLAP: 1,
                               OTHER_SOLUTION: 1, TOO_LONG: 1}  # fmt: skip
    assert summary.excluded_problems == 30
    out = pd.read_parquet(summary.output)
    assert Path(summary.output).name == "openmathreasoning_sft.parquet"
    by_problem = {row["extra_info"]["problem"]: row for _, row in out.iterrows()}
    assert set(by_problem) == {"Find 1+1.", "Compute 6*7."}
    row = by_problem["Find 1+1."]
    user, assistant = row["messages"]
    # the RL prompt's text (DAPO-Math Answer: instruction), the shortest solution, the Answer: line
    assert user["role"] == "user" and user["content"].startswith("Solve the following math problem step by step.")
    assert "Find 1+1." in user["content"] and user["content"].endswith('after "Answer:".')
    assert assistant == {"role": "assistant", "content": "1+1 = \\boxed{2}.\n\nAnswer: 2"}
    assert not row["enable_thinking"] and row["data_source"] == "openmathreasoning"
    assert all(r["extra_info"]["num_tokens"] <= 2048 for _, r in out.iterrows())


def test_openmathreasoning_sample_is_deterministic_and_bounded(tmp_path: Path, qwen3_like_tokenizer: Path,
                                                               eval_dir: Path) -> None:  # fmt: skip
    rows = [omr_row(f"Find {i}+{i}.", str(2 * i), f"<think>t</think>\nIt is \\boxed{{{2 * i}}}.") for i in range(50)]
    forward, backward = tmp_path / "f.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=OMR_SCHEMA), forward)
    pq.write_table(pa.Table.from_pylist(rows[::-1], schema=OMR_SCHEMA), backward)
    picked = []
    for source, out in ((forward, tmp_path / "o1"), (backward, tmp_path / "o2")):
        summary = convert_openmath(str(source), out, str(qwen3_like_tokenizer), [str(eval_dir)], sample=7)
        assert summary.rows_written == 7 and sum(summary.dropped.values()) == 43
        picked.append([r["extra_info"]["problem"] for _, r in pd.read_parquet(summary.output).iterrows()])
    assert picked[0] == picked[1]  # the sample does not depend on the input order


def test_openmathreasoning_bad_input_is_a_clear_error(tmp_path: Path, qwen3_like_tokenizer: Path,
                                                      eval_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "out"
    good, _ = omr_fixture(tmp_path / "good.parquet")
    convert_openmath(str(good), out, str(qwen3_like_tokenizer), [str(eval_dir)])
    before = (out / "openmathreasoning_sft.parquet").read_bytes()
    wrong = tmp_path / "wrong.jsonl"  # a solutions file with other column names
    wrong.write_text(json.dumps({"question": "Find 1+1.", "solution": "2", "answer": "2"}) + "\n")
    argv = ["openmathreasoning", "--input", str(wrong), "--output", str(out), "--tokenizer", str(qwen3_like_tokenizer),
            "--exclude", str(eval_dir)]  # fmt: skip
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "wrong.jsonl: not the nvidia/OpenMathReasoning layout" in err and "'generated_solution'" in err
    assert (out / "openmathreasoning_sft.parquet").read_bytes() == before  # nothing already written is lost
    with pytest.raises(DataPrepError, match="needs --exclude"):
        convert_openmath(str(good), out, str(qwen3_like_tokenizer), [])
    with pytest.raises(DataPrepError, match="--tokenizer .* could not be loaded"):
        convert_openmath(str(good), out, str(tmp_path / "no-such-model"), [str(eval_dir)])


def test_sft_dataset_feeds_the_rl_prompt(tmp_path: Path, qwen3_like_tokenizer: Path, eval_dir: Path) -> None:
    """verl's SFT trainer reads the rows through recipe.sft_dataset: prompt = the RL rollout's prompt
    (chat template + non-thinking generation prompt), loss on the target and its end-of-turn only."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from recipe.sft_dataset import RLPromptSFTDataset

    source, _ = omr_fixture(tmp_path / "cot.parquet")
    summary = convert_openmath(str(source), tmp_path / "out", str(qwen3_like_tokenizer), [str(eval_dir)])
    tokenizer = AutoTokenizer.from_pretrained(qwen3_like_tokenizer)
    config = OmegaConf.create({"max_length": 2048, "truncation": "error", "pad_mode": "no_padding",
                               "apply_chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    dataset = RLPromptSFTDataset(summary.output, tokenizer, config)
    row = pd.read_parquet(summary.output).iloc[0]
    item = dataset[0]
    ids, loss = item["input_ids"].tolist(), item["loss_mask"].tolist()
    user, assistant = row["messages"]
    rl_prompt = tokenizer.apply_chat_template([{"role": "user", "content": user["content"]}], add_generation_prompt=True,
                                              tokenize=False, enable_thinking=False)  # fmt: skip
    assert rl_prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    n_prompt = loss.index(1)
    assert tokenizer.decode(ids[:n_prompt]) == rl_prompt
    assert tokenizer.decode(ids[n_prompt:]) == assistant["content"] + "<|im_end|>"
    assert loss == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    assert len(ids) == row["extra_info"]["num_tokens"]


def test_sft_dataset_rejects_other_conversations(tmp_path: Path, qwen3_like_tokenizer: Path) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from recipe.sft_dataset import RLPromptSFTDataset

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "assistant", "content": "x"},
                                                       {"role": "user", "content": "y"}]}]), path)  # fmt: skip
    dataset = RLPromptSFTDataset(str(path), AutoTokenizer.from_pretrained(qwen3_like_tokenizer),
                                 OmegaConf.create({"pad_mode": "no_padding"}))  # fmt: skip
    with pytest.raises(ValueError, match=r"must be \[user, assistant\]; expected role 'user'"):
        dataset[0]
