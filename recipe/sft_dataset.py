"""SFT rows tokenised exactly as the RL rollouts see their prompts (``data.custom_cls`` of verl's SFT trainer).

Each row is ``messages = [user, assistant]``. The input is

    chat_template([user], add_generation_prompt=True, **apply_chat_template_kwargs)  # the RL prompt
    + tokens(assistant content) + [eos]                                                # the target

and the loss covers the target only. The prompt part is, token for token, what verl's
``RLHFDataset`` feeds the rollout (same template call, same ``apply_chat_template_kwargs``, e.g.
Qwen3's ``enable_thinking=False``), so the SFT stage teaches the format the RL stage samples in.

Why not verl's ``MultiTurnSFTDataset`` as is: it renders every turn on its own and checks that
the concatenation equals the whole conversation rendered at once. Qwen3's template adds the
``<think>\\n\\n</think>\\n\\n`` block only to an assistant turn that follows a user turn, so the two
renderings of a ``[user, assistant]`` row differ and its sanity check fails (or, with
``ignore_input_ids_mismatch``, the loss mask -- computed from a generation prompt that includes
the think block -- no longer lines up with the turn). Building the row from the generation prompt
avoids both. Padding, truncation and batching stay verl's (this subclass only replaces how one
message becomes tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

ROLES = ("user", "assistant")


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``[user, assistant]`` with non-empty string contents, else ValueError naming ``where``."""
    if not isinstance(messages, (list, tuple)) or len(messages) != 2:
        raise ValueError(f"{where}: 'messages' must be [user, assistant], got {messages!r:.120}")
    out = []
    for message, role in zip(messages, ROLES):
        if not isinstance(message, dict) or message.get("role") != role:
            raise ValueError(f"{where}: 'messages' must be [user, assistant]; expected role {role!r}, got {message!r:.120}")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{where}: the {role} message has no text content")
        out.append({"role": role, "content": content})
    return out


def prompt_ids(tokenizer: Any, user: dict[str, str], **chat_template_kwargs: Any) -> list[int]:
    """The RL prompt: the chat template with the generation prompt, as verl's RLHFDataset builds it."""
    ids = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True, **chat_template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 may return an encoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def response_ids(tokenizer: Any, text: str) -> list[int]:
    """The target: the assistant text and the end-of-turn token the rollout stops at."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; the target cannot end its turn")
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] + [int(tokenizer.eos_token_id)]


def encode_pair(tokenizer: Any, messages: list[dict[str, str]], **chat_template_kwargs: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) of one ``[user, assistant]`` row; ``len(a) + len(b)`` is its length."""
    return prompt_ids(tokenizer, messages[0], **chat_template_kwargs), response_ids(tokenizer, messages[1]["content"])


class RLPromptSFTDataset(MultiTurnSFTDataset):
    """verl's multi-turn SFT dataset with the RL prompt as the user turn (module docstring)."""

    def _template_kwargs(self, enable_thinking: bool | None) -> dict[str, Any]:
        kwargs = dict(self.apply_chat_template_kwargs)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        return kwargs

    def _process_single_message(
        self,
        index: int,
        message: dict[str, Any],
        full_message: list,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        messages = check_messages(full_message, "SFT row")
        if index == 0:
            ids = prompt_ids(self.tokenizer, messages[0], **self._template_kwargs(enable_thinking))
            loss = torch.zeros(len(ids), dtype=torch.long)
        else:
            ids = response_ids(self.tokenizer, messages[1]["content"])
            loss = torch.ones(len(ids), dtype=torch.long)
        input_ids = torch.tensor(ids, dtype=torch.long)
        return input_ids, loss, torch.ones_like(input_ids), {}

    def sanity_check(self, input_ids: torch.Tensor, messages: list[dict], tools: list[dict], enable_thinking: bool) -> None:
        """The row must be exactly RL prompt + target (the check verl's turn-by-turn rendering needs
        does not apply: the assistant turn is not rendered by the template here)."""
        checked = check_messages(messages, "SFT row")
        prompt, target = encode_pair(self.tokenizer, checked, **self._template_kwargs(enable_thinking))
        if input_ids.tolist() != prompt + target:
            raise AssertionError("SFT row tokens differ from RL prompt + target")
