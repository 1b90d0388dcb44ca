"""Offline evaluation: sample a checkpoint on the eval sets, then score mean@k / pass@k / maj@k.

Two subcommands (``python -m recipe.eval {generate,score} ...``, see docs/evaluation.md):

* ``generate`` samples ``n`` responses per problem with vLLM for every evaluation parquet
  (written by ``python -m data_prep``) using the benchmark's sampling preset (the ERC or the
  ATR paper's settings), scores each response with our reward (``recipe/reward.py``) and writes
  one JSONL per benchmark. Every argument (paths, parquet schema, n >= k, temperature and
  top-p ranges, preset coverage) is validated *before* vLLM is imported, so a typo costs a
  second on a login node instead of a GPU allocation. The sampler is a seam: ``run_generate``
  takes any callable with the :data:`Sampler` signature; the CLI passes :func:`vllm_sampler`.
* ``score`` reads those JSONL files or verl's validation dumps
  (``trainer.validation_data_dir``: ``<step>.jsonl`` with input/output/gts/score/step and the
  reward's extra keys acc/pred) and prints a Markdown table per metric, one row per
  checkpoint, plus a "final (best)" row when several checkpoints are given.

Metric definitions (per problem, then averaged over problems, then an unweighted average over
benchmarks in the "Avg" column):

* mean@k: accuracy of the first k responses (mean@n uses all of them).
* pass@k: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), from all n
  responses of which c are correct; needs n >= k. Computed as a product, never as binomials.
* maj@k: majority vote over the first k responses' extracted answers (see :func:`majority_vote`
  for the clustering and the tie rule).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


def _check_counts(n: int, k: int, c: int | None = None) -> None:
    for name, value in (("n", n), ("k", k)) + ((("c", c),) if c is not None else ()):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got k={k}")
    if n < k:
        raise ValueError(f"pass@k/mean@k/maj@k need n >= k responses, got n={n} < k={k}")
    if c is not None and not 0 <= c <= n:
        raise ValueError(f"c (correct responses) must lie in [0, n={n}], got c={c}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k).

    C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), a product of c factors in (0, 1],
    which stays accurate where the binomials themselves overflow a float (n = 1024, k = 512).
    """
    _check_counts(n, k, c)
    if n - c < k:  # every k-subset contains a correct response
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_at_k(correct: Sequence[bool], k: int) -> float:
    """Accuracy of the first k responses (mean@n: all of them)."""
    _check_counts(len(correct), k)
    return sum(bool(x) for x in correct[:k]) / k


_VOTE_SPACE = re.compile(r"\s+")


def vote_key(pred: str) -> str:
    """Answer text as compared for voting: spacing, \\left/\\right, \\dfrac and a final dot ignored."""
    from recipe.reward import cosmetic_normal_form

    return _VOTE_SPACE.sub("", cosmetic_normal_form(pred))


def majority_vote(preds: Sequence[str | None], correct: Sequence[bool], k: int) -> bool:
    """Whether the majority answer of the first k responses is correct (maj@k for one problem).

    Clustering: every response the reward judged correct is equivalent to the gold answer, so
    all correct responses form one cluster (``1/2`` and ``0.5`` vote together). Incorrect
    answers cluster by :func:`vote_key`. Responses without an extracted answer (empty or
    missing ``pred``) abstain; if all k abstain the vote is wrong.

    Ties: among clusters with the highest count, the one whose first member appears earliest
    among the k responses wins. Sampling order is random, so this is an unbiased coin between
    tied clusters, yet reproducible for a given file.
    """
    _check_counts(len(correct), k)
    if len(preds) != len(correct):
        raise ValueError(f"majority_vote: {len(preds)} preds but {len(correct)} correctness flags")
    counts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for position, (pred, ok) in enumerate(zip(preds[:k], correct[:k])):
        if ok:
            key = "\x00correct"
        elif pred:
            key = vote_key(pred)
            if not key:
                continue
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
        first_seen.setdefault(key, position)
    if not counts:
        return False
    winner = min(counts, key=lambda key: (-counts[key], first_seen[key]))
    return winner == "\x00correct"


# --------------------------------------------------------------------------------------
# Benchmarks and sampling presets
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings of one benchmark; ``max_tokens`` None means "the preset has none"."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int | None


#: Canonical benchmark names are data_prep's dataset names (its ``data_source`` column).
BENCHMARK_ALIASES = {
    "aime24": "aime24",
    "aime_2024": "aime24",
    "aime25": "aime25",
    "aime_2025": "aime25",
    "hmmt25": "hmmt25",
    "hmmt_feb_2025": "hmmt25",
    "hmmt-202502": "hmmt25",
    "amc23": "amc23",
    "aimo_amc": "aimo_amc",
    "aimo-amc": "aimo_amc",
    "aimo-validation-amc": "aimo_amc",
    "math500": "math500",
    "math-500": "math500",
    "olympiadbench": "olympiadbench",
    "olympiad": "olympiadbench",
}

#: Display names and column order of the tables (ERC Table 1 order), unknown sets go last.
DISPLAY_NAMES = {
    "aime24": "AIME24",
    "aime25": "AIME25",
    "hmmt25": "HMMT25",
    "math500": "MATH-500",
    "amc23": "AMC23",
    "olympiadbench": "OlympiadBench",
    "aimo_amc": "AMC22+23",
}

