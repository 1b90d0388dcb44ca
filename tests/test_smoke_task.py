"""The synthetic smoke task (recipe/smoke/task.py): tokenizer, model, data, reward, verl loading."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from recipe.reward.score import compute_score  # noqa: E402
from recipe.smoke import task as smoke_task  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> smoke_task.SmokeAssets:
    return smoke_task.build_smoke_assets(tmp_path_factory.mktemp("smoke"), n_train=64, n_val=20)


def test_tokenizer_round_trip_and_chat_template() -> None:
    tok = smoke_task.build_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "4071"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n4071<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 12 and tok.decode(ids) == text
    answer = tok.encode(smoke_task.format_answer("7") + tok.eos_token, add_special_tokens=False)
    assert len(answer) == 2  # one answer token + EOS: a well-formed answer is one sample away
    assert tok.decode(answer, skip_special_tokens=True) == "\\boxed{7}"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None


def test_answers_and_reward_route() -> None:
    assert smoke_task.answer_for("echo", "777") == "7"
    with pytest.raises(ValueError):
        smoke_task.answer_for("echo", "771")
    assert smoke_task.answer_for("last_digit", "4071") == "1"
    assert smoke_task.answer_for("sum_mod10", "4071") == "2"
    with pytest.raises(ValueError):
        smoke_task.answer_for("nope", "1")
    with pytest.raises(ValueError):
        smoke_task.answer_for("last_digit", "12a")
    src = smoke_task.data_source_for("echo")
    assert compute_score(src, "\\boxed{3}", "1")["score"] == 0.0
    assert compute_score(src, "\\boxed{1}", "1")["score"] == 1.0
    assert compute_score(src, "\\boxed{3}user7\\boxed{1}9", "1")["score"] == 1.0  # the last box counts
    assert compute_score(src, "1", "1")["score"] == 0.0  # an unanchored digit does not


def test_data_is_verl_schema_and_disjoint(assets: smoke_task.SmokeAssets) -> None:
    import pandas as pd

    train, val = pd.read_parquet(assets.train_file), pd.read_parquet(assets.val_file)
    assert len(train) == 64 and len(val) == 20
    assert set(train.columns) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    row = train.iloc[0]
    problem = row["extra_info"]["problem"]
    assert row["data_source"] == "smoke_echo"
    assert list(row["prompt"]) == [{"role": "user", "content": problem}]
    assert row["reward_model"]["ground_truth"] == problem[0]
    train_problems = set(train["extra_info"].map(lambda e: e["problem"]))
    val_problems = set(val["extra_info"].map(lambda e: e["problem"]))
    assert not train_problems & val_problems
    assert {len(p) for p in train_problems} <= set(smoke_task.ECHO_TRAIN_LENGTHS)
    assert len(val_problems) == 20  # every digit at every held-out length


def test_harder_tasks_draw_distinct_prompts() -> None:
    rows = smoke_task.make_rows("last_digit", 50, split="train", seed=0)
    problems = [r["extra_info"]["problem"] for r in rows]
    assert len(set(problems)) == 50 and all(len(p) == 4 for p in problems)
    val = smoke_task.make_rows("sum_mod10", 10, split="test", seed=1, exclude=problems)
    assert not set(problems) & {r["extra_info"]["problem"] for r in val}
    assert all(r["reward_model"]["ground_truth"] == str(sum(map(int, r["extra_info"]["problem"])) % 10) for r in val)


def test_model_matches_tokenizer(assets: smoke_task.SmokeAssets) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(assets.model_path)
    tok = AutoTokenizer.from_pretrained(assets.model_path)
    assert config.model_type == "qwen3" and config.vocab_size == len(tok) == assets.vocab_size
    assert config.eos_token_id == tok.eos_token_id
    assert 50_000 < assets.num_parameters < 2_000_000


def test_loads_with_verl_rl_dataset(assets: smoke_task.SmokeAssets) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(assets.model_path)
    config = OmegaConf.create(
        {"max_prompt_length": 16, "filter_overlong_prompts": False, "truncation": "error", "return_raw_chat": True}
    )
    dataset = RLHFDataset(data_files=[assets.train_file], tokenizer=tok, config=config)
    assert len(dataset) == 64
    item = dataset[0]
    assert item["data_source"] == "smoke_echo" and item["raw_prompt"][0]["role"] == "user"
