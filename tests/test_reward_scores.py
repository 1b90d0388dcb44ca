"""Every experiment's reward scores (correct / wrong / unparseable / truncated), pinned.

The scores live in one place per paper, ``reward.custom_reward_function.reward_kwargs`` of
``configs/experiments/base/{atr,erc}.yaml`` (the quickstart overrides its own), and are listed in
docs/experiments.md ("Reward scores of every run"). This test composes each experiment config as
its launch script does, and scores real evaluation rows (``../shared/data/eval/``) with the
resolved keywords: ATR section 6.1 says +1 correct, 0 otherwise, on its DAPO-Math training rows too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO_ROOT.parent / "shared/data/eval"
AMC23 = EVAL_DIR / "amc23.qwen.jsonl"
AIME24 = EVAL_DIR / "aime24.klear.jsonl"

#: experiment -> (training data_source, {outcome: score}); the numbers of docs/experiments.md
ATR_SCORES = {"correct": 1.0, "wrong": 0.0, "unparseable": 0.0, "truncated": 0.0}
ERC_SCORES = {"correct": 1.0, "wrong": 0.0, "unparseable": 0.0, "truncated": -0.5}
EXPECTED = {
    "atr_grpo_qwen3_1.7b": ("math_dapo", ATR_SCORES),
    "atr_grpo_qwen3_8b": ("math_dapo", ATR_SCORES),
    **{
        name: ("math_longcot_math_verify", ERC_SCORES)
        for name in (
            "grpo_1.5b",
            "grpo_7b",
            "dapo_1.5b",
            "dapo_7b",
            "erc_dapo_1.5b",
            "erc_dapo_7b",
            "gppo_7b",
            "erc_gppo_7b",
            "erc_gspo_7b",
            "erc_sapo_7b",
        )
    },
    "quickstart_1gpu": ("math_dapo", {"correct": 1.0, "wrong": -1.0, "unparseable": -1.0, "truncated": -0.5}),
}


@pytest.fixture(scope="module")
def reward(request: pytest.FixtureRequest) -> Any:
    os.environ["VERL_DIVCLIP_REWARD_WORKERS"] = "2"
    import recipe.reward.score as module

    module.shutdown_pool()
    request.addfinalizer(module.shutdown_pool)
    request.addfinalizer(lambda: os.environ.pop("VERL_DIVCLIP_REWARD_WORKERS", None))
    return module


@pytest.fixture(scope="module")
def reward_kwargs() -> dict[str, dict[str, Any]]:
    """Each experiment's resolved ``reward_kwargs``, composed as ``recipe.main`` composes it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipe.main import CONFIG_DIR

    out = {}
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        for name in EXPECTED:
            config = compose(config_name="divclip_trainer", overrides=[f"+experiments={name}"])
            out[name] = OmegaConf.to_container(config.reward.custom_reward_function.reward_kwargs, resolve=True)
    return out


def test_every_experiment_is_pinned():
    configs = {p.stem for p in (REPO_ROOT / "configs" / "experiments").glob("*.yaml")}
    assert configs == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_run_states_all_four_scores(reward, reward_kwargs, name):
    source, want = EXPECTED[name]
    kwargs = reward_kwargs[name]
    # stated, not left to a default (the quickstart inherits ERC's and overrides two)
    assert {"correct_score", "wrong_score", "unparseable_score", "truncated_score"} <= set(kwargs), kwargs
    table = reward.score_table(source, **{k: v for k, v in kwargs.items() if k.endswith("_score")})
    assert table.as_dict() == want


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["atr_grpo_qwen3_1.7b", "quickstart_1gpu"])
def test_dapo_answer_rows_score_as_stated(reward, reward_kwargs, name):
    """Real AMC23 problems scored on the DAPO ``Answer:`` route, as DAPO-Math-17k rows are."""
    source, want = EXPECTED[name]
    kwargs = reward_kwargs[name]
    rows = _rows(AMC23)[:5]
    for row in rows:
        gold = row["answer"]  # upstream float, e.g. 27.0
        answer = str(int(gold))
        work = f"Step by step, {row['problem'][:60]} ...\n"
        right = reward.compute_score(source, work + f"Answer: {answer}", gold, **kwargs)
        wrong = reward.compute_score(source, work + f"Answer: {int(gold) + 1}", gold, **kwargs)
        none = reward.compute_score(source, work + "I could not finish", gold, **kwargs)
        assert (right["score"], right["acc"]) == (want["correct"], True), row["id"]
        assert (wrong["score"], wrong["acc"]) == (want["wrong"], False), row["id"]
        assert (none["score"], none["acc"]) == (want["unparseable"], False), row["id"]


def test_atr_doubles_nothing_dr_grpo_advantage(reward, reward_kwargs):
    """Dr.GRPO's advantage is r - mean(r) (no std): with 1/0 a group of one right and seven wrong
    answers gives the right one +7/8, where +-1 gave +14/8."""
    kwargs = reward_kwargs["atr_grpo_qwen3_1.7b"]
    gold = _rows(AMC23)[0]["answer"]
    scores = [
        reward.compute_score("math_dapo", f"Answer: {int(gold) + (i > 0)}", gold, **kwargs)["score"] for i in range(8)
    ]
    assert scores[0] - sum(scores) / 8 == pytest.approx(7 / 8)


def test_erc_think_rows_score_as_stated(reward, reward_kwargs):
    """Real AIME24 rows (KlearReasoner layout) on the think route of the ERC runs."""
    kwargs = reward_kwargs["erc_dapo_7b"]
    assert kwargs["think"] == "required"
    want = ERC_SCORES
    for row in _rows(AIME24)[:5]:
        gold = row["meta"]["solution"]
        source = "math_longcot_math_verify"
        right = reward.compute_score(source, f"<think>...</think>\nSo \\boxed{{{gold}}}", gold, **kwargs)
        wrong = reward.compute_score(source, f"<think>...</think>\nSo \\boxed{{{gold}1}}", gold, **kwargs)
        none = reward.compute_score(source, "<think>...</think>\nno idea", gold, **kwargs)
        cut = reward.compute_score(source, f"<think>long reasoning \\boxed{{{gold}}}", gold, **kwargs)
        assert [r["score"] for r in (right, wrong, none, cut)] == [
            want["correct"],
            want["wrong"],
            want["unparseable"],
            want["truncated"],
        ], gold


def test_docs_table_matches_the_configs():
    doc = (REPO_ROOT / "docs" / "experiments.md").read_text()
    section = doc[doc.index("### Reward scores of every run") :]
    for name, (_source, want) in EXPECTED.items():
        line = next((l for l in section.splitlines() if f"`{name}`" in l), None)
        assert line is not None, name
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        numbers = [float(c) for c in cells[-4:]]
        assert numbers == [want[o] for o in ("correct", "wrong", "unparseable", "truncated")], name


def test_bad_scores_are_configuration_errors(reward):
    with pytest.raises(ValueError, match="wrong_score"):
        reward.compute_score("math_dapo", "Answer: 1", "1", wrong_score="zero")
    with pytest.raises(ValueError, match="no_think_close_score"):
        reward.compute_score("aime24", "x", "1", truncated_score=0.0, no_think_close_score=-0.5)
    # the former name still works on its own
    assert reward.compute_score("aime24", "x", "1", think="required", no_think_close_score=-2.0)["score"] == -2.0
    assert re.search(r"truncated", reward.compute_score.__doc__)