# ERC paper section 4.1: avg@32 with 32k tokens on AIME24/AIME25, avg@32 with 16k on HMMT25 and
# AMC23, avg@4 with 16k on MATH-500 and OlympiadBench; T 0.6, top-p 0.95 throughout.
_ERC_AIME = SamplingSpec(n=32, temperature=0.6, top_p=0.95, max_tokens=32768)
_ERC_32_AT_16K = SamplingSpec(n=32, temperature=0.6, top_p=0.95, max_tokens=16384)
_ERC_SHORT = SamplingSpec(n=4, temperature=0.6, top_p=0.95, max_tokens=16384)
# ATR paper, Table 4: 8 samples at T 0.3, top-p 0.95, at most 32,768 new tokens (Mean@8 / Pass@8).
_ATR = SamplingSpec(n=8, temperature=0.3, top_p=0.95, max_tokens=32768)

PRESETS: dict[str, dict[str, SamplingSpec]] = {
    "erc": {
        "aime24": _ERC_AIME,
        "aime25": _ERC_AIME,
        "hmmt25": _ERC_32_AT_16K,
        "amc23": _ERC_32_AT_16K,
        "math500": _ERC_SHORT,
        "olympiadbench": _ERC_SHORT,
    },
    "atr": {name: _ATR for name in DISPLAY_NAMES},
}

#: Chat-template keywords of a preset, passed to vLLM's ``LLM.chat(chat_template_kwargs=...)``:
#: a checkpoint is evaluated in the mode it was trained in. The ATR runs train Qwen3 in
#: non-thinking mode (``data.apply_chat_template_kwargs.enable_thinking=false``).
PRESET_CHAT_TEMPLATE_KWARGS: dict[str, dict[str, Any]] = {
    "erc": {},
    "atr": {"enable_thinking": False},
}


def resolve_chat_template_kwargs(preset: str | None, given: str | None) -> dict[str, Any]:
    """``--chat-template-kwargs`` (a JSON object) if given, else the preset's; ValueError names the flag."""
    if given is None:
        return dict(PRESET_CHAT_TEMPLATE_KWARGS.get(preset or "", {}))
    try:
        value = json.loads(given)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--chat-template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}': {exc.msg}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object, got {type(value).__name__}: {given!r}")
    return value


def canonical_benchmark(name: str) -> str:
    """data_prep name for a benchmark alias; unknown names are kept (lower-cased)."""
    return BENCHMARK_ALIASES.get(name.lower(), name.lower())


def display_name(benchmark: str) -> str:
    return DISPLAY_NAMES.get(benchmark, benchmark)


def _benchmark_order(names: Iterable[str]) -> list[str]:
    known = list(DISPLAY_NAMES)
    return sorted(set(names), key=lambda b: (known.index(b) if b in known else len(known), b))


def resolve_sampling(
    benchmark: str,
    preset: str | None,
    n: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
) -> SamplingSpec:
    """Preset settings for ``benchmark`` with explicit overrides, validated.

    Raises ValueError naming the benchmark and the setting when a value is out of range or
    when neither the preset nor the command line gives it.
    """
    base: SamplingSpec | None = None
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown --preset {preset!r}; known: {sorted(PRESETS)} (or omit it and give all settings)")
        base = PRESETS[preset].get(benchmark)
    chosen = {
        "n": n if n is not None else (base.n if base else None),
        "temperature": temperature if temperature is not None else (base.temperature if base else None),
        "top_p": top_p if top_p is not None else (base.top_p if base else None),
        "max_tokens": max_tokens if max_tokens is not None else (base.max_tokens if base else None),
    }
    missing = [key for key, value in chosen.items() if value is None]
    if missing:
        where = f"preset {preset!r} has no entry for it" if base is None and preset else f"preset {preset!r}"
        flags = ", ".join("--" + key.replace("_", "-") for key in missing)
        raise ValueError(f"benchmark {benchmark!r}: no {'/'.join(missing)} ({where}); pass {flags}")
    spec = SamplingSpec(**chosen)  # type: ignore[arg-type]
    _validate_sampling(benchmark, spec)
    return spec


def _validate_sampling(benchmark: str, spec: SamplingSpec) -> None:
    where = f"benchmark {benchmark!r}"
    if isinstance(spec.n, bool) or not isinstance(spec.n, int) or spec.n < 1:
        raise ValueError(f"{where}: n must be an integer >= 1, got {spec.n!r}")
    if not (isinstance(spec.temperature, int | float) and math.isfinite(spec.temperature)) or not (
        0.0 <= spec.temperature <= 2.0
    ):
        raise ValueError(f"{where}: temperature must lie in [0, 2], got {spec.temperature!r}")
    if spec.temperature == 0.0 and spec.n > 1:
        raise ValueError(f"{where}: temperature 0 (greedy) with n={spec.n} gives n identical responses")
    if not (isinstance(spec.top_p, int | float) and math.isfinite(spec.top_p)) or not (0.0 < spec.top_p <= 1.0):
        raise ValueError(f"{where}: top_p must lie in (0, 1], got {spec.top_p!r}")
    mt = spec.max_tokens
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {mt!r}")


def parse_k_list(text: str) -> list[int | str]:
    """``"1,8,n"`` -> ``[1, 8, "n"]``; ``n`` stands for each benchmark's own sample count."""
    values: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        if part == "n":
            values.append("n")
        elif part.isdigit() and int(part) >= 1:
            values.append(int(part))
        else:
            raise ValueError(f"--k: {part!r} is neither a positive integer nor 'n' (in {text!r})")
    if not values:
        raise ValueError("--k is empty")
    return list(dict.fromkeys(values))


