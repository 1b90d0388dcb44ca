"""``python -m data_prep <dataset> --input PATH --output DIR [--template NAME]``."""

from __future__ import annotations

import argparse
import json
import sys

from data_prep.convert import DATASETS, convert
from data_prep.io import DataPrepError
from data_prep.templates import TEMPLATES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Convert a math dataset into verl's RL parquet schema (see docs/data_and_reward.md).",
    )
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument("--input", required=True, help="file (.parquet/.json/.jsonl), folder, save_to_disk folder, or hub id")
    parser.add_argument("--output", required=True, help="folder; writes <dataset>.parquet there")
    parser.add_argument("--template", choices=sorted(TEMPLATES), help="prompt template (default depends on the dataset)")
    parser.add_argument("--split", help="split of a hub dataset or DatasetDict folder")
    parser.add_argument("--config", help="config name of a hub dataset (e.g. opencompass/AIME2025 AIME2025-I)")
    parser.add_argument("--summary-json", action="store_true", help="print the summary as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = convert(args.dataset, args.input, args.output, args.template, args.split, args.config)
    except DataPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.summary_json:
        print(json.dumps(summary.as_dict()))
    else:
        print("\n".join(summary.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
