"""recipe.eval: metric estimators, argument validation, the generate writer and the score CLI."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import pytest

from data_prep.__main__ import main as data_prep_main
from recipe.eval.cli import main as eval_main
from recipe.eval.generate import Sampler, check_model_path, plan_generation, run_generate
from recipe.eval.metrics import ProblemSamples, majority_vote, mean_at_k, pass_at_k, score_benchmark
from recipe.eval.presets import PRESETS, SamplingSpec, parse_k_list, resolve_sampling
from recipe.eval.problems import load_eval_parquet, reward_scorer
from recipe.eval.readers import load_runs
from recipe.eval.tables import render_tables, score_runs

FIXTURES = Path(__file__).parent / "fixtures"
DUMP_DIR = FIXTURES / "eval_verl_dump"


@pytest.fixture(scope="module")
def eval_parquets(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The fixture problems converted by data_prep itself, so the schema is the real one."""
    out = tmp_path_factory.mktemp("eval_data")
    for name in ("aime24", "math500"):
        source = FIXTURES / "eval_problems" / f"{name}.jsonl"
        assert data_prep_main([name, "--input", str(source), "--output", str(out)]) == 0
    return [out / "aime24.parquet", out / "math500.parquet"]


# ---------------------------------------------------------------- metrics


def test_pass_at_k_hand_cases() -> None:
    assert pass_at_k(8, 1, 8) == 1.0  # any 8 of 8 include the correct one
    assert pass_at_k(32, 4, 8) == pytest.approx(1 - comb(28, 8) / comb(32, 8), rel=1e-12)
    assert pass_at_k(32, 4, 8) == pytest.approx(0.7045050055617352, abs=1e-12)
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n


def test_pass_at_k_stable_where_binomials_overflow() -> None:
    # C(2000, 1000) ~ 1e600 overflows a float; the product form does not.
    exact = 1 - comb(1997, 1000) / comb(2000, 1000)  # Python ints are exact
    assert pass_at_k(2000, 3, 1000) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 1, 8), (1, 0, 2), (3, 4, 2), (5, 1, 0)])
def test_pass_at_k_rejects_bad_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_n_below_k_is_an_error_everywhere() -> None:
    with pytest.raises(ValueError, match="n >= k"):
        mean_at_k([True, False], 3)
    with pytest.raises(ValueError, match="n >= k"):
        majority_vote(["1", "2"], [True, False], 3)
    problems = [ProblemSamples("aime24:0", [True, False], ["1", "2"])]
    with pytest.raises(ValueError, match=r"aime24:0.*n=2.*k=4"):
        score_benchmark(problems, 4)


def test_mean_at_k_uses_the_first_k() -> None:
    assert mean_at_k([True, False, False, True], 4) == 0.5
    assert mean_at_k([True, False, False, True], 1) == 1.0
    assert mean_at_k([False, True, True, True], 2) == 0.5


def test_majority_vote_clusters_and_ties() -> None:
    # a wrong answer wins 2:1 even though one response is right
    assert majority_vote(["27", "27", "28", ""], [False, False, True, False], 4) is False
    # correct answers vote together although the strings differ (0.5 vs \frac{1}{2})
    assert majority_vote(["0.5", r"\frac{1}{2}", "3"], [True, True, False], 3) is True
    # wrong answers cluster after removing spacing: 2 vs 2, the earliest cluster wins
    preds = [r"\frac{1}{3}", "0.5", r"\frac {1}{3}", r"\frac{1}{2}"]
    assert majority_vote(preds, [False, True, False, True], 4) is False
    assert majority_vote(preds[1:] + preds[:1], [True, False, True, False], 4) is True
    # abstentions do not vote; all abstaining is wrong
    assert majority_vote(["", None, "5"], [False, False, True], 3) is True
    assert majority_vote(["", None], [False, False], 2) is False


# ---------------------------------------------------------------- presets and validation


