"""Sampling for the ``hf_cpu`` rollout: vLLM's sampling semantics over plain transformers (torch only).

As verl uses vLLM: ``temperature == 0`` is greedy, ``top_k <= 0`` / ``top_p == 1`` are off, an EOS id stops (kept)
unless ``ignore_eos``; log-probs are the sampled tokens' under ``processed_logprobs`` (the distribution drawn
from) or ``raw_logprobs`` (the model's log-softmax).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """The sampling parameters one batch shares (requests are grouped by this key)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    want_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_spec_from_params(params: dict[str, Any]) -> SamplingSpec:
    """Parse the ``sampling_params`` dict verl's agent loop sends (vLLM conventions). Unknown keys raise: ignoring
    e.g. ``stop`` or ``n`` would produce samples that do not follow the requested distribution."""
    allowed = {
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "logprobs",
        "max_tokens",
        "max_new_tokens",
        "seed",
        "ignore_eos",
    }
    unknown = set(params) - allowed
    if unknown:
        raise NotImplementedError(f"hf_cpu rollout does not support sampling params {sorted(unknown)}")
    top_k = params.get("top_k", -1)
    top_k = -1 if top_k is None else int(top_k)
    top_p = params.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return SamplingSpec(
        temperature=float(params.get("temperature", 1.0) or 0.0),
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=float(params.get("repetition_penalty", 1.0) or 1.0),
        want_logprobs=bool(params.get("logprobs", False)),
    )


def process_logits(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """Apply temperature, top-k and top-p to ``[batch, vocab]`` float logits (masked = ``-inf``)."""
    if spec.greedy:
        return logits
    logits = logits / spec.temperature
    vocab = logits.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(logits, spec.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass *before* it already reaches top_p (the top token always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= spec.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as vLLM/HF): divide positive, multiply negative logits of seen tokens."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_tokens: list[int],
    spec: SamplingSpec,
    *,
    eos_ids: Iterable[int],
    pad_id: int,
    generator: Optional[torch.Generator] = None,
    ignore_eos: bool = False,
    logprobs_mode: str = "processed_logprobs",
    should_stop: Optional[Callable[[], bool]] = None,
) -> list[tuple[list[int], Optional[list[float]], str]]:
    """Sample continuations for left-padded ``prompts`` with a KV cache: one ``(token_ids, log_probs or None,
    finish_reason)`` per prompt, ``finish_reason`` being ``"stop"`` (an EOS id, included as vLLM does),
    ``"length"`` or ``"abort"`` (``should_stop()``, asked before every decoding step, returned true first: the row
    keeps its tokens so far, each with its log-prob). Finished rows keep being fed so the batch stays rectangular."""
    if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
        raise NotImplementedError(
            f"hf_cpu rollout supports logprobs_mode processed_logprobs|raw_logprobs, got {logprobs_mode!r}"
        )
    device = next(model.parameters()).device
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((batch, width), dtype=torch.long, device=device)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(sorted(set(int(i) for i in eos_ids)), dtype=torch.long, device=device)
    limits = torch.tensor(max_tokens, dtype=torch.long, device=device)
    vocab = int(model.config.vocab_size)
    seen = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
    if spec.repetition_penalty != 1.0:
        for row, ids in enumerate(prompts):
            seen[row, torch.tensor(ids, dtype=torch.long) % vocab] = True

    out_tokens: list[list[int]] = [[] for _ in range(batch)]
    out_logprobs: list[list[float]] = [[] for _ in range(batch)]
    finish = ["length"] * batch
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    past = None
    step_ids, step_pos, mask = input_ids, position_ids, attention_mask
    for step in range(int(limits.max().item())):
        if should_stop is not None and should_stop():
            for row in range(batch):
                if not done[row]:
                    finish[row] = "abort"
            break
        out = model(
            input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past, use_cache=True
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()
        logits = apply_repetition_penalty(logits, seen, spec.repetition_penalty)
        processed = process_logits(logits, spec)
        if spec.greedy:
            next_ids = processed.argmax(dim=-1)
        else:
            probs = torch.softmax(processed, dim=-1)
            next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        if spec.want_logprobs:
            source = processed if logprobs_mode == "processed_logprobs" else logits
            chosen = torch.log_softmax(source, dim=-1).gather(-1, next_ids[:, None]).squeeze(-1)
        for row in range(batch):
            if done[row]:
                continue
            token = int(next_ids[row])
            out_tokens[row].append(token)
            if spec.want_logprobs:
                out_logprobs[row].append(float(chosen[row]))
            if not ignore_eos and bool((eos == token).any()):
                finish[row] = "stop"
                done[row] = True
            elif len(out_tokens[row]) >= int(limits[row]):
                done[row] = True
        if bool(done.all()):
            break
        seen[torch.arange(batch, device=device), next_ids] = True
        step_ids = next_ids[:, None]
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=-1)
        step_pos = step_pos[:, -1:] + 1
    return [(out_tokens[r], out_logprobs[r] if spec.want_logprobs else None, finish[r]) for r in range(batch)]


__all__ = ["SamplingSpec", "apply_repetition_penalty", "generate_batch", "process_logits", "sampling_spec_from_params"]
