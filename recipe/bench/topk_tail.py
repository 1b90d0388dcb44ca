"""How much of a policy's mass lies outside its top-k: the measurement ``kl_full_top_k`` is chosen from.

``python -m recipe.bench topk-tail --model PATH --data FILE [--k 1,2,4,8,16,32,64,128] [--json]``: teacher-forces
a MATH-500-layout JSON-lines file through a local checkpoint and reports per k the tail mass over the response
tokens (all that ``kl_full`` misses) and the stored top-k's bytes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from pathlib import Path
from typing import Any

DEFAULT_KS = "1,2,4,8,16,32,64,128"
ROWS_PER_CHUNK = 256
QUANTILES = (0.5, 0.9, 0.99)


def read_rows(path: Path, prompt_key: str, response_key: str) -> list[tuple[str, str]]:
    """(prompt, response) text pairs of a JSON-lines file; a row without both keys raises naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--data {path}:{line_no} is not JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"--data {path}:{line_no} is not a JSON object")
        for key in (prompt_key, response_key):
            if not isinstance(row.get(key), str) or not row[key]:
                raise ValueError(
                    f"--data {path}:{line_no} has no non-empty string {key!r} (--prompt-key/--response-key)"
                )
        rows.append((row[prompt_key], row[response_key]))
    if not rows:
        raise ValueError(f"--data {path} holds no rows")
    return rows


def tail_log_masses(log_probs: Any, ks: list[int]) -> Any:
    """``(tokens, len(ks))`` log of the mass outside each row's top-k, for each k (float64), summed directly by
    ``kl_full``'s own :func:`verl_ext.core.coarsened_kl.tail_log_mass_`: no ``1 - sum(top-k)`` cancellation, so a
    tail of 1e-12 keeps its digits."""
    import torch

    from verl_ext.core.coarsened_kl import tail_log_mass_

    k_max = max(ks)
    out = []
    for chunk in log_probs.split(ROWS_PER_CHUNK):  # a float64 copy of 256 rows at a time
        top_ids = chunk.topk(k_max, dim=-1).indices
        tails = [tail_log_mass_(chunk.double().scatter_(-1, top_ids[:, :k], -math.inf)) for k in ks]
        out.append(torch.cat(tails, dim=-1))
    return torch.cat(out) if out else log_probs.new_zeros((0, len(ks)), dtype=torch.float64)


def measure(
    model_path: str,
    rows: list[tuple[str, str]],
    ks: list[int],
    temperature: float,
    max_tokens: int,
    max_response_tokens: int,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_ext.core.coarsened_kl import check_top_k, stored_bytes_per_token

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True).to(device).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    check_top_k(max(ks), vocab, key="--k")  # the project's one check of a top-k against a vocabulary
    tails, entropies, sequences = [], [], 0
    with torch.no_grad():
        for prompt, response in rows:
            if tokenizer.chat_template:
                prompt_ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            else:
                prompt_ids = tokenizer(prompt).input_ids
            response_ids = tokenizer(response, add_special_tokens=False).input_ids[:max_response_tokens]
            if not response_ids:
                continue
            ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
            log_probs = torch.log_softmax(logits, dim=-1)
            tails.append(tail_log_masses(log_probs, ks).cpu())
            entropies.append(-(log_probs.exp() * log_probs).sum(-1).double().cpu())
            sequences += 1
            if sum(t.shape[0] for t in tails) >= max_tokens:
                break
    if not tails:
        raise ValueError("--data: no row produced a response token")
    tail_mass = torch.exp(torch.cat(tails))  # (tokens, len(ks))
    entropy = torch.cat(entropies)
    per_k = []
    for column, k in enumerate(ks):
        t = tail_mass[:, column]
        per_k.append(
            {
                "k": k,
                "tail_mean": float(t.mean()),
                **{f"tail_p{round(q * 100)}": float(torch.quantile(t, q)) for q in QUANTILES},
                "tail_max": float(t.max()),
                "frac_tail_over_1e-3": float((t > 1e-3).double().mean()),
                "frac_tail_over_1e-2": float((t > 1e-2).double().mean()),
                "bytes_per_token": stored_bytes_per_token(k),
            }
        )
    return {
        "model": model_path,
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "vocab_size": vocab,
        "temperature": temperature,
        "sequences": sequences,
        "tokens": int(tail_mass.shape[0]),
        "entropy_mean": float(entropy.mean()),
        "per_k": per_k,
    }


def smallest_k(result: dict[str, Any], quantile_key: str, target: float) -> int | None:
    """The smallest k of the sweep whose ``quantile_key`` tail mass is at most ``target``."""
    return next((row["k"] for row in result["per_k"] if row[quantile_key] <= target), None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench topk-tail", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="local Hugging Face checkpoint directory (model + tokenizer)")
    parser.add_argument(
        "--data",
        required=True,
        type=Path,
        help="JSON-lines file of (prompt, response) texts, e.g. MATH-500 (problem, solution)",
    )
    parser.add_argument("--prompt-key", default="problem", help="prompt field of each row")
    parser.add_argument("--response-key", default="solution", help="response field of each row")
    parser.add_argument("--k", default=DEFAULT_KS, help="comma-separated k values")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the run")
    parser.add_argument("--max-tokens", type=int, default=20_000, help="stop after this many response tokens")
    parser.add_argument(
        "--max-response-tokens", type=int, default=4096, help="truncate each response to this many tokens"
    )
    parser.add_argument(
        "--target", type=float, default=1e-2, help="tail mass the suggested k keeps the p99 token below"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    except ValueError:
        raise SystemExit(f"--k {args.k!r}: give comma-separated integers") from None
    if not ks or ks[0] < 1:
        raise SystemExit(f"--k {args.k!r}: every k must be >= 1")
    if not args.temperature > 0:
        raise SystemExit(f"--temperature {args.temperature} must be > 0")
    if not Path(args.model).is_dir():
        raise SystemExit(f"--model {args.model}: not a local checkpoint directory (this probe never downloads)")
    rows = read_rows(args.data, args.prompt_key, args.response_key)
    result = measure(args.model, rows, ks, args.temperature, args.max_tokens, args.max_response_tokens)
    result.update(
        date=_dt.date.today().isoformat(),
        data=str(args.data),
        target=args.target,
        suggested_k=smallest_k(result, "tail_p99", args.target),
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['model']} ({result['device']}, {result['dtype']}, vocabulary {result['vocab_size']}), "
        f"{result['tokens']} response tokens of {result['sequences']} rows of {args.data}, T={args.temperature}, "
        f"mean entropy {result['entropy_mean']:.3f} nats"
    )
    print(
        f"{'k':>5} {'tail mean':>10} {'p50':>10} {'p90':>10} {'p99':>10} {'max':>10} {'>1e-3':>7} {'>1e-2':>7} "
        f"{'B/token':>8}"
    )
    for row in result["per_k"]:
        print(
            f"{row['k']:>5} {row['tail_mean']:>10.2e} {row['tail_p50']:>10.2e} {row['tail_p90']:>10.2e} "
            f"{row['tail_p99']:>10.2e} {row['tail_max']:>10.2e} {row['frac_tail_over_1e-3']:>7.3f} "
            f"{row['frac_tail_over_1e-2']:>7.3f} {row['bytes_per_token']:>8}"
        )
    suggested = result["suggested_k"]
    print(
        f"smallest k with p99 tail mass <= {args.target:g}: "
        f"{suggested if suggested is not None else 'none in the sweep'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