def test_presets() -> None:
    aime = resolve_sampling("aime24", "erc")
    assert (aime.n, aime.temperature, aime.top_p, aime.max_tokens) == (32, 0.6, 0.95, 32768)
    math500 = resolve_sampling("math500", "erc")
    assert (math500.n, math500.max_tokens) == (4, 16384)
    atr = resolve_sampling("aime25", "atr", max_tokens=8192)
    assert (atr.n, atr.temperature, atr.top_p, atr.max_tokens) == (8, 0.3, 0.95, 8192)
    assert resolve_sampling("aime24", "erc", n=64).n == 64  # explicit flags override


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"benchmark": "aime24", "preset": "atr", "max_tokens": 0}, "max_tokens must be"),
        ({"benchmark": "gsm8k", "preset": "erc"}, "'gsm8k'.*no entry"),
        ({"benchmark": "aime24", "preset": None, "n": 4}, "--temperature"),
        ({"benchmark": "aime24", "preset": "erc", "temperature": -0.1}, "temperature must lie in"),
        ({"benchmark": "aime24", "preset": "erc", "temperature": 0.0}, "greedy"),
        ({"benchmark": "aime24", "preset": "erc", "top_p": 0.0}, "top_p must lie in"),
        ({"benchmark": "aime24", "preset": "erc", "top_p": 1.5}, "top_p must lie in"),
        ({"benchmark": "aime24", "preset": "erc", "n": 0}, "n must be an integer >= 1"),
        ({"benchmark": "aime24", "preset": "erc", "max_tokens": 0}, "max_tokens must be"),
        ({"benchmark": "aime24", "preset": "paper"}, "unknown --preset"),
    ],
)
def test_sampling_validation_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_sampling(**kwargs)


def test_parse_k_list() -> None:
    assert parse_k_list("1, 8,n,8") == [1, 8, "n"]
    for bad in ("0", "x", "1,,2", "-1"):
        with pytest.raises(ValueError, match="--k"):
            parse_k_list(bad)


def test_plan_generation_checks_k_against_n(eval_parquets: list[Path]) -> None:
    plans = plan_generation(eval_parquets, "erc", [1, 4])
    assert [(p.benchmark, p.sampling.n, len(p.problems)) for p in plans] == [("aime24", 32, 3), ("math500", 4, 2)]
    with pytest.raises(ValueError, match=r"'math500': k=8 needs n >= k.*n=4"):
        plan_generation(eval_parquets, "erc", [8])


