"""``python -m data_prep <dataset> --input PATH --output DIR [--template NAME]``.

``openmathreasoning`` (the ATR paper's SFT set, ``data_prep/openmath.py``) takes its own options:
``--tokenizer``, ``--exclude``, ``--sample``, ``--max-tokens``, ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import sys

from data_prep import openmath
from data_prep.convert import DATASETS, convert
from data_prep.io import DataPrepError
from data_prep.templates import TEMPLATES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Convert a math dataset into verl's RL parquet schema (see docs/data_and_reward.md), "
        "or OpenMathReasoning into the ATR paper's SFT set.",
    )
    parser.add_argument("dataset", choices=sorted([*DATASETS, openmath.NAME]))
    parser.add_argument(
        "--input", required=True, help="file (.parquet/.json/.jsonl), folder, save_to_disk folder, or hub id"
    )
    parser.add_argument("--output", required=True, help="folder; writes <dataset>.parquet there")
    parser.add_argument(
        "--template", choices=sorted(TEMPLATES), help="prompt template (default depends on the dataset)"
    )
    parser.add_argument("--split", help="split of a hub dataset or DatasetDict folder (OpenMathReasoning: cot)")
    parser.add_argument("--config", help="config name of a hub dataset (e.g. opencompass/AIME2025 AIME2025-I)")
    parser.add_argument("--summary-json", action="store_true", help="print the summary as one JSON object")
    sft = parser.add_argument_group("openmathreasoning (SFT set)")
    sft.add_argument("--tokenizer", help="model folder or hub id whose chat template and tokenizer count the tokens")
    sft.add_argument("--exclude", nargs="+", default=[], help="evaluation parquets (or their folder) to dedupe against")
    sft.add_argument("--sample", type=int, default=openmath.DEFAULT_SAMPLE, help="rows to write (default %(default)s)")
    sft.add_argument(
        "--max-tokens",
        type=int,
        default=openmath.DEFAULT_MAX_TOKENS,
        help="longest prompt + target in tokens (default %(default)s)",
    )
    sft.add_argument("--seed", type=int, default=openmath.DEFAULT_SEED, help="sampling seed (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.dataset == openmath.NAME:
            if not args.tokenizer:
                parser.error("openmathreasoning needs --tokenizer (the model the SFT trains, e.g. Qwen/Qwen3-1.7B)")
            if args.template:
                parser.error("openmathreasoning always uses the dapo template (the RL prompts'); drop --template")
            summary: object = openmath.convert_openmath(
                args.input,
                args.output,
                args.tokenizer,
                args.exclude,
                args.sample,
                args.max_tokens,
                args.seed,
                args.split,
                args.config,
            )
        else:
            summary = convert(args.dataset, args.input, args.output, args.template, args.split, args.config)
    except DataPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.summary_json:
        print(json.dumps(summary.as_dict()))  # type: ignore[attr-defined]
    else:
        print("\n".join(summary.lines()))  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