# --------------------------------------------------------------------------------------
# Evaluation parquets
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One row of an evaluation parquet (verl RL schema, as written by data_prep)."""

    problem_id: int
    benchmark: str
    data_source: str
    messages: list[dict[str, str]]
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)


REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model", "extra_info")


def load_eval_parquet(path: str | os.PathLike[str]) -> tuple[str, list[Problem]]:
    """Read and validate an evaluation parquet; returns (benchmark, problems).

    The benchmark is the (single) ``data_source`` of the file. Every row must have a non-empty
    chat ``prompt`` of role/content strings, a string ``reward_model.ground_truth`` and an
    integer ``extra_info.index`` unique in the file; the first bad row raises ValueError naming
    the file, the row and the key.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"evaluation parquet {str(path)!r} does not exist")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {table.column_names} (write it with data_prep)")
    if table.num_rows == 0:
        raise ValueError(f"{path}: no rows")
    rows = table.select(list(REQUIRED_COLUMNS)).to_pylist()
    sources = {row["data_source"] for row in rows}
    if len(sources) != 1 or not all(isinstance(s, str) and s for s in sources):
        raise ValueError(f"{path}: expected one non-empty data_source per evaluation file, got {sorted(map(str, sources))}")
    benchmark = canonical_benchmark(next(iter(sources)))
    problems: list[Problem] = []
    seen: set[int] = set()
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        prompt = row["prompt"]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {prompt!r:.80}")
        for message in prompt:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(f"{where}: 'prompt' messages need string 'role' and 'content', got {message!r:.80}")
        reward_model = row["reward_model"]
        gt = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        if not isinstance(gt, str) or not gt.strip():
            raise ValueError(f"{where}: 'reward_model.ground_truth' must be a non-empty string, got {gt!r}")
        extra = row["extra_info"] if isinstance(row["extra_info"], dict) else None
        index = extra.get("index") if extra else None
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{where}: 'extra_info.index' must be an integer, got {index!r}")
        if index in seen:
            raise ValueError(f"{where}: duplicate 'extra_info.index' {index}")
        seen.add(index)
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        problems.append(Problem(index, benchmark, row["data_source"], messages, gt, extra or {}))
    return benchmark, problems


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------

#: The sampler seam: (conversations, sampling) -> one list of ``sampling.n`` texts per
#: conversation, in input order. :func:`vllm_sampler` builds the real one.
Sampler = Callable[[list[list[dict[str, str]]], SamplingSpec], list[list[str]]]


@dataclass(frozen=True)
class BenchmarkPlan:
    benchmark: str
    parquet: Path
    problems: list[Problem]
    sampling: SamplingSpec


def expand_files(entry: str | os.PathLike[str], pattern: str, what: str) -> list[Path]:
    """A file as itself, a folder as its sorted ``pattern`` files; missing or empty is an error."""
    path = Path(entry)
    if path.is_dir():
        found = sorted(path.glob(pattern))
        if not found:
            raise ValueError(f"{what} folder {str(path)!r} holds no {pattern}")
        return found
    if path.is_file():
        return [path]
    raise ValueError(f"{what} {str(path)!r} does not exist")


def plan_generation(
    data: Sequence[str | os.PathLike[str]],
    preset: str | None,
    k_values: Sequence[int | str] = ("n",),
    n: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
) -> list[BenchmarkPlan]:
    """Validate everything ``generate`` needs, without touching a GPU.

    ``data`` holds parquet files or folders of them. Raises ValueError on the first problem.
    """
    files = [file for entry in data for file in expand_files(entry, "*.parquet", "--data")]
    if not files:
        raise ValueError("no evaluation parquet given (--data)")
    plans: list[BenchmarkPlan] = []
    seen: dict[str, Path] = {}
    for file in files:
        benchmark, problems = load_eval_parquet(file)
        if benchmark in seen:
            raise ValueError(f"benchmark {benchmark!r} appears in both {seen[benchmark]} and {file}")
        seen[benchmark] = file
        spec = resolve_sampling(benchmark, preset, n, temperature, top_p, max_tokens)
        for k in k_values:
            if k != "n" and int(k) > spec.n:
                raise ValueError(f"benchmark {benchmark!r}: k={k} needs n >= k samples, but n={spec.n}")
        plans.append(BenchmarkPlan(benchmark, file, problems, spec))
    return plans


def check_model_path(model: str | os.PathLike[str]) -> Path:
    """A Hugging Face model folder (config.json); a raw verl FSDP checkpoint is rejected with a hint."""
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"--model {str(path)!r} is not a folder")
    if not (path / "config.json").is_file():
        hint = ""
        if any(path.glob("model_world_size_*")) or (path / "actor").is_dir():
            hint = (
                " It looks like a verl FSDP checkpoint: merge it first with "
                "`python -m verl.model_merger merge --backend fsdp --local_dir <ckpt>/actor --target_dir <hf_dir>`."
            )
        raise ValueError(f"--model {str(path)!r} has no config.json (not a Hugging Face model folder).{hint}")
    return path