def test_parquet_schema_errors_name_file_and_row(tmp_path: Path, eval_parquets: list[Path]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(ValueError, match="does not exist"):
        load_eval_parquet(tmp_path / "missing.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="junk.parquet: not a readable parquet"):
        load_eval_parquet(tmp_path / "junk.parquet")

    rows = pq.read_table(eval_parquets[0]).to_pylist()
    pq.write_table(
        pa.Table.from_pylist([{k: v for k, v in r.items() if k != "reward_model"} for r in rows]),
        tmp_path / "a.parquet",
    )
    with pytest.raises(ValueError, match=r"a.parquet: missing column\(s\) \['reward_model'\]"):
        load_eval_parquet(tmp_path / "a.parquet")

    bad = [dict(r) for r in rows]
    bad[2] = dict(bad[2], reward_model={"style": "rule", "ground_truth": ""})
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet row 2: 'reward_model.ground_truth'"):
        load_eval_parquet(tmp_path / "b.parquet")

    dup = [dict(r) for r in rows]
    dup[1] = dict(dup[1], extra_info=dict(dup[1]["extra_info"], index=dup[0]["extra_info"]["index"]))
    pq.write_table(pa.Table.from_pylist(dup), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"c.parquet row 1: duplicate 'extra_info.index'"):
        load_eval_parquet(tmp_path / "c.parquet")


# ---------------------------------------------------------------- generate with a fake sampler


class FakeSampler:
    """Answers every prompt with a fixed pattern: the first response right, the others wrong."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers
        self.calls: list[tuple[int, SamplingSpec]] = []

    def __call__(self, conversations: list[list[dict[str, str]]], spec: SamplingSpec) -> list[list[str]]:
        self.calls.append((len(conversations), spec))
        out = []
        for messages in conversations:
            gold = next(a for q, a in self.answers.items() if q in messages[-1]["content"])
            out.append([f"So \\boxed{{{gold}}}."] + ["\\boxed{999}"] * (spec.n - 1))
        return out


def _fixture_answers() -> dict[str, str]:
    answers = {}
    for name in ("aime24", "math500"):
        for line in (FIXTURES / "eval_problems" / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            answers[row["problem"]] = row["answer"]
    return answers


def test_generate_cli_with_injected_sampler(tmp_path: Path, eval_parquets: list[Path]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    sampler = FakeSampler(_fixture_answers())
    made: list[dict] = []

    def factory(**kwargs: object) -> Sampler:
        made.append(kwargs)
        return sampler

    out = tmp_path / "gen"
    argv = ["generate", "--model", str(model), "--data", *map(str, eval_parquets), "--output", str(out),
            "--preset", "atr", "--max-tokens", "4096", "--k", "1,8"]  # fmt: skip
    assert eval_main(argv, sampler_factory=factory) == 0
    assert made == [
        {
            "model": str(model),
            "tensor_parallel_size": 1,
            "seed": 0,
            "max_model_len": None,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    ]  # the atr preset: non-thinking Qwen3
    assert [c[1] for c in sampler.calls] == [SamplingSpec(8, 0.3, 0.95, 4096)] * 2

    rows = [json.loads(line) for line in (out / "aime24.jsonl").read_text().splitlines()]
    assert [r["problem_id"] for r in rows] == [0, 1, 2]
    first = rows[0]
    assert first["ground_truth"] == "73" and first["benchmark"] == "aime24" and len(first["responses"]) == 8
    assert first["acc"] == [True] + [False] * 7  # scored by recipe/reward/score.py
    assert first["scores"] == [1.0] + [0.0] * 7
    assert first["preds"][:2] == ["73", "999"]
    assert first["sampling"] == {"n": 8, "temperature": 0.3, "top_p": 0.95, "max_tokens": 4096}

    # refuses to overwrite before any sampler is built
    made.clear()
    assert eval_main(argv, sampler_factory=factory) == 2
    assert made == []

    # and the files score: 1 of 8 right everywhere
    scored = score_runs(load_runs([out]), [1, 8])
    for bench in ("aime24", "math500"):
        cell = scored["results"]["gen"][bench]
        assert (
            cell["mean@8"] == pytest.approx(1 / 8) and cell["pass@8"] == 1.0 and cell["pass@1"] == pytest.approx(1 / 8)
        )
        assert cell["maj@8"] == 0.0  # "999" outvotes the right answer 7:1


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--preset", "erc", "--k", "8"], "'math500': k=8 needs n >= k"),
        (
            ["--preset", "atr", "--chat-template-kwargs", "enable_thinking=false"],
            "--chat-template-kwargs must be a JSON object",
        ),
        (
            ["--preset", "atr", "--chat-template-kwargs", "[1]"],
            "--chat-template-kwargs must be a JSON object, got list",
        ),
        (["--preset", "erc", "--top-p", "1.2"], "top_p must lie in"),
        (["--preset", "erc", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    ],
)
def test_generate_cli_validation_before_any_sampler(
    tmp_path: Path, eval_parquets: list[Path], capsys: pytest.CaptureFixture[str], extra: list[str], match: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def factory(**kwargs: object) -> Sampler:
        raise AssertionError("the sampler must not be built when validation fails")

    argv = [
        "generate",
        "--model",
        str(model),
        "--data",
        *map(str, eval_parquets),
        "--output",
        str(tmp_path / "o"),
        *extra,
    ]
    assert eval_main(argv, sampler_factory=factory) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err, err


def test_generate_rejects_missing_paths_and_fsdp_checkpoints(tmp_path: Path, eval_parquets: list[Path]) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        check_model_path(tmp_path / "nope")
    ckpt = tmp_path / "global_step_10"
    (ckpt / "actor").mkdir(parents=True)
    with pytest.raises(ValueError, match="model_merger"):
        check_model_path(ckpt)
    with pytest.raises(ValueError, match="does not exist"):
        plan_generation([tmp_path / "none.parquet"], "erc")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        plan_generation([tmp_path / "empty"], "erc")


def test_sampler_returning_wrong_count_is_an_error(tmp_path: Path, eval_parquets: list[Path]) -> None:
    plans = plan_generation(eval_parquets[:1], "atr", max_tokens=16)
    with pytest.raises(RuntimeError, match="expected n=8"):
        run_generate(plans, lambda convs, spec: [["x"]] * len(convs), tmp_path, scorer=lambda *a: {})
    assert not (tmp_path / "aime24.jsonl").exists()


# ---------------------------------------------------------------- verl validation dumps


def test_fixture_is_verl_exact_format(tmp_path: Path) -> None:
    """Re-writing the fixture's rows with verl 0.9.1's own writer reproduces it byte for byte."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    for source in sorted(DUMP_DIR.glob("*.jsonl")):
        rows = [json.loads(line) for line in source.read_text().splitlines()]
        extras = {key: [r[key] for r in rows] for key in ("reward", "score", "acc", "pred")}
        RayPPOTrainer._write_generations(
            [r["input"] for r in rows], [r["output"] for r in rows], [r["gts"] for r in rows],
            [r["score"] for r in rows], extras, str(tmp_path), rows[0]["step"],
        )  # fmt: skip
        assert (tmp_path / source.name).read_bytes() == source.read_bytes()


#: Hand-computed from tests/fixtures/eval_verl_dump (4 responses per problem):
#: step 0 AIME24 c = 2, 1, 4 (votes: tie won by the right answer, "27" 2:1, unanimous);
#: MATH-500 c = 1, 2 (tie "5" first; tie "\frac{1}{3}" first, so wrong).
EXPECTED_STEP0 = {
    "aime24": {
        "mean@n": (2 + 1 + 4) / 12,
        "pass@n": 1.0,
        "maj@n": 2 / 3,
        "mean@1": 2 / 3,
        "pass@2": (5 / 6 + 1 / 2 + 1) / 3,
    },
    "math500": {"mean@n": 3 / 8, "pass@n": 1.0, "maj@n": 0.5, "mean@1": 0.5, "pass@2": (1 / 2 + 5 / 6) / 2},
}


def test_parse_verl_dump_groups_by_prompt(eval_parquets: list[Path]) -> None:
    runs = load_runs([DUMP_DIR / "0.jsonl"], data=eval_parquets)
    assert [label for label, _ in runs] == ["step 0"]
    checkpoint = runs[0][1]
    assert sorted(checkpoint) == ["aime24", "math500"]
    assert [p.correct for p in checkpoint["aime24"]] == [
        [True, False, False, True],
        [False, False, True, False],
        [True, True, True, True],
    ]
    assert checkpoint["math500"][1].preds == [r"\frac{1}{3}", "0.5", r"\frac {1}{3}", r"\frac{1}{2}"]


def test_verl_dump_needs_a_benchmark_mapping(tmp_path: Path, eval_parquets: list[Path]) -> None:
    with pytest.raises(ValueError, match="--data PARQUET... or --benchmark"):
        load_runs([DUMP_DIR])
    with pytest.raises(ValueError, match=r"0.jsonl line 1: the prompt matches no problem"):
        load_runs([DUMP_DIR], data=eval_parquets[1:])  # AIME prompts cannot be placed
    one = load_runs([DUMP_DIR / "0.jsonl"], benchmark="mixed")
    assert sum(len(p) for p in one[0][1].values()) == 5


def test_verl_dump_without_acc_is_rescored_with_our_reward(tmp_path: Path, eval_parquets: list[Path]) -> None:
    rows = [json.loads(line) for line in (DUMP_DIR / "0.jsonl").read_text().splitlines()]
    stripped = [{k: v for k, v in r.items() if k not in ("acc", "pred", "reward")} for r in rows[:4]]
    (tmp_path / "0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stripped))
    runs = load_runs([tmp_path], data=eval_parquets)
    [problem] = runs[0][1]["aime24"]
    assert problem.correct == [True, False, False, True]
    assert problem.preds == ["73", "12", "12", "73"]


def test_unknown_jsonl_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl line 1: neither a `generate` row"):
        load_runs([tmp_path / "x.jsonl"])
    (tmp_path / "y.jsonl").write_text('{"responses": ["a"]\n')
    with pytest.raises(ValueError, match=r"y.jsonl line 1: not valid JSON"):
        load_runs([tmp_path / "y.jsonl"])


def test_score_cli_end_to_end(tmp_path: Path, eval_parquets: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    out_md, out_json = tmp_path / "table.md", tmp_path / "scores.json"
    argv = ["score", str(DUMP_DIR), "--data", *map(str, eval_parquets), "--k", "1,2,n",
            "--output", str(out_md), "--json", str(out_json)]  # fmt: skip
    assert eval_main(argv) == 0
    scored = json.loads(out_json.read_text())
    assert scored["checkpoints"] == ["step 0", "step 10"]
    for bench, expected in EXPECTED_STEP0.items():
        for key, value in expected.items():
            assert scored["results"]["step 0"][bench][key] == pytest.approx(value), (bench, key)
    assert scored["results"]["step 10"]["aime24"]["maj@n"] == 1.0

    markdown = out_md.read_text()
    assert markdown.strip() == capsys.readouterr().out.strip()
    assert "### pass@4" in markdown and "### maj@4" in markdown
    assert "| checkpoint | AIME24 | MATH-500 | Avg |" in markdown
    # step 0 maj@4: AIME24 66.7, MATH-500 50.0, Avg 58.3; step 10 is best and final
    maj = markdown.split("### maj@4")[1]
    assert "| step 0 | 66.7 | 50.0 | 58.3 |" in maj
    assert "| final (best) | 100.0 (100.0) | 100.0 (100.0) | 100.0 (100.0) |" in maj

    # n < k on the command line is an error naming the benchmark
    assert eval_main(["score", str(DUMP_DIR), "--data", *map(str, eval_parquets), "--k", "8"]) == 2
    assert "k=8 exceeds n=4" in capsys.readouterr().err


def test_render_table_final_best_and_missing_cells() -> None:
    scored = {
        "checkpoints": ["a", "b"],
        "results": {
            "a": {"aime24": {"mean@1": 0.5, "k_of_1": 1}, "amc23": {"mean@1": 0.25, "k_of_1": 1}},
            "b": {"aime24": {"mean@1": 0.4, "k_of_1": 1}},
        },
    }
    table = render_tables({**scored}, [1]).split("### pass@1")[0]
    assert "| checkpoint | AIME24 | AMC23 | Avg |" in table
    assert "| a | 50.0 | 25.0 | 37.5 |" in table
    assert "| b | 40.0 | – | – |" in table  # no average over a partial row
    assert "| final (best) | 40.0 (50.0) | – (25.0) | – (37.5) |" in table


def test_verl_best_at_k_is_a_bootstrap_not_pass_at_k() -> None:
    """The docs' claim: verl's best@8 with 1 correct of 8 is ~1 - (7/8)^8, pass@8 is 1."""
    import numpy as np
    from verl.trainer.ppo.metric_utils import bootstrap_metric

    [(best_at_8, _)] = bootstrap_metric([1] + [0] * 7, 8, [np.max], n_bootstrap=1000, seed=42)
    assert best_at_8 == pytest.approx(1 - (7 / 8) ** 8, abs=0.03)
    assert pass_at_k(8, 1, 8) == 1.0


# ---------------------------------------------------------------- ERC section 4.1 protocol on the real benchmark files

EVAL_DIR = Path(__file__).resolve().parents[1].parent / "shared/data/eval"
REAL_ERC_FILES = {  # data_prep dataset -> file in ../shared/data/eval/, problem count
    "aime24": ("aime24.klear.jsonl", 30),
    "aime25": ("aime25.klear.jsonl", 30),
    "hmmt25": ("hmmt_feb_2025.klear.jsonl", 30),
    "amc23": ("amc23.qwen.jsonl", 40),
    "math500": ("math500.h4.jsonl", 500),
}
# ERC paper section 4.1: (n, max_tokens) per benchmark, T 0.6 / top-p 0.95 throughout
ERC_PROTOCOL = {
    "aime24": (32, 32768),
    "aime25": (32, 32768),
    "hmmt25": (32, 16384),
    "amc23": (32, 16384),
    "math500": (4, 16384),
    "olympiadbench": (4, 16384),
}


@pytest.fixture(scope="module")
def real_erc_parquets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The real benchmark rows (../shared/data/eval/) converted by data_prep."""
    if not EVAL_DIR.is_dir():
        pytest.fail(f"real eval data absent: {EVAL_DIR}")
    from data_prep.convert import convert

    out = tmp_path_factory.mktemp("erc_real")
    return {
        name: Path(convert(name, str(EVAL_DIR / filename), out).output)
        for name, (filename, _count) in REAL_ERC_FILES.items()
    }


def test_erc_preset_is_the_papers_section_4_1() -> None:
    for benchmark, (n, max_tokens) in ERC_PROTOCOL.items():
        spec = resolve_sampling(benchmark, "erc")
        assert (spec.n, spec.temperature, spec.top_p, spec.max_tokens) == (n, 0.6, 0.95, max_tokens), benchmark
    assert set(PRESETS["erc"]) == set(ERC_PROTOCOL)


def test_erc_preset_plans_the_real_benchmarks(real_erc_parquets: dict[str, Path]) -> None:
    plans = plan_generation(list(real_erc_parquets.values()), "erc", ["n", 4])
    by_name = {plan.benchmark: plan for plan in plans}
    assert set(by_name) == set(REAL_ERC_FILES)
    for name, plan in by_name.items():
        assert len(plan.problems) == REAL_ERC_FILES[name][1], name
        assert (plan.sampling.n, plan.sampling.max_tokens) == ERC_PROTOCOL[name], name
    # avg@32 is available on HMMT25 and AMC23, avg@4 only on MATH-500
    plan_generation([real_erc_parquets["hmmt25"], real_erc_parquets["amc23"]], "erc", [32])
    with pytest.raises(ValueError, match=r"'math500': k=32 needs n >= k.*n=4"):
        plan_generation([real_erc_parquets["math500"]], "erc", [32])


def test_erc_generate_writes_16k_rows_for_hmmt25_and_amc23(tmp_path: Path, real_erc_parquets: dict[str, Path]) -> None:
    """Real HMMT25 / AMC23 problems through run_generate: the sampler is asked for 32 x 16k, the
    rows record it, and our reward scores the gold answer right and a wrong one wrong."""
    import dataclasses

    plans = plan_generation([real_erc_parquets["hmmt25"], real_erc_parquets["amc23"]], "erc")
    plans = [dataclasses.replace(plan, problems=plan.problems[:3]) for plan in plans]
    seen: list[SamplingSpec] = []

    def sampler(conversations: list[list[dict[str, str]]], spec: SamplingSpec) -> list[list[str]]:
        seen.append(spec)
        gold = {p.messages[-1]["content"]: p.ground_truth for plan in plans for p in plan.problems}
        return [
            [f"</think> so \\boxed{{{gold[m[-1]['content']]}}}"] + ["</think> \\boxed{-12345}"] * (spec.n - 1)
            for m in conversations
        ]

    written = run_generate(plans, sampler, tmp_path / "gen", scorer=reward_scorer(think="required"))
    assert seen == [SamplingSpec(32, 0.6, 0.95, 16384)] * 2
    for path in written:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 3
        for row in rows:
            assert row["sampling"] == {"n": 32, "temperature": 0.6, "top_p": 0.95, "max_tokens": 16384}
            assert row["acc"] == [True] + [False] * 31, (path.name, row["ground_truth"], row["preds"][:1])
    scored = score_runs(load_runs([tmp_path / "gen"]), ["n"])
    for bench in ("hmmt25", "amc23"):
        cell = scored["results"]["gen"][bench]
        assert (cell["k_of_n"], cell["mean@n"]) == (32, pytest.approx(1 / 32))  # avg@32
