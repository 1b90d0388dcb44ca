"""A synthetic verifiable task, a tiny Qwen3 model and a chat tokenizer, all generated locally.

The workload for running verl's real trainer end to end on a 2-core CPU machine, built from code in seconds (why
``echo`` learns from random weights: docs/cpu_end_to_end.md, "The smoke task").
``python -m recipe.smoke.task --out DIR [--task echo] [--train 512] [--val 20]`` prints the paths as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

TASKS: tuple[str, ...] = ("echo", "last_digit", "sum_mod10")
"""Supported synthetic tasks (docs/cpu_end_to_end.md, "The smoke task")."""

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
ROLE_TOKENS: tuple[str, ...] = ("system", "user", "assistant")
ANSWER_TOKENS: tuple[str, ...] = tuple(f"\\boxed{{{d}}}" for d in range(10))
"""One token per boxed answer: a well-formed answer is one sample away."""
CHAR_TOKENS: tuple[str, ...] = ("\n", " ", *"0123456789", "+", "=", "?", ":")
"""Character-level vocabulary for everything else (prompts use digits only)."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML, as Qwen uses it (without the default system prompt, to keep prompts short)."""


@dataclass(frozen=True)
class SmokeModelSpec:
    """Shape of the random-weight Qwen3 policy (~80K parameters; one step of 128 x 20 tokens
    costs milliseconds on CPU). ``vocab_size`` is filled in from the tokenizer."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class SmokeAssets:
    """Paths produced by :func:`build_smoke_assets`."""

    model_path: str
    train_file: str
    val_file: str
    task: str
    data_source: str
    vocab_size: int
    num_parameters: int


def data_source_for(task: str) -> str:
    """The ``data_source`` written for ``task`` (routes ``compute_score`` to math-verify)."""
    _check_task(task)
    return f"smoke_{task}"


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown smoke task {task!r}; choose one of {TASKS}")


def answer_for(task: str, digits: str) -> str:
    """Ground truth for a digit-string prompt."""
    _check_task(task)
    if not digits or not digits.isdigit():
        raise ValueError(f"prompt must be a non-empty digit string, got {digits!r}")
    if task == "echo":
        if len(set(digits)) != 1:
            raise ValueError(f"echo prompts repeat one digit, got {digits!r}")
        return digits[0]
    if task == "last_digit":
        return digits[-1]
    return str(sum(int(c) for c in digits) % 10)


def format_answer(answer: str) -> str:
    """The response text a perfect policy emits (one answer token, then ``<|im_end|>``)."""
    return f"\\boxed{{{answer}}}"


def build_tokenizer() -> Any:
    """A char-level ``PreTrainedTokenizerFast`` with ChatML specials and a chat template: one token per
    character, plus whole tokens for the specials, the role names and the boxed answers; ``decode(encode(s)) == s``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *CHAR_TOKENS):
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[BOS_TOKEN, EOS_TOKEN],
        model_max_length=256,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(list(ROLE_TOKENS) + list(ANSWER_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: Any, spec: SmokeModelSpec = SmokeModelSpec(), seed: int = 0, head_scale: float = 1.0) -> Any:
    """A random-weight ``Qwen3ForCausalLM`` whose vocabulary is exactly the tokenizer's.

    The vocabulary must not be padded: a sampled id with no token would decode to nothing.
    ``head_scale`` multiplies the output head: larger logits, as a trained model's are, so that one bf16 ulp
    of a logit is large enough for the kernels' batch-size-dependent rounding to show in the log-probs
    (the trainer-level on-policy tests: tests/test_smoke_cpu.py, tests/test_sft_chain_cpu.py).
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(spec),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def save_model_and_tokenizer(
    path: str | os.PathLike[str], spec: SmokeModelSpec = SmokeModelSpec(), seed: int = 0, head_scale: float = 1.0
) -> str:
    """Write the tiny Qwen3 checkpoint and its tokenizer to ``path`` (a HF model dir); return it."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, spec, seed, head_scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


ECHO_TRAIN_LENGTHS: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
ECHO_VAL_LENGTHS: tuple[int, ...] = (7, 8)
"""``echo`` prompt lengths: validation uses lengths never seen in training."""


def _row(task: str, problem: str, index: int, split: str) -> dict[str, Any]:
    return {
        "data_source": data_source_for(task),
        "prompt": [{"role": "user", "content": problem}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer_for(task, problem)},
        "extra_info": {"index": index, "split": split, "problem": problem, "task": task},
    }


def make_rows(
    task: str, n: int, *, split: str, seed: int, digits: int = 4, exclude: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """``n`` rows in verl's RL schema.

    ``echo``: training rows (``split="train"``) draw a digit and a length from
    :data:`ECHO_TRAIN_LENGTHS` with replacement (there are only 60 such prompts); other splits
    cycle through all 20 prompts of :data:`ECHO_VAL_LENGTHS`. Other tasks: ``n`` distinct
    prompts of ``digits`` random digits, none in ``exclude``.
    """
    _check_task(task)
    rng = random.Random(seed)
    if task == "echo":
        if split == "train":
            problems = [rng.choice("0123456789") * rng.choice(ECHO_TRAIN_LENGTHS) for _ in range(n)]
        else:
            pool = [d * k for k in ECHO_VAL_LENGTHS for d in "0123456789"]
            problems = [pool[i % len(pool)] for i in range(n)]
        return [_row(task, p, i, split) for i, p in enumerate(problems)]
    if n > 10**digits - len(set(exclude)):
        raise ValueError(f"cannot draw {n} distinct {digits}-digit prompts")
    taken = set(exclude)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        problem = "".join(rng.choice("0123456789") for _ in range(digits))
        if problem in taken:
            continue
        taken.add(problem)
        rows.append(_row(task, problem, len(rows), split))
    return rows


def write_smoke_data(
    out_dir: str | os.PathLike[str],
    task: str = "echo",
    n_train: int = 512,
    n_val: int = 20,
    seed: int = 0,
    digits: int = 4,
) -> tuple[str, str]:
    """Write ``train.parquet`` / ``val.parquet`` (disjoint prompts) to ``out_dir``; return their paths."""
    from data_prep.convert import write_parquet

    train = make_rows(task, n_train, split="train", seed=seed, digits=digits)
    val = make_rows(
        task, n_val, split="test", seed=seed + 1, digits=digits, exclude=[r["extra_info"]["problem"] for r in train]
    )
    out = Path(out_dir)
    return str(write_parquet(train, out / "train.parquet")), str(write_parquet(val, out / "val.parquet"))


def write_smoke_sft_data(out_dir: str | os.PathLike[str], task: str = "echo", n: int = 256, seed: int = 0) -> str:
    """``sft_train.parquet``: the training prompts answered correctly, in the SFT schema the
    ``openmathreasoning`` set uses (``messages`` = [user, assistant], ``enable_thinking``), for the
    CPU run of the SFT -> RL chain (``recipe.sft`` then this smoke's RL run)."""
    from data_prep.convert import write_parquet

    rows = []
    for row in make_rows(task, n, split="train", seed=seed + 7):
        problem = row["extra_info"]["problem"]
        rows.append(
            {
                "data_source": data_source_for(task),
                "messages": [
                    {"role": "user", "content": problem},
                    {"role": "assistant", "content": format_answer(answer_for(task, problem))},
                ],
                "enable_thinking": False,
                "extra_info": {"index": len(rows), "problem": problem},
            }
        )
    return str(write_parquet(rows, Path(out_dir) / "sft_train.parquet"))


def build_smoke_assets(
    out_dir: str | os.PathLike[str],
    task: str = "echo",
    n_train: int = 512,
    n_val: int = 20,
    seed: int = 0,
    spec: SmokeModelSpec = SmokeModelSpec(),
    head_scale: float = 1.0,
) -> SmokeAssets:
    """Model, tokenizer and data for the smoke run under ``out_dir`` (``model/``, ``data/``)."""
    out = Path(out_dir)
    model_path = save_model_and_tokenizer(out / "model", spec, seed, head_scale)
    train_file, val_file = write_smoke_data(out / "data", task, n_train, n_val, seed)
    with open(Path(model_path) / "config.json") as f:
        vocab_size = int(json.load(f)["vocab_size"])
    return SmokeAssets(
        model_path=model_path,
        train_file=train_file,
        val_file=val_file,
        task=task,
        data_source=data_source_for(task),
        vocab_size=vocab_size,
        num_parameters=_count_parameters(model_path),
    )


def _count_parameters(model_path: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_path) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(int(dim) for dim in f.get_slice(key).get_shape()) for key in f.keys())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.smoke.task", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder (model/ and data/ are created in it)")
    parser.add_argument("--task", default="echo", choices=TASKS)
    parser.add_argument("--train", type=int, default=512, help="training prompts")
    parser.add_argument("--val", type=int, default=20, help="validation prompts (disjoint from training)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--head-scale",
        type=float,
        default=1.0,
        help="multiply the model's output head (larger logits, as a trained model's)",
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        default=SmokeModelSpec.head_dim,
        help="attention head size (32 for vLLM's CPU attention, which has no kernel for 16)",
    )
    parser.add_argument(
        "--sft",
        type=int,
        default=0,
        metavar="N",
        help="also write data/sft_train.parquet with N answered prompts (SFT -> RL chain)",
    )
    args = parser.parse_args(argv)
    spec = replace(SmokeModelSpec(), head_dim=args.head_dim)
    assets = build_smoke_assets(
        args.out, args.task, args.train, args.val, args.seed, spec=spec, head_scale=args.head_scale
    )
    report = asdict(assets)
    if args.sft:
        report["sft_file"] = write_smoke_sft_data(Path(args.out) / "data", args.task, args.sft, args.seed)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