def vllm_sampler(
    model: str,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    max_model_len: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Sampler:
    """The real sampler: one vLLM engine, chat-templated prompts, ``n`` samples per prompt.

    ``chat_template_kwargs`` reach the model's chat template through vLLM's
    ``LLM.chat(chat_template_kwargs=...)`` (Qwen3: ``{"enable_thinking": False}`` ends the prompt
    with an empty ``<think></think>`` block, the mode the ATR runs train in).

    vLLM is imported here, not at module level, so everything else in this module (argument
    validation, scoring, tests) works on machines without a GPU or vLLM.
    """
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        raise RuntimeError("`generate` needs vLLM (and a GPU); install the project's GPU extras") from exc

    llm = LLM(model=model, tensor_parallel_size=tensor_parallel_size, seed=seed, max_model_len=max_model_len)

    def sample(conversations: list[list[dict[str, str]]], spec: SamplingSpec) -> list[list[str]]:
        params = SamplingParams(
            n=spec.n, temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens, seed=seed
        )
        outputs = llm.chat(conversations, params, use_tqdm=True, chat_template_kwargs=dict(chat_template_kwargs or {}))
        return [[completion.text for completion in request.outputs] for request in outputs]

    return sample


Scorer = Callable[[str, str, str, dict[str, Any]], dict[str, Any]]


def reward_scorer(think: str = "auto") -> Scorer:
    """Our training reward (recipe/reward.py), so offline and in-training accuracy agree."""
    from recipe.reward import compute_score

    def score(data_source: str, response: str, ground_truth: str, extra_info: dict[str, Any]) -> dict[str, Any]:
        return compute_score(data_source, response, ground_truth, extra_info, think=think)

    return score


def refuse_existing_outputs(targets: Sequence[Path]) -> None:
    existing = [str(t) for t in targets if t.exists()]
    if existing:
        raise ValueError(f"output file(s) exist: {existing}; pass --overwrite to replace them")


def run_generate(
    plans: Sequence[BenchmarkPlan],
    sampler: Sampler,
    output_dir: str | os.PathLike[str],
    scorer: Scorer | None = None,
    model: str = "",
    overwrite: bool = False,
) -> list[Path]:
    """Sample, score and write ``<output_dir>/<benchmark>.jsonl`` for every plan.

    One row per problem: problem_id, benchmark, data_source, ground_truth, prompt, responses,
    scores, acc, preds, sampling, model. Files are written to a temporary name and renamed, so
    an interrupted run leaves no half-written benchmark file behind.
    """
    scorer = scorer or reward_scorer()
    out = Path(output_dir)
    targets = [out / f"{plan.benchmark}.jsonl" for plan in plans]
    if not overwrite:
        refuse_existing_outputs(targets)
    out.mkdir(parents=True, exist_ok=True)
    for plan, target in zip(plans, targets):
        conversations = [p.messages for p in plan.problems]
        samples = sampler(conversations, plan.sampling)
        if len(samples) != len(conversations):
            raise RuntimeError(f"{plan.benchmark}: sampler returned {len(samples)} results for {len(conversations)} prompts")
        tmp = target.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for problem, responses in zip(plan.problems, samples):
                if len(responses) != plan.sampling.n:
                    raise RuntimeError(
                        f"{plan.benchmark} problem {problem.problem_id}: sampler returned "
                        f"{len(responses)} responses, expected n={plan.sampling.n}"
                    )
                results = [scorer(problem.data_source, r, problem.ground_truth, problem.extra_info) for r in responses]
                row = {
                    "problem_id": problem.problem_id,
                    "benchmark": plan.benchmark,
                    "data_source": problem.data_source,
                    "ground_truth": problem.ground_truth,
                    "prompt": problem.messages,
                    "responses": list(responses),
                    "scores": [float(r["score"]) for r in results],
                    "acc": [bool(r["acc"]) for r in results],
                    "preds": [str(r.get("pred", "")) for r in results],
                    "sampling": asdict(plan.sampling),
                    "model": model,
                }
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, target)
    return targets


# --------------------------------------------------------------------------------------
# score: reading generate files and verl validation dumps
# --------------------------------------------------------------------------------------


@dataclass
class ProblemSamples:
    """All responses to one problem, reduced to what the metrics need."""

    key: str
    correct: list[bool]
    preds: list[str | None]


#: benchmark -> problems, for one checkpoint
Checkpoint = dict[str, list[ProblemSamples]]

