"""Prompt templates, and recognising them in prompts that already carry one.

DAPO-Math-17k's prompts come wrapped in the DAPO ``Answer:`` instruction: the wrapper is removed first
(``strip_known_template``) to deduplicate by problem and to offer other templates.
"""

from __future__ import annotations

import re

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."

TEMPLATES: dict[str, str] = {
    # DAPO's own instruction; scored by the ``math_dapo`` route of recipe/reward/score.py.
    "dapo": DAPO_PREFIX + "{problem}" + DAPO_SUFFIX,
    # The common Qwen-math instruction; scored by math-verify on the last \boxed{}.
    "boxed": "{problem}" + BOXED_SUFFIX,
    # The bare problem, for models whose chat template already asks for <think> ... \boxed{}.
    "bare": "{problem}",
}

_WRAPPERS: list[tuple[re.Pattern[str], re.Pattern[str]]] = [
    (
        re.compile(
            r"^\s*Solve the following math problem step by step\..*?where \$Answer is the answer to the problem\.\s*",
            re.S,
        ),
        re.compile(r'\s*Remember to put your answer on its own line after "Answer:"\.?\s*$'),
    ),
    (
        re.compile(r"^"),
        re.compile(r"\s*Please reason step by step, and put your final answer within \\boxed\{\}\.?\s*$"),
    ),
]


def apply_template(name: str, problem: str) -> str:
    """The user message for ``problem`` under template ``name``."""
    if name not in TEMPLATES:
        raise KeyError(f"unknown template {name!r}; choose one of {sorted(TEMPLATES)}")
    return TEMPLATES[name].replace("{problem}", problem)


def strip_known_template(content: str) -> str:
    """The bare problem inside a prompt wrapped by one of our templates (else ``content``); only a wrapper
    with both ends present is removed, so a problem that merely mentions "Answer:" is left intact."""
    for prefix, suffix in _WRAPPERS:
        head = prefix.match(content)
        tail = suffix.search(content)
        if head and tail and head.end() <= tail.start() and (head.end() > 0 or tail.start() < len(content)):
            return content[head.end() : tail.start()].strip()
    return content.strip()
