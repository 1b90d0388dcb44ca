"""``python -m recipe.eval {generate,score}``: argument parsing and the two commands' drivers.

Bad input exits 2 with ``error: <reason>`` on stderr (every ``ValueError`` of the package names the
flag, file, line or benchmark at fault). See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recipe.eval.generate import (
    Sampler,
    check_model_path,
    plan_generation,
    refuse_existing_outputs,
    run_generate,
    vllm_sampler,
)
from recipe.eval.metrics import Checkpoint
from recipe.eval.presets import PRESETS, parse_k_list, resolve_chat_template_kwargs
from recipe.eval.problems import reward_scorer
from recipe.eval.readers import load_runs
from recipe.eval.tables import aggregate_runs, render_aggregate, render_tables, row_label, score_runs

DESCRIPTION = "Offline evaluation: sample a checkpoint on the eval sets, then score mean@k / pass@k / maj@k."


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.eval", description=DESCRIPTION)
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
    gen.add_argument(
        "--chat-template-kwargs",
        help='JSON object for the chat template (default: the preset\'s; atr: {"enable_thinking": false})',
    )
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
    sc.add_argument(
        "--aggregate",
        action="store_true",
        help="each path is one run (e.g. one seed); runs with the same label (default: the folder name without "
        "_seed<S>) form one row, reported as mean ± std over runs for the final and best checkpoint (ATR Table 3)",
    )
    sc.add_argument(
        "--think", default="auto", choices=("auto", "required", "off"), help="reward think mode for re-scoring"
    )
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
        print(
            f"{plan.benchmark}: {len(plan.problems)} problems, n={s.n}, T={s.temperature}, top_p={s.top_p}, "
            f"max_tokens={s.max_tokens}"
        )
    chat_kwargs = resolve_chat_template_kwargs(args.preset, args.chat_template_kwargs)
    print(f"chat_template_kwargs: {json.dumps(chat_kwargs)}")
    sampler = sampler_factory(
        model=str(model),
        tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed,
        max_model_len=args.max_model_len,
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
        runs = [(label, checkpoint) for label, (_, checkpoint) in zip(labels, runs, strict=False)]
    scored = score_runs(runs, k_values)
    _emit(render_tables(scored, k_values), scored, args)
    return 0


def _aggregate_cli(args: argparse.Namespace, k_values: list[int | str]) -> int:
    labels = [row_label(path) for path in args.runs]
    if args.labels:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(args.runs):
            raise ValueError(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    grouped: dict[str, list[list[tuple[str, Checkpoint]]]] = {}
    for label, path in zip(labels, args.runs, strict=False):
        grouped.setdefault(label, []).append(load_runs([path], args.data, args.benchmark, args.think))
    aggregated = aggregate_runs(list(grouped.items()), k_values)
    _emit(render_aggregate(aggregated, k_values), aggregated, args)
    return 0


def _emit(markdown: str, data: Any, args: argparse.Namespace) -> None:
    """Print the tables; also write them to ``--output`` and the figures to ``--json`` when given."""
    print(markdown)
    if args.output:
        Path(args.output).write_text(markdown + "\n", encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
