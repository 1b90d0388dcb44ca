"""``generate``: sample ``n`` responses per problem with vLLM, score them, write one JSONL per benchmark.

Everything is validated (:func:`plan_generation`, :func:`check_model_path`) before vLLM is imported, so a typo costs
a second on a login node instead of a GPU allocation; :func:`vllm_sampler` (a :data:`Sampler`) is the only vLLM import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recipe.eval.presets import SamplingSpec, resolve_sampling
from recipe.eval.problems import Problem, Scorer, expand_files, load_eval_parquet, reward_scorer

#: The sampler seam: (conversations, sampling) -> one list of ``sampling.n`` texts per
#: conversation, in input order. :func:`vllm_sampler` builds the real one.
Sampler = Callable[[list[list[dict[str, str]]], SamplingSpec], list[list[str]]]


@dataclass(frozen=True)
class BenchmarkPlan:
    benchmark: str
    parquet: Path
    problems: list[Problem]
    sampling: SamplingSpec


def plan_generation(
    data: Sequence[str | os.PathLike[str]],
    preset: str | None,
    k_values: Sequence[int | str] = ("n",),
    n: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
) -> list[BenchmarkPlan]:
    """Validate everything ``generate`` needs, without touching a GPU (``data``: parquet files or folders of
    them); ValueError on the first problem."""
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
    """Sample, score and write ``<output_dir>/<benchmark>.jsonl`` (one row per problem) for every plan; each
    file is written under a temporary name and renamed, so an interrupted run leaves no half-written file."""
    scorer = scorer or reward_scorer()
    out = Path(output_dir)
    targets = [out / f"{plan.benchmark}.jsonl" for plan in plans]
    if not overwrite:
        refuse_existing_outputs(targets)
    out.mkdir(parents=True, exist_ok=True)
    for plan, target in zip(plans, targets, strict=False):
        conversations = [p.messages for p in plan.problems]
        samples = sampler(conversations, plan.sampling)
        if len(samples) != len(conversations):
            raise RuntimeError(
                f"{plan.benchmark}: sampler returned {len(samples)} results for {len(conversations)} prompts"
            )
        tmp = target.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for problem, responses in zip(plan.problems, samples, strict=False):
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