_DUMP_KEYS = ("input", "output", "gts", "score", "step")


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; bad JSON or a non-object names the line."""
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = [row for _, row in iter_jsonl(path)]
    if not rows:
        raise ValueError(f"{path}: empty file")
    return rows


def file_kind(path: Path, rows: list[dict[str, Any]]) -> str:
    """``"generate"`` (our rows), ``"verl"`` (validation dump rows) or ValueError."""
    first = rows[0]
    if "responses" in first:
        return "generate"
    if all(key in first for key in _DUMP_KEYS):
        return "verl"
    raise ValueError(
        f"{path} line 1: neither a `generate` row (needs 'responses') nor a verl validation dump row "
        f"(needs {list(_DUMP_KEYS)}); keys found: {sorted(first)}"
    )


def _rescore(scorer: Scorer, data_source: str, response: Any, ground_truth: Any) -> tuple[bool, str]:
    result = scorer(data_source, "" if response is None else str(response), ground_truth, {})
    return bool(result["acc"]), str(result.get("pred", ""))


def parse_generate_rows(path: Path, rows: list[dict[str, Any]], scorer: Callable[[], Scorer]) -> Checkpoint:
    """Rows written by ``generate``; responses without ``acc``/``preds`` are scored with our reward."""
    out: Checkpoint = {}
    for lineno, row in enumerate(rows, 1):
        where = f"{path} line {lineno}"
        for key in ("problem_id", "benchmark", "ground_truth", "responses"):
            if key not in row:
                raise ValueError(f"{where}: missing key {key!r}")
        responses = row["responses"]
        if not isinstance(responses, list) or not responses:
            raise ValueError(f"{where}: 'responses' must be a non-empty list")
        benchmark = canonical_benchmark(str(row["benchmark"]))
        if isinstance(row.get("acc"), list) and isinstance(row.get("preds"), list):
            correct, preds = [bool(x) for x in row["acc"]], list(row["preds"])
            if not len(correct) == len(preds) == len(responses):
                raise ValueError(f"{where}: 'acc', 'preds' and 'responses' differ in length")
        else:
            data_source = str(row.get("data_source", benchmark))
            pairs = [_rescore(scorer(), data_source, r, row["ground_truth"]) for r in responses]
            correct, preds = [p[0] for p in pairs], [p[1] for p in pairs]
        out.setdefault(benchmark, []).append(ProblemSamples(f"{benchmark}:{row['problem_id']}", correct, preds))
    return out


_WS = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _WS.sub(" ", text).strip()


class PromptIndex:
    """Maps a verl dump's decoded ``input`` back to (benchmark, data_source) via the eval parquets.

    verl's dump carries no data_source, only the chat-templated prompt decoded without special
    tokens. A problem matches when its last user message (whitespace collapsed) is contained
    in the input and its ground truth equals the row's ``gts``.
    """

    def __init__(self, parquets: Sequence[str | os.PathLike[str]]):
        self.by_truth: dict[str, list[tuple[str, str, str]]] = {}
        for parquet in parquets:
            benchmark, problems = load_eval_parquet(parquet)
            for p in problems:
                content = _squash(p.messages[-1]["content"])
                self.by_truth.setdefault(_squash(p.ground_truth), []).append((content, benchmark, p.data_source))

    def lookup(self, prompt: str, ground_truth: Any, where: str) -> tuple[str, str]:
        text = _squash(prompt)
        hits = {
            (benchmark, source)
            for content, benchmark, source in self.by_truth.get(_squash(str(ground_truth)), [])
            if content in text
        }
        if len(hits) != 1:
            what = "no problem" if not hits else f"problems of several benchmarks {sorted(hits)}"
            raise ValueError(
                f"{where}: the prompt matches {what} of the --data parquets with ground truth {ground_truth!r}; "
                "pass the parquets the run validated on, or --benchmark NAME for a single-benchmark dump"
            )
        return next(iter(hits))


def parse_verl_dump(
    path: Path,
    rows: list[dict[str, Any]],
    scorer: Callable[[], Scorer],
    index: PromptIndex | None,
    benchmark: str | None,
) -> tuple[int, Checkpoint]:
    """One ``<step>.jsonl`` from ``trainer.validation_data_dir``; returns (step, checkpoint).

    Responses are grouped per problem by the ``uid`` verl's v1 trainer adds (``<uid>_<i>_<turn>``;
    for multi-turn sessions only the last turn counts), else by the decoded ``input`` (the
    classic trainer repeats each prompt n times). Correctness is the reward's ``acc`` when the
    dump has it, else the response is re-scored with our reward.
    """
    if index is None and benchmark is None:
        raise ValueError(f"{path}: a verl validation dump has no data_source; pass --data PARQUET... or --benchmark NAME")
    steps = {row.get("step") for row in rows}
    if len(steps) != 1 or not isinstance(next(iter(steps)), int):
        raise ValueError(f"{path}: expected one integer 'step' in a validation dump, got {sorted(map(str, steps))}")
    sessions: dict[str, tuple[int, dict[str, Any]]] = {}
    for lineno, row in enumerate(rows, 1):
        missing = [k for k in _DUMP_KEYS if k not in row]
        if missing:
            raise ValueError(f"{path} line {lineno}: missing key(s) {missing}")
        uid = row.get("uid")
        parts = str(uid).rsplit("_", 2) if uid is not None else []
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            problem_key, session = parts[0], f"{parts[0]}_{parts[1]}"
        else:
            problem_key = str(row["input"]) if uid is None else str(uid)
            session = f"{problem_key}\x00{lineno}"
        # later turns of a session replace earlier ones (dump is sorted by turn)
        sessions[session] = (lineno, row | {"_problem": problem_key})
    grouped: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for lineno, row in sessions.values():
        grouped.setdefault(row["_problem"], []).append((lineno, row))
    out: Checkpoint = {}
    for problem_key, members in grouped.items():
        lineno, first = members[0]
        where = f"{path} line {lineno}"
        if benchmark is not None:
            bench, data_source = canonical_benchmark(benchmark), benchmark
        else:
            assert index is not None
            bench, data_source = index.lookup(str(first["input"]), first["gts"], where)
        correct: list[bool] = []
        preds: list[str | None] = []
        for _, row in sorted(members, key=lambda m: m[0]):
            if "acc" in row and row["acc"] is not None:
                correct.append(bool(row["acc"]))
                preds.append(None if row.get("pred") is None else str(row["pred"]))
            else:
                ok, pred = _rescore(scorer(), data_source, row["output"], row["gts"])
                correct.append(ok)
                preds.append(pred)
        out.setdefault(bench, []).append(ProblemSamples(problem_key, correct, preds))
    return next(iter(steps)), out


def load_runs(
    paths: Sequence[str | os.PathLike[str]],
    data: Sequence[str | os.PathLike[str]] = (),
    benchmark: str | None = None,
    think: str = "auto",
) -> list[tuple[str, Checkpoint]]:
    """(label, checkpoint) for every path, in order.

    A ``generate`` output folder (or one of its files) is one checkpoint labelled by the
    folder name. A verl validation dump file is one checkpoint ("step N"); a
    ``validation_data_dir`` folder gives one checkpoint per step file, in step order.
    """
    cached: list[Scorer] = []

    def scorer() -> Scorer:
        if not cached:
            cached.append(reward_scorer(think))
        return cached[0]

    index = PromptIndex(data) if data else None
    runs: list[tuple[str, Checkpoint]] = []
    for entry in paths:
        path = Path(entry)
        files = expand_files(path, "*.jsonl", "run")
        loaded = [(f, _read_jsonl(f)) for f in files]
        kinds = {f: file_kind(f, rows) for f, rows in loaded}
        if len(set(kinds.values())) != 1:
            raise ValueError(f"{path}: mixes `generate` files and verl validation dumps: {sorted(map(str, kinds))}")
        if next(iter(kinds.values())) == "generate":
            checkpoint: Checkpoint = {}
            for f, rows in loaded:
                for bench, problems in parse_generate_rows(f, rows, scorer).items():
                    if bench in checkpoint:
                        raise ValueError(f"{f}: benchmark {bench!r} appears in more than one file of {path}")
                    checkpoint[bench] = problems
            runs.append((path.stem if path.is_file() else path.name, checkpoint))
        else:
            steps = sorted((parse_verl_dump(f, rows, scorer, index, benchmark) for f, rows in loaded), key=lambda s: s[0])
            runs.extend((f"step {step}", checkpoint) for step, checkpoint in steps)
    return runs


# --------------------------------------------------------------------------------------
# score: metrics and tables
# --------------------------------------------------------------------------------------

METRICS = ("mean", "pass", "maj")


def score_benchmark(problems: Sequence[ProblemSamples], k: int) -> dict[str, float]:
    """mean@k, pass@k and maj@k (fractions) averaged over the benchmark's problems."""
    if not problems:
        raise ValueError("no problems to score")
    totals = dict.fromkeys(METRICS, 0.0)
    for p in problems:
        n = len(p.correct)
        if n < k:
            raise ValueError(f"problem {p.key}: n={n} responses < k={k}; pass@k needs n >= k")
        totals["mean"] += mean_at_k(p.correct, k)
        totals["pass"] += pass_at_k(n, sum(p.correct), k)
        totals["maj"] += float(majority_vote(p.preds, p.correct, k))
    return {metric: value / len(problems) for metric, value in totals.items()}


