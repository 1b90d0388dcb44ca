"""data_prep: upstream layouts, DAPO dedupe, bad input, and a round trip through verl's RLHFDataset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.__main__ import main as cli_main
from data_prep.convert import CONFLICT, DUPLICATE, convert
from data_prep.io import DataPrepError
from data_prep.templates import DAPO_PREFIX, DAPO_SUFFIX, apply_template, strip_known_template

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO_ROOT.parent / "shared/data/eval"
needs_eval_data = pytest.mark.skipif(not EVAL_DIR.is_dir(), reason=f"real eval data absent: {EVAL_DIR}")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_output(path: str | Path) -> pd.DataFrame:
    return pd.read_parquet(path)


# ----------------------------------------------------------------------------- DAPO


def dapo_row(problem: str, answer: str, uid: str) -> dict[str, Any]:
    """One row exactly as BytedTsinghua-SIA/DAPO-Math-17k publishes it."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": uid},
    }


@pytest.fixture()
def dapo_fixture(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """Distinct rows repeated 100x, like the published file, with one conflicting problem."""
    distinct = [
        dapo_row("Find $1+1$.", "2", "u0"),
        dapo_row("Compute $3 \\cdot 4$.", "12", "u1"),
        dapo_row("Find  $1+1$. ", "2", "u2"),  # same problem up to whitespace: a duplicate
        dapo_row("How many primes are below 10?", "4", "u3"),
        dapo_row("How many primes are below 10?", "5", "u4"),  # conflicting ground truth
        dapo_row("Evaluate $2^{10}$.", "1024", "u5"),
    ]
    repeats = 100
    rows = [row for _ in range(repeats) for row in distinct]
    expected = {
        "read": len(rows),
        "written": 3,  # 1+1, 3*4, 2^10
        "conflict_rows": 2 * repeats,
        "duplicate_rows": len(rows) - 2 * repeats - 3,
    }
    return write_parquet(tmp_path / "dapo.parquet", rows), expected


def test_dapo_dedupe_is_stable_and_drops_conflicts(dapo_fixture, tmp_path: Path) -> None:
    source, expected = dapo_fixture
    summary = convert("dapo-math-17k", str(source), tmp_path / "out")
    assert summary.rows_read == expected["read"]
    assert summary.rows_written == expected["written"]
    assert summary.dropped[CONFLICT] == expected["conflict_rows"]
    assert summary.dropped[DUPLICATE] == expected["duplicate_rows"]
    assert summary.conflicting_problems == 1
    assert summary.rows_read == summary.rows_written + sum(summary.dropped.values())
    df = read_output(summary.output)
    problems = [info["problem"] for info in df["extra_info"]]
    assert problems == ["Find $1+1$.", "Compute $3 \\cdot 4$.", "Evaluate $2^{10}$."]  # first-seen order
    assert [rm["ground_truth"] for rm in df["reward_model"]] == ["2", "12", "1024"]
    assert [info["source_id"] for info in df["extra_info"]] == ["u0", "u1", "u5"]
    assert list(df["data_source"]) == ["math_dapo"] * 3
    # Default template is DAPO's own, byte for byte.
    assert df["prompt"][0][0]["content"] == DAPO_PREFIX + "Find $1+1$." + DAPO_SUFFIX
    assert [info["index"] for info in df["extra_info"]] == [0, 1, 2]


@pytest.mark.parametrize("template", ["boxed", "bare"])
def test_dapo_other_templates_rewrap_the_bare_problem(dapo_fixture, tmp_path: Path, template: str) -> None:
    source, _ = dapo_fixture
    summary = convert("dapo-math-17k", str(source), tmp_path / template, template=template)
    df = read_output(summary.output)
    assert df["prompt"][1][0]["content"] == apply_template(template, "Compute $3 \\cdot 4$.")
    assert "Answer:" not in df["prompt"][1][0]["content"]
    assert set(df["data_source"]) == {"dapo_math_17k"}  # not the +-1 ``Answer:`` route


def test_strip_known_template_only_strips_complete_wrappers() -> None:
    assert strip_known_template(apply_template("dapo", "What is 2+2?")) == "What is 2+2?"
    assert strip_known_template(apply_template("boxed", "What is 2+2?")) == "What is 2+2?"
    half = DAPO_PREFIX + "What is 2+2?"
    assert strip_known_template(half) == half.strip()


# ----------------------------------------------------------------------------- Klear 30K


def klear_rows() -> list[dict[str, Any]]:
    return [
        {
            "data_source": "math_longcot_math_verify",
            "prompt": [{"content": f"Problem number {i}: find $x$ if $x={i}$.", "role": "user"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(i), "style": "rule"},
            "__index_level_0__": str(29990 + i),
        }
        for i in range(5)
    ]


@pytest.mark.parametrize("container", ["array", "lines"])
def test_klear_json_array_and_json_lines(tmp_path: Path, container: str) -> None:
    rows = klear_rows()
    path = tmp_path / "klear.json"
    if container == "array":
        path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    else:
        write_jsonl(path, rows)
    summary = convert("klear-math-30k", str(path), tmp_path / "out")
    assert summary.layout == "verl"
    assert (summary.rows_read, summary.rows_written) == (5, 5)
    df = read_output(summary.output)
    assert list(df["data_source"]) == ["math_longcot_math_verify"] * 5
    assert [p[0]["content"] for p in df["prompt"]] == [r["prompt"][0]["content"] for r in rows]  # bare
    assert [info["source_id"] for info in df["extra_info"]] == [r["__index_level_0__"] for r in rows]
    assert set(info["split"] for info in df["extra_info"]) == {"train"}


# ----------------------------------------------------------------------------- eval layouts

HUB_LAYOUTS: list[tuple[str, str, list[dict[str, Any]], list[str], str]] = [
    # (dataset, layout name, rows in the upstream layout, expected answers, case id)
    (
        "aime24",
        "problem-answer",
        [
            {
                "id": 60,
                "problem": "Every morning Aya walks $9$ km.",
                "solution": "...",
                "answer": "204",
                "url": "https://x",
                "year": "2024",
            }
        ],
        ["204"],
        "HuggingFaceH4/aime_2024",
    ),
    (
        "aime24",
        "Problem-Answer",
        [{"ID": "2024-I-1", "Problem": "Every morning Aya walks $9$ km.", "Solution": "...", "Answer": 204}],
        ["204"],
        "Maxwell-Jia/AIME_2024",
    ),
    (
        "aime25",
        "question-answer",
        [{"question": "Find the sum of all integer bases $b>9$.", "answer": "70"}],
        ["70"],
        "opencompass/AIME2025",
    ),
    (
        "aime25",
        "problem-answer",
        [
            {
                "id": "0",
                "problem": "Find the sum of all integer bases $b>9$.",
                "solution": "...",
                "answer": "70",
                "url": "u",
                "year": "2025",
            }
        ],
        ["70"],
        "yentinglin/aime_2025",
    ),
    (
        "amc23",
        "question-answer",
        [{"id": 0, "question": "How many miles from City $A$?", "answer": 27.0}],
        ["27"],
        "math-ai/amc23",
    ),
    (
        "amc23",
        "problem-answer",
        [
            {"id": 0, "problem": "What is $x+y$?", "answer": 142.0, "url": "u"},
            {"id": 1, "problem": "What is $x/y$?", "answer": 2.5, "url": "u"},
        ],
        ["142", "2.5"],
        "AI-MO/aimo-validation-amc",
    ),
    (
        "math500",
        "problem-answer",
        [
            {
                "problem": "Convert $(0,3)$ to polar.",
                "solution": "... \\boxed{(3, \\frac{\\pi}{2})}",
                "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                "subject": "Precalculus",
                "level": 2,
                "unique_id": "test/precalculus/807.json",
            }
        ],
        ["\\left( 3, \\frac{\\pi}{2} \\right)"],
        "HuggingFaceH4/MATH-500",
    ),
    (
        "hmmt25",
        "problem-answer",
        [
            {
                "problem_idx": 1,
                "problem": "Compute the sum of the divisors of $9!$.",
                "answer": "103",
                "problem_type": ["Number Theory"],
            }
        ],
        ["103"],
        "MathArena/hmmt_feb_2025",
    ),
    (
        "olympiadbench",
        "olympiadbench",
        [
            {
                "id": 1606,
                "question": "Find $x$.",
                "solution": ["..."],
                "final_answer": ["$\\frac{1}{2}$"],
                "context": None,
                "image_1": None,
                "is_multiple_answer": False,
                "unit": None,
                "answer_type": "Numerical",
                "subfield": "Algebra",
                "language": "English",
            },
            {
                "id": 1607,
                "question": "Find all $x$.",
                "solution": ["..."],
                "final_answer": ["$1$", "$-2$"],
                "context": None,
                "image_1": None,
                "is_multiple_answer": True,
                "unit": None,
                "answer_type": "Numerical",
                "subfield": "Algebra",
                "language": "English",
            },
            {
                "id": 1608,
                "question": "Prove that $x>0$.",
                "solution": ["..."],
                "final_answer": None,
                "context": None,
                "image_1": None,
                "is_multiple_answer": False,
                "unit": None,
                "answer_type": None,
                "subfield": "Algebra",
                "language": "English",
            },
            {
                "id": 1609,
                "question": "In the figure, find $x$.",
                "solution": ["..."],
                "final_answer": ["$3$"],
                "context": None,
                "image_1": "<image bytes>",
                "is_multiple_answer": False,
                "unit": None,
                "answer_type": "Numerical",
                "subfield": "Geometry",
                "language": "English",
            },
        ],
        ["\\frac{1}{2}", "1, -2"],
        "Hothan/OlympiadBench",
    ),
]


@pytest.mark.parametrize(
    ("dataset", "layout", "rows", "answers", "case"), HUB_LAYOUTS, ids=[c[-1] for c in HUB_LAYOUTS]
)
def test_hub_layouts(
    tmp_path: Path, dataset: str, layout: str, rows: list[dict[str, Any]], answers: list[str], case: str
) -> None:
    source = write_parquet(tmp_path / "in.parquet", rows)
    summary = convert(dataset, str(source), tmp_path / "out")
    assert summary.layout == layout
    df = read_output(summary.output)
    assert [rm["ground_truth"] for rm in df["reward_model"]] == answers
    assert set(df["data_source"]) == {dataset}
    assert all(info["split"] == "test" for info in df["extra_info"])
    assert all(p[0]["content"].endswith("\\boxed{}.") for p in df["prompt"])  # boxed is the eval default


def test_olympiadbench_drops_proofs_and_image_problems_with_reasons(tmp_path: Path) -> None:
    rows = HUB_LAYOUTS[-1][2]
    summary = convert("olympiadbench", str(write_parquet(tmp_path / "o.parquet", rows)), tmp_path / "out")
    assert summary.dropped == {"no final_answer (proof problem)": 1, "problem needs an image": 1}


def test_math500_keeps_subject_and_level(tmp_path: Path) -> None:
    rows = HUB_LAYOUTS[6][2]
    df = read_output(convert("math500", str(write_parquet(tmp_path / "m.parquet", rows)), tmp_path / "o").output)
    info = df["extra_info"][0]
    assert (info["subject"], info["level"], info["source_id"]) == ("Precalculus", "2", "test/precalculus/807.json")


REAL_FILES = [
    ("aime24", "aime24.klear.jsonl", "klear-meta"),
    ("aime25", "aime25.klear.jsonl", "klear-meta"),
    ("hmmt25", "hmmt_feb_2025.klear.jsonl", "klear-answer"),
    ("amc23", "amc23.qwen.jsonl", "problem-answer"),
    ("math500", "math500.h4.jsonl", "problem-answer"),
]


def reference_answer(row: dict[str, Any]) -> str:
    """The answer field named in shared/data/README.md, independently of data_prep."""
    if "meta" in row:
        return str(row["meta"]["solution"]).strip()
    value = row["answer"]
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value).strip()


@needs_eval_data
@pytest.mark.parametrize(("dataset", "filename", "layout"), REAL_FILES)
def test_real_eval_files(tmp_path: Path, dataset: str, filename: str, layout: str) -> None:
    path = EVAL_DIR / filename
    source_rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    summary = convert(dataset, str(path), tmp_path)
    assert summary.layout == layout
    assert summary.rows_read == len(source_rows)
    assert summary.rows_written == len(source_rows), summary.dropped  # no repetition in these sets
    df = read_output(summary.output)
    assert [rm["ground_truth"] for rm in df["reward_model"]] == [reference_answer(r) for r in source_rows]
    assert df["prompt"].map(len).eq(1).all()


# ----------------------------------------------------------------------------- bad input


def test_bad_rows_are_counted_by_reason(tmp_path: Path) -> None:
    rows = [
        {"problem": "Good problem?", "answer": "1"},
        {"problem": "", "answer": "1"},
        {"problem": None, "answer": "1"},
        {"problem": 12, "answer": "1"},
        {"problem": "No answer?", "answer": None},
        {"problem": "Blank answer?", "answer": "   "},
        {"problem": "Dict answer?", "answer": {"x": 1}},
        {"problem": "Bool answer?", "answer": True},
        {"problem": "NaN answer?", "answer": float("nan")},
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n[1, 2]\n", encoding="utf-8")
    summary = convert("math500", str(path), tmp_path / "out")
    assert summary.rows_written == 1
    assert summary.rows_read == len(rows) + 2
    assert summary.dropped == {
        "empty problem": 1,
        "missing problem": 1,
        "problem is int, not a string": 1,
        "missing answer": 1,
        "empty answer": 1,
        "answer is dict, not a string": 1,
        "answer is bool, not a string or number": 1,
        "answer is not a finite number": 1,
        "invalid JSON line": 1,
        "row is list, not an object": 1,
    }


def test_all_rows_bad_is_an_error_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "", "answer": "1"}, {"problem": "x", "answer": None}])
    out = tmp_path / "out"
    assert cli_main(["math500", "--input", str(path), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no usable rows" in err and "empty problem" in err
    assert not (out / "math500.parquet").exists()


def test_unknown_layout_lists_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "odd.jsonl", [{"query": "q", "label": "1"}])
    with pytest.raises(DataPrepError) as info:
        convert("aime24", str(path), tmp_path)
    assert "unknown layout" in str(info.value) and "['label', 'query']" in str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("broken.parquet", b"PAR1 definitely not parquet", "not a readable parquet file"),
        ("empty.jsonl", b"", "file is empty"),
        ("object.json", b'{\n  "data": [1, 2]\n}\n', "top-level JSON dict"),
        ("table.csv", b"problem,answer\n", "unsupported file type"),
    ],
)
def test_unusable_files_exit_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    assert cli_main(["aime24", "--input", str(path), "--output", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_input_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataPrepError, match="neither an existing file"):
        convert("aime24", str(tmp_path / "nope.jsonl"), tmp_path)


# ----------------------------------------------------------------------------- containers and CLI


def test_save_to_disk_folder_and_plain_folder(tmp_path: Path) -> None:
    import datasets

    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(4)]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    from_saved = read_output(convert("amc23", str(saved), tmp_path / "a").output)
    folder = tmp_path / "folder" / "data"
    folder.mkdir(parents=True)
    write_parquet(folder / "test-00000-of-00002.parquet", rows[:2])
    write_parquet(folder / "test-00001-of-00002.parquet", rows[2:])
    from_folder = read_output(convert("amc23", str(tmp_path / "folder"), tmp_path / "b").output)
    expected = [r["answer"] for r in rows]
    assert [rm["ground_truth"] for rm in from_saved["reward_model"]] == expected
    assert [rm["ground_truth"] for rm in from_folder["reward_model"]] == expected


