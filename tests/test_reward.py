"""recipe/reward/score.py: semantics by data source, MATH-500 self-consistency, hang-proofing."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO_ROOT.parent / "shared/data/eval"
MATH500 = EVAL_DIR / "math500.h4.jsonl"
needs_math500 = pytest.mark.skipif(not MATH500.is_file(), reason=f"real eval data absent: {MATH500}")

ADVERSARIAL_TIMEOUT_S = 1.0
POWER_TOWER = r"\dfrac{5^{\left(5^{\left(5^{\left(5^5\right)}\right)} - 4\right)} - 5}{16}"


@pytest.fixture(scope="module")
def reward(request: pytest.FixtureRequest) -> Any:
    """recipe.reward.score with a pool of 3 workers, shut down afterwards.

    Spare workers are what keep a call's wall time within timeout + 1 s while a killed
    worker is being replaced; with fewer ready workers than concurrent callers a call also
    waits for a free worker, which no per-item timeout can bound (see docs).
    """
    os.environ["VERL_DIVCLIP_REWARD_WORKERS"] = "3"
    import recipe.reward.score as module

    module.shutdown_pool()
    request.addfinalizer(module.shutdown_pool)
    request.addfinalizer(lambda: os.environ.pop("VERL_DIVCLIP_REWARD_WORKERS", None))
    module.compute_score("math500", r"\boxed{x^2}", "x^{2}")  # warm the pool outside timed checks
    return module


# ----------------------------------------------------------------------------- semantics


def test_return_shape(reward: Any) -> None:
    result = reward.compute_score("math500", r"so $x=\boxed{\frac{1}{2}}$", "0.5")
    assert set(result) == {"score", "acc", "pred"}
    assert (result["score"], result["acc"], result["pred"]) == (1.0, True, r"\frac{1}{2}")
    assert isinstance(result["score"], float)


@pytest.mark.parametrize(
    ("response", "correct"),
    [
        ("I tried 34 cases and none worked, so the answer is \\boxed{35}.", False),
        ("I tried 34 cases.", False),  # no anchored answer at all
        ("Checked 34 cases.\nAnswer: 34", True),
        ("**Final Answer:** $34$.", True),
        ("We may check our answer: 34 works.", False),  # "answer:" mid-sentence is prose
        ("\\boxed{34}", True),
        ("first \\boxed{12}, then corrected: \\boxed{34}", True),  # the last box counts
        ("\\boxed{34} ... \\boxed{3", True),  # a truncated, unbalanced box is skipped
        ("\\fbox{34}", True),
    ],
)
def test_extraction_is_anchored(reward: Any, response: str, correct: bool) -> None:
    assert reward.compute_score("aime24", response, "34")["acc"] is correct


def test_dapo_route_scores_plus_minus_one(reward: Any) -> None:
    right = reward.compute_score("math_dapo", "work...\nAnswer: 34", "34")
    wrong = reward.compute_score("math_dapo", "work...\nAnswer: 35", "34")
    assert (right["score"], right["acc"]) == (1.0, True)
    assert (wrong["score"], wrong["acc"]) == (-1.0, False)
    assert reward.compute_score("math_dapo", None, "34")["score"] == -1.0


def test_think_semantics(reward: Any) -> None:
    source = "math_longcot_math_verify"
    # Only the text after the last </think> is scored.
    assert reward.compute_score(source, "<think>maybe \\boxed{35}</think> so \\boxed{34}", "34")["acc"]
    assert not reward.compute_score(source, "<think>\\boxed{34}</think> so \\boxed{35}", "34")["acc"]
    # No closing tag: the penalty, even when a box is present.
    unclosed = reward.compute_score(source, "<think>long reasoning \\boxed{34}", "34")
    assert (unclosed["score"], unclosed["acc"]) == (-0.5, False)
    # A chat template that already opened <think> in the prompt: no opening tag is needed.
    assert reward.compute_score(source, "reasoning...</think>\n\\boxed{34}", "34")["score"] == 1.0
    assert reward.compute_score(source, "reasoning...</think>\n\\boxed{33}", "34")["score"] == 0.0
    # think="required" turns this on for any source (eval sets of a think model) ...
    assert reward.compute_score("aime24", "\\boxed{34}", "34", think="required")["score"] == -0.5
    # ... the penalty is configurable, and think="off" scores the whole text.
    assert reward.compute_score(source, "\\boxed{34}", "34", no_think_close_score=-2.0)["score"] == -2.0
    assert reward.compute_score(source, "\\boxed{34}", "34", think="off")["score"] == 1.0


def test_configuration_errors_raise(reward: Any) -> None:
    with pytest.raises(TypeError, match="timout_s"):
        reward.compute_score("aime24", "\\boxed{1}", "1", timout_s=3)
    with pytest.raises(ValueError, match="think"):
        reward.compute_score("aime24", "\\boxed{1}", "1", think="yes")
    # Keywords verl's reward managers inject on their own are accepted.
    result = reward.compute_score("aime24", "\\boxed{1}", "1", reward_router_address=None, reward_model_tokenizer=None)
    assert result["acc"]


def test_loaded_by_path_like_verl_and_async(reward: Any) -> None:
    """verl loads custom_reward_function.path under a private module name; calls still work,
    including the coroutine form from an event loop."""
    from verl.utils.import_utils import load_extern_object

    by_path = load_extern_object(str(REPO_ROOT / "recipe/reward/score.py"), "compute_score")
    assert by_path("aime24", "\\boxed{\\frac{2}{4}}", "1/2")["acc"]
    async_fn = load_extern_object(str(REPO_ROOT / "recipe/reward/score.py"), "compute_score_async")

    async def many() -> list[dict[str, Any]]:
        return await asyncio.gather(*(async_fn("aime24", f"\\boxed{{{i}/2}}", str(i / 2)) for i in range(8)))

    assert all(r["acc"] for r in asyncio.run(many()))


# ----------------------------------------------------------------------------- MATH-500


@pytest.fixture(scope="module")
def math500_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in MATH500.read_text(encoding="utf-8").splitlines() if line.strip()]


@needs_math500
def test_math500_solutions_score_correct_against_their_answers(reward: Any, math500_rows: list[dict[str, Any]]) -> None:
    misses = []
    for i, row in enumerate(math500_rows):
        result = reward.compute_score("math500", row["solution"], row["answer"])
        if not result["acc"]:
            misses.append((i, row["answer"], result["pred"]))
    rate = 1 - len(misses) / len(math500_rows)
    print(f"MATH-500 self-consistency: {rate:.2%} ({len(math500_rows) - len(misses)}/{len(math500_rows)})")
    assert misses == []


@needs_math500
def test_math500_shifted_pairing_scores_wrong(reward: Any, math500_rows: list[dict[str, Any]]) -> None:
    """Solution i against answer i+1 is wrong, except where the two gold answers are themselves
    equal (math-verify says so directly, in-process: these are short, known-safe answers)."""
    from math_verify import parse, verify

    n = len(math500_rows)
    false_positives, equal_golds = [], 0
    for i, row in enumerate(math500_rows):
        other = math500_rows[(i + 1) % n]["answer"]
        if verify(parse("\\boxed{" + row["answer"] + "}"), parse("\\boxed{" + other + "}")):
            equal_golds += 1
            continue
        if reward.compute_score("math500", row["solution"], other)["acc"]:
            false_positives.append((i, row["answer"], other))
    print(f"shifted pairs: {n - equal_golds} checked, {equal_golds} skipped as equal answers")
    assert equal_golds < 10  # the check above really compared answers, it did not skip everything
    assert false_positives == []


# ----------------------------------------------------------------------------- hang-proofing


def adversarial_corpus() -> list[tuple[str, Any, Any]]:
    """(label, solution_str, ground_truth) items built to break parsers: >= 200 of them."""
    rng = random.Random(1234)
    items: list[tuple[str, Any, Any]] = []
    towers = [
        POWER_TOWER,
        r"5^{5^{5^{5^{5}}}}",
        r"9^{9^{9^{9}}}",
        r"2^{2^{2^{2^{2^{2}}}}}",
        r"10^{10^{10^{10}}} - 1",
        r"\left(7^{7^{7^{7}}}\right)!",
        r"3\uparrow\uparrow 5",
        r"{{{{2}^{100}}^{100}}^{100}}^{100}",
    ]
    for tower in towers:
        items.append(("tower-pred", f"so \\boxed{{{tower}}}", "3"))
        items.append(("tower-gold", "\\boxed{3}", tower))
        items.append(("tower-both", f"\\boxed{{{tower}}}", tower + "+1"))
    for n in (1000, 10**5, 10**9, 10**18, 10**100):
        items.append(("factorial", f"\\boxed{{{n}!}}", "5"))
        items.append(("factorial-gold", "\\boxed{5}", f"{n}!"))
    items.append(("factorial-nested", "\\boxed{((10^{10})!)!}", "1"))
    for depth in (50, 100, 200, 300):
        nested = "1"
        for _ in range(depth):
            nested = f"\\frac{{1}}{{1+{nested}}}"
        items.append((f"frac-{depth}", f"\\boxed{{{nested}}}", "1/2"))
        items.append((f"frac-gold-{depth}", "\\boxed{1/2}", nested))
        items.append((f"sqrt-{depth}", "\\boxed{" + "\\sqrt{" * depth + "2" + "}" * depth + "}", "2"))
        items.append((f"parens-{depth}", "\\boxed{" + "(" * depth + "1" + ")" * depth + "}", "1"))
    for k in range(40):
        opens = rng.randint(1, 60)
        closes = rng.randint(0, 60)
        body = "".join(
            rng.choice(["{", "}", "\\frac", "x", "^", "_", "\\left(", "\\right)", "1"])
            for _ in range(rng.randint(1, 80))
        )
        items.append(("unbalanced", "\\boxed" + "{" * opens + body + "}" * closes, "1"))
        items.append(("unbalanced-gold", "\\boxed{1}", "{" * opens + body + "}" * closes))
    megabyte = 1024 * 1024
    items.append(("1MB-digits", "7" * megabyte, "7"))
    items.append(("1MB-boxed-end", "x " * (megabyte // 2) + "\\boxed{7}", "7"))
    items.append(("1MB-boxes", "\\boxed{1}" * (megabyte // 9), "1"))
    items.append(("1MB-braces", "\\boxed{" + "{" * megabyte, "1"))
    items.append(("1MB-answer-lines", "Answer: 3\n" * (megabyte // 10), "3"))
    items.append(("1MB-think", "<think>" + "a" * megabyte + "</think>\\boxed{2}", "2"))
    items.append(("1MB-gold", "\\boxed{1}", "1" * megabyte))
    items.append(("1MB-in-box", "\\boxed{" + "9" * megabyte + "}", "9"))
    for k in range(40):
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4000))).decode("latin-1")
        items.append(("binary", junk, "1"))
        items.append(("binary-boxed", f"\\boxed{{{junk[:200]}}}", "1"))
    for solution, gold in [
        ("", "1"),
        ("\\boxed{1}", ""),
        ("", ""),
        ("\\boxed{}", "1"),
        ("\\boxed{1}", None),
        (None, "1"),
        (None, None),
        (12, "12"),
        ("\\boxed{12}", 12),
        ("\\boxed{12}", 12.0),
        (["\\boxed{1}"], "1"),
        ("\\boxed{1}", ["1"]),
        ("\\boxed{1}", {"a": 1}),
        ("\\boxed{1}", float("nan")),
        ("\\boxed{1}", True),
        ("\x00\x00\\boxed{\x00}", "\x00"),
        ("\\boxed{\\undefinedmacro{1}}", "1"),
        ("$$$$$$", "$"),
        ("\\boxed{1/0}", "1/0"),
        ("\\boxed{\\infty - \\infty}", "0"),
        ("\\boxed{0^0}", "1"),
        ("\\boxed{\\lim_{x\\to 0} \\frac{\\sin x}{x}}", "1"),
        ("\\boxed{\\int_0^\\infty e^{-x^{100}} dx}", "1"),
        ("\\boxed{x = y = z = }", "1"),
        ("\\boxed{\\begin{matrix} 1 & 2 \\\\ 3 & 4 \\end{matrix}}", "1"),
    ]:
        items.append(("degenerate", solution, gold))
    return items


@pytest.fixture(scope="module")
def adversarial_results(reward: Any) -> list[tuple[str, float, Any]]:
    """Score the corpus one call at a time (from a worker thread, as verl's reward loop calls
    us) and keep the wall time of each call. Concurrency is covered by the async test."""
    corpus = adversarial_corpus()

    def timed(item: tuple[str, Any, Any]) -> tuple[str, float, Any]:
        label, solution, gold = item
        start = time.monotonic()
        try:
            outcome: Any = reward.compute_score("aime24", solution, gold, timeout_s=ADVERSARIAL_TIMEOUT_S)
        except Exception as exc:  # recorded, asserted on below
            outcome = exc
        return label, time.monotonic() - start, outcome

    with ThreadPoolExecutor(max_workers=1) as pool:
        return list(pool.map(timed, corpus))


def test_adversarial_corpus_is_large(adversarial_results: list[tuple[str, float, Any]]) -> None:
    assert len(adversarial_results) >= 200


def test_adversarial_corpus_raises_nothing_and_scores_wrong_or_right(
    adversarial_results: list[tuple[str, float, Any]],
) -> None:
    raised = [(label, repr(outcome)) for label, _, outcome in adversarial_results if isinstance(outcome, Exception)]
    assert raised == []
    for label, _, outcome in adversarial_results:
        assert set(outcome) == {"score", "acc", "pred"}, label
        assert outcome["score"] in (0.0, 1.0), label
    by_label = {label: outcome for label, _, outcome in adversarial_results}
    assert by_label["1MB-boxed-end"]["acc"] and by_label["1MB-think"]["acc"]  # tails are still read
    assert not by_label["tower-pred"]["acc"]  # a hang scores as wrong


def test_adversarial_items_return_within_timeout_plus_one_second(
    reward: Any, adversarial_results: list[tuple[str, float, Any]]
) -> None:
    """A call that hangs returns within the timeout plus one second plus what the machine's load adds to any call:
    the slowest of five trivial calls made now (milliseconds on an idle machine; under two suites on 2 cores the
    kill-and-replace path was seen taking 2.16-2.27 s against a bound of 2 s without it)."""

    def trivial() -> float:
        start = time.monotonic()
        reward.compute_score("aime24", r"\boxed{7}", "7", timeout_s=ADVERSARIAL_TIMEOUT_S)
        return time.monotonic() - start

    load = max(trivial() for _ in range(5))
    bound = ADVERSARIAL_TIMEOUT_S + 1.0 + load
    slow = [(label, round(elapsed, 2)) for label, elapsed, _ in adversarial_results if elapsed > bound]
    timeouts = reward.reward_stats()["timeouts"]
    print(
        f"adversarial: {len(adversarial_results)} items, {timeouts} hard timeouts, slowest "
        f"{max(e for _, e, _ in adversarial_results):.2f}s, bound {bound:.2f}s"
    )
    assert slow == []
    assert timeouts >= 1  # the power tower really did hang and was killed


def worker_pids(pool: Any) -> list[int]:
    """Pids of all the pool's workers, ready or starting."""
    with pool._lock:
        return [w.pid for w in pool._all]


