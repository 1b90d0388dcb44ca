"""Benchmarks and sampling presets: canonical names, table order, the ERC/ATR papers' settings.

Validation of sampling settings and of ``--k`` lists lives here too, so ``generate`` can reject a
bad command before it imports vLLM. No I/O; imported by every other part of :mod:`recipe.eval`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


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
PRESET_CHAT_TEMPLATE_KWARGS: dict[str, dict[str, Any]] = {"erc": {}, "atr": {"enable_thinking": False}}


def resolve_chat_template_kwargs(preset: str | None, given: str | None) -> dict[str, Any]:
    """``--chat-template-kwargs`` (a JSON object) if given, else the preset's; ValueError names the flag."""
    if given is None:
        return dict(PRESET_CHAT_TEMPLATE_KWARGS.get(preset or "", {}))
    try:
        value = json.loads(given)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--chat-template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}': {exc.msg}"
        ) from exc
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
            raise ValueError(
                f"unknown --preset {preset!r}; known: {sorted(PRESETS)} (or omit it and give all settings)"
            )
        base = PRESETS[preset].get(benchmark)
    given = {"n": n, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
    chosen = {key: getattr(base, key, None) if value is None else value for key, value in given.items()}
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
