"""Dispatch ``python -m recipe.bench <name>`` to ``recipe.bench.<name with _>.main(argv)``."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, str] = {
    "losses": "recipe.bench.losses",
    "entropy-memory": "recipe.bench.entropy_memory",
    "full-kl": "recipe.bench.full_kl",
    "topk-tail": "recipe.bench.topk_tail",
    "reward": "recipe.bench.reward",
    "gpu": "recipe.bench.gpu",
    "onpolicy": "recipe.bench.onpolicy",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in BENCHMARKS:
        names = ", ".join(BENCHMARKS)
        print(f"usage: python -m recipe.bench {{{names}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