def test_killed_worker_is_replaced(reward: Any) -> None:
    pool = reward.get_pool()
    before = set(worker_pids(pool))
    replaced = reward.reward_stats()["workers_replaced"]
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGKILL)
    # Every worker is exercised; the dead one is detected and replaced, and no call fails.
    for i in range(3 * pool.size):
        assert reward.compute_score("aime24", f"\\boxed{{{i} + 1/2}}", f"{2 * i + 1}/2")["acc"]
    deadline = time.monotonic() + 30
    while victim in worker_pids(pool) and time.monotonic() < deadline:
        reward.compute_score("aime24", "\\boxed{1/3}", "2/6")
    assert victim not in worker_pids(pool)
    assert len(worker_pids(pool)) == pool.size
    assert reward.reward_stats()["workers_replaced"] > replaced


# ----------------------------------------------------------------------------- ERC reward profiles


def _erc_reward_kwargs(*overrides: str) -> dict[str, Any]:
    """reward_kwargs of the ERC-DAPO 7B config as recipe.main composes it (paper text or a profile)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipe.main import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="divclip_trainer", overrides=["+experiments=erc_dapo_7b", *overrides])
    return OmegaConf.to_container(config.reward.custom_reward_function.reward_kwargs, resolve=True)


@pytest.fixture(scope="module")
def real_benchmark_rows(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    """(data_source, ground_truth) of the real AIME24 / HMMT25 / AMC23 rows, converted by data_prep."""
    import pandas as pd

    from data_prep.convert import convert

    if not EVAL_DIR.is_dir():
        pytest.fail(f"real eval data absent: {EVAL_DIR}")
    out = tmp_path_factory.mktemp("erc_reward")
    rows = []
    for dataset, filename in (
        ("aime24", "aime24.klear.jsonl"),
        ("hmmt25", "hmmt_feb_2025.klear.jsonl"),
        ("amc23", "amc23.qwen.jsonl"),
    ):
        frame = pd.read_parquet(convert(dataset, str(EVAL_DIR / filename), out).output)
        rows += [
            (source, reward_model["ground_truth"])
            for source, reward_model in zip(frame["data_source"], frame["reward_model"], strict=False)
        ]
    assert len(rows) == 100
    return rows


@pytest.mark.parametrize(
    ("profile", "want"),
    [
        ((), {"right": 1.0, "wrong": 0.0, "no_think": -0.5}),  # paper text (documented choice)
        (("+profile=released",), {"right": 1.0, "wrong": -1.0, "no_think": -0.5}),  # released scripts
    ],
)
def test_erc_profiles_reward_values_on_real_rows(
    reward: Any, real_benchmark_rows: list[tuple[str, str]], profile: tuple[str, ...], want: dict[str, float]
) -> None:
    kwargs = _erc_reward_kwargs(*profile)
    assert kwargs["think"] == "required"
    for source, gold in real_benchmark_rows:
        responses = {
            "right": f"<think>Let me work it out.</think>\nThe answer is $\\boxed{{{gold}}}$.",
            "wrong": "<think>Let me work it out.</think>\nThe answer is $\\boxed{-12345}$.",
            "no_think": f"<think>Let me work it out, the answer is \\boxed{{{gold}}} maybe",  # truncated at 16k
        }
        got = {name: reward.compute_score(source, text, gold, **kwargs)["score"] for name, text in responses.items()}
        assert got == want, (source, gold, got)
