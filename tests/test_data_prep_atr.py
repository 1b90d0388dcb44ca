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
    for row, truth in zip(rows, out["reward_model"]):
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