def resolve_k(k: int | str, problems: Sequence[ProblemSamples], benchmark: str) -> int:
    n_min = min(len(p.correct) for p in problems)
    if k == "n":
        return n_min
    if int(k) > n_min:
        short = next(p.key for p in problems if len(p.correct) < int(k))
        raise ValueError(f"benchmark {benchmark!r}: k={k} exceeds n={n_min} (problem {short}); pass@k needs n >= k")
    return int(k)


def score_runs(runs: Sequence[tuple[str, Checkpoint]], k_values: Sequence[int | str]) -> dict[str, Any]:
    """{"checkpoints": [label...], "results": {label: {benchmark: {"<metric>@<k>": value, "n": n}}}}."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for label, checkpoint in runs:
        if label in results:
            raise ValueError(f"checkpoint label {label!r} given twice; use --labels to name them")
        results[label] = {}
        for bench, problems in checkpoint.items():
            cell: dict[str, float] = {"n": min(len(p.correct) for p in problems), "problems": len(problems)}
            for k in k_values:
                kk = resolve_k(k, problems, bench)
                for metric, value in score_benchmark(problems, kk).items():
                    cell[f"{metric}@{k}"] = value
                    cell[f"k_of_{k}"] = kk
            results[label][bench] = cell
    return {"checkpoints": [label for label, _ in runs], "results": results}


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{100.0 * value:.1f}"


def render_tables(scored: dict[str, Any], k_values: Sequence[int | str]) -> str:
    """Markdown: one table per metric and k, checkpoints as rows, benchmarks + Avg as columns.

    Values are percentages. Avg is the unweighted mean over the benchmarks present for that
    checkpoint (ERC Table 1 / ATR Table 2 style). With several checkpoints a last row
    "final (best)" gives the last checkpoint's value with the best over all in parentheses.
    """
    labels: list[str] = scored["checkpoints"]
    results = scored["results"]
    benchmarks = _benchmark_order(b for label in labels for b in results[label])
    lines: list[str] = []
    for metric in METRICS:
        for k in k_values:
            key = f"{metric}@{k}"
            ks = {results[lab][b][f"k_of_{k}"] for lab in labels for b in results[lab]}
            k_text = str(next(iter(ks))) if len(ks) == 1 else "n"
            header = [f"{display_name(b)}" + (f" (@{_k_of(results, labels, b, k)})" if k_text == "n" else "") for b in benchmarks]
            lines.append(f"### {metric}@{k_text}" + (" (k = each benchmark's n)" if k_text == "n" and k == "n" else ""))
            lines.append("")
            lines.append("| checkpoint | " + " | ".join(header) + " | Avg |")
            lines.append("|---" * (len(benchmarks) + 2) + "|")
            table: dict[str, list[float | None]] = {}
            for label in labels:
                row = [results[label].get(b, {}).get(key) for b in benchmarks]
                present = [v for v in row if v is not None]
                row.append(sum(present) / len(present) if len(present) == len(benchmarks) else None)
                table[label] = row
                lines.append(f"| {label} | " + " | ".join(_fmt(v) for v in row) + " |")
            if len(labels) > 1:
                final = table[labels[-1]]
                cells = []
                for col in range(len(benchmarks) + 1):
                    column = [table[lab][col] for lab in labels if table[lab][col] is not None]
                    best = max(column) if column else None
                    cells.append(f"{_fmt(final[col])} ({_fmt(best)})")
                lines.append("| final (best) | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def _k_of(results: dict[str, Any], labels: Sequence[str], benchmark: str, k: int | str) -> str:
    values = sorted({results[lab][benchmark][f"k_of_{k}"] for lab in labels if benchmark in results[lab]})
    return "/".join(str(int(v)) for v in values)


# --------------------------------------------------------------------------------------
# score --aggregate: several runs (seeds) of one row -> mean +- std (ATR Table 3)
# --------------------------------------------------------------------------------------

_SEED_SUFFIX = re.compile(r"[_-]seed\d+$")


def row_label(path: str | os.PathLike[str]) -> str:
    """A run's row: its folder or file name without a ``_seed<S>`` suffix (the sweep's naming)."""
    stem = Path(path).stem if Path(path).is_file() else Path(path).name
    return _SEED_SUFFIX.sub("", stem)


def _avg(cells: dict[str, dict[str, float]], key: str, benchmarks: Sequence[str]) -> float | None:
    values = [cells[b][key] for b in benchmarks if b in cells and key in cells[b]]
    return sum(values) / len(values) if values and len(values) == len(benchmarks) else None


def aggregate_runs(
    rows: Sequence[tuple[str, Sequence[Sequence[tuple[str, Checkpoint]]]]], k_values: Sequence[int | str]
) -> dict[str, Any]:
    """mean and std over the runs of each row, for the final and the best checkpoint of each run.

    ``rows``: (row label, runs), each run the checkpoints of one training run in step order (a
    ``generate`` folder is one checkpoint; a verl ``validation_data_dir`` one per step). A run's
    *final* value is its last checkpoint's; its *best* value, per metric@k, that of the checkpoint
    with the highest benchmark average (ATR Table 2 reports both). The std is the sample standard
    deviation over runs (n - 1 in the denominator; 0 for a single run). Every run of a row must
    cover the same benchmarks. Returns ``{"rows": [...], "results": {row: {"runs": r, "final"|"best":
    {"<metric>@<k>": {benchmark|"avg": {"mean", "std", "values"}}}}}}``.
    """
    results: dict[str, Any] = {}
    for label, runs in rows:
        if label in results:
            raise ValueError(f"row {label!r} given twice")
        if not runs:
            raise ValueError(f"row {label!r} has no runs")
        scored_runs = [score_runs(list(run), k_values) for run in runs]
        benchmarks = sorted({b for sr in scored_runs for cp in sr["results"].values() for b in cp})
        for i, sr in enumerate(scored_runs):
            for cp_label, cells in sr["results"].items():
                missing = [b for b in benchmarks if b not in cells]
                if missing:
                    raise ValueError(
                        f"row {label!r}: run {i + 1} checkpoint {cp_label!r} lacks {missing}; every run of a row "
                        "must be scored on the same benchmarks"
                    )
        keys = [f"{metric}@{k}" for metric in METRICS for k in k_values]
        row: dict[str, Any] = {"runs": len(runs), "benchmarks": benchmarks, "final": {}, "best": {}}
        for key in keys:
            for which in ("final", "best"):
                picked: list[dict[str, dict[str, float]]] = []
                for sr in scored_runs:
                    labels = sr["checkpoints"]
                    if which == "final":
                        picked.append(sr["results"][labels[-1]])
                    else:
                        picked.append(max((sr["results"][lab] for lab in labels),
                                          key=lambda cells: _avg(cells, key, benchmarks) or 0.0))
                cell: dict[str, dict[str, Any]] = {}
                for column in [*benchmarks, "avg"]:
                    values = [(_avg(c, key, benchmarks) if column == "avg" else c[column][key]) for c in picked]
                    mean = sum(values) / len(values)
                    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
                    cell[column] = {"mean": mean, "std": std, "values": values}
                row[which][key] = cell
        results[label] = row
    return {"rows": [label for label, _ in rows], "results": results}


def render_aggregate(aggregated: dict[str, Any], k_values: Sequence[int | str]) -> str:
    """Markdown: per metric@k, a "final" and a "best" table of mean ± std (percent) per row."""
    labels = aggregated["rows"]
    results = aggregated["results"]
    benchmarks = _benchmark_order(b for lab in labels for b in results[lab]["benchmarks"])
    lines: list[str] = []
    for metric in METRICS:
        for k in k_values:
            key = f"{metric}@{k}"
            for which in ("final", "best"):
                lines.append(f"### {key}, {which} checkpoint (mean ± std over runs)")
                lines.append("")
                lines.append("| row | runs | " + " | ".join(display_name(b) for b in benchmarks) + " | Avg |")
                lines.append("|---" * (len(benchmarks) + 3) + "|")
                for lab in labels:
                    cell = results[lab][which][key]
                    texts = []
                    for column in [*benchmarks, "avg"]:
                        value = cell.get(column)
                        texts.append("–" if value is None else f"{100 * value['mean']:.1f} ± {100 * value['std']:.1f}")
                    lines.append(f"| {lab} | {results[lab]['runs']} | " + " | ".join(texts) + " |")
                lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.eval", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="sample and score n responses per problem (vLLM, GPU)")
    gen.add_argument("--model", required=True, help="Hugging Face model folder (merge verl checkpoints first)")
    gen.add_argument("--data", nargs="+", required=True, help="evaluation parquets or folders of them (data_prep)")
    gen.add_argument("--output", required=True, help="folder for <benchmark>.jsonl")
    gen.add_argument("--preset", choices=sorted(PRESETS), help="sampling settings of the ERC or ATR paper")
    gen.add_argument("--n", type=int, help="samples per problem (overrides the preset)")
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--max-tokens", type=int, help="generation length (overrides the preset)")
    gen.add_argument("--chat-template-kwargs", help="JSON object for the chat template (default: the preset's; "
                     "atr: {\"enable_thinking\": false})")
    gen.add_argument("--k", default="n", help="k-values you will score, checked against n (e.g. 1,8,32)")
    gen.add_argument("--think", default="auto", choices=("auto", "required", "off"), help="reward think mode")
    gen.add_argument("--tensor-parallel-size", type=int, default=1)
    gen.add_argument("--max-model-len", type=int)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--overwrite", action="store_true")

    sc = sub.add_parser("score", help="mean@k / pass@k / maj@k tables from generate files or verl dumps")
    sc.add_argument("runs", nargs="+", help="generate output folders/files or verl validation dumps (file or folder)")
    sc.add_argument("--k", default="n", help="comma list of k-values; 'n' = each benchmark's sample count")
    sc.add_argument("--data", nargs="*", default=[], help="eval parquets to map verl dump prompts to benchmarks")
    sc.add_argument("--benchmark", help="benchmark name for a single-benchmark verl dump (instead of --data)")
    sc.add_argument("--labels", help="comma list of row labels, one per checkpoint (with --aggregate: one per run)")
    sc.add_argument("--aggregate", action="store_true",
                    help="each path is one run (e.g. one seed); runs with the same label (default: the folder name "
                         "without _seed<S>) form one row, reported as mean ± std over runs for the final and best "
                         "checkpoint (ATR Table 3)")
    sc.add_argument("--think", default="auto", choices=("auto", "required", "off"), help="reward think mode for re-scoring")
    sc.add_argument("--output", help="also write the Markdown here")
    sc.add_argument("--json", help="write all numbers as JSON here")
    return parser


def main(argv: Sequence[str] | None = None, sampler_factory: Callable[..., Sampler] | None = None) -> int:
    """CLI entry; returns the exit status (2 on bad input, with the reason on stderr).

    ``sampler_factory`` replaces :func:`vllm_sampler` (same keyword arguments); tests use it to
    run the whole ``generate`` path without a GPU.
    """
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate_cli(args, sampler_factory or vllm_sampler)
        return _score_cli(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _generate_cli(args: argparse.Namespace, sampler_factory: Callable[..., Sampler]) -> int:
    model = check_model_path(args.model)
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    k_values = parse_k_list(args.k)
    plans = plan_generation(args.data, args.preset, k_values, args.n, args.temperature, args.top_p, args.max_tokens)
    out = Path(args.output)
    if not args.overwrite:  # checked here too, before the sampler takes a GPU
        refuse_existing_outputs([out / f"{p.benchmark}.jsonl" for p in plans])
    for plan in plans:
        s = plan.sampling
        print(f"{plan.benchmark}: {len(plan.problems)} problems, n={s.n}, T={s.temperature}, top_p={s.top_p}, max_tokens={s.max_tokens}")
    chat_kwargs = resolve_chat_template_kwargs(args.preset, args.chat_template_kwargs)
    print(f"chat_template_kwargs: {json.dumps(chat_kwargs)}")
    sampler = sampler_factory(
        model=str(model), tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, max_model_len=args.max_model_len,
        chat_template_kwargs=chat_kwargs,
    )
    written = run_generate(plans, sampler, out, reward_scorer(args.think), model=str(model), overwrite=args.overwrite)
    for path in written:
        print(f"wrote {path}")
    return 0


def _score_cli(args: argparse.Namespace) -> int:
    k_values = parse_k_list(args.k)
    if args.aggregate:
        return _aggregate_cli(args, k_values)
    runs = load_runs(args.runs, args.data, args.benchmark, args.think)
    if args.labels:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(runs):
            raise ValueError(f"--labels has {len(labels)} names for {len(runs)} checkpoints ({[r[0] for r in runs]})")
        runs = [(label, checkpoint) for label, (_, checkpoint) in zip(labels, runs)]
    scored = score_runs(runs, k_values)
    markdown = render_tables(scored, k_values)
    print(markdown)
    if args.output:
        Path(args.output).write_text(markdown + "\n", encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(scored, indent=2) + "\n", encoding="utf-8")
    return 0



def _aggregate_cli(args: argparse.Namespace, k_values: list[int | str]) -> int:
    labels = [row_label(path) for path in args.runs]
    if args.labels:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(args.runs):
            raise ValueError(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    grouped: dict[str, list[list[tuple[str, Checkpoint]]]] = {}
    for label, path in zip(labels, args.runs):
        grouped.setdefault(label, []).append(load_runs([path], args.data, args.benchmark, args.think))
    aggregated = aggregate_runs(list(grouped.items()), k_values)
    markdown = render_aggregate(aggregated, k_values)
    print(markdown)
    if args.output:
        Path(args.output).write_text(markdown + "\n", encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(aggregated, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
