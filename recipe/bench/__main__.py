"""Dispatch ``python -m recipe.bench <name>`` to ``recipe.bench.<name with _>.main(argv)``; ``gpu --acceptance``
to :mod:`recipe.bench.acceptance`, routed here so that the probe and the acceptance do not import each other.
"""

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
    "old-pass-skip": "recipe.bench.old_pass_skip",
    "trainer-modes": "recipe.bench.trainer_modes",
}
ACCEPTANCE_FLAG = "--acceptance"
"""``python -m recipe.bench gpu --acceptance ...`` runs :mod:`recipe.bench.acceptance` with the other options."""


def route(argv: list[str]) -> tuple[str, list[str]]:
    """The module that runs ``argv`` (a known benchmark's name first) and the options it gets."""
    name, options = argv[0], argv[1:]
    if name == "gpu" and ACCEPTANCE_FLAG in options:
        return "recipe.bench.acceptance", [option for option in options if option != ACCEPTANCE_FLAG]
    return BENCHMARKS[name], options


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in BENCHMARKS:
        names = ", ".join(BENCHMARKS)
        print(f"usage: python -m recipe.bench {{{names}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    module_name, options = route(argv)
    module = importlib.import_module(module_name)
    return int(module.main(options) or 0)


if __name__ == "__main__":
    sys.exit(main())