def test_cli_prints_summary(tmp_path: Path, dapo_fixture) -> None:
    source, expected = dapo_fixture
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep",
            "dapo-math-17k",
            "--input",
            str(source),
            "--output",
            str(tmp_path / "o"),
            "--summary-json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rows_read"] == expected["read"]
    assert summary["rows_written"] == expected["written"]
    assert summary["dropped"][CONFLICT] == expected["conflict_rows"]


# ----------------------------------------------------------------------------- verl round trip


def tiny_tokenizer(texts: list[str]) -> Any:
    """A word-level tokenizer built from ``texts`` with a chat template: no hub access needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<user>", "<assistant>"]
    words: dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    splitter = pre_tokenizers.Whitespace()
    for text in texts:
        for word, _ in splitter.pre_tokenize_str(text):
            words.setdefault(word, len(words))
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = splitter
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    return tokenizer


@needs_eval_data
def test_round_trip_through_verl_rlhf_dataset(tmp_path: Path) -> None:
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    summary = convert("aime24", str(EVAL_DIR / "aime24.klear.jsonl"), tmp_path / "data")
    df = read_output(summary.output)
    tokenizer = tiny_tokenizer([p[0]["content"] for p in df["prompt"]])
    config = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": 4096,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 1,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    dataset = RLHFDataset(data_files=summary.output, tokenizer=tokenizer, config=config)
    assert len(dataset) == summary.rows_written
    item = dataset[3]
    assert item["raw_prompt"] == [{"role": "user", "content": df["prompt"][3][0]["content"]}]
    assert item["reward_model"]["ground_truth"] == df["reward_model"][3]["ground_truth"]
    assert item["data_source"] == "aime24"
    assert item["index"] == 3
    ids = tokenizer.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=True)
    assert tokenizer.unk_token_id not in ids  # the prompt text survived parquet unchanged
