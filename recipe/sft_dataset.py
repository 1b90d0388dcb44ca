"""SFT rows tokenised exactly as the RL rollouts see their prompts (``data.custom_cls`` of verl's SFT trainer).

Each row is ``messages = [user, assistant]``. The input is

    chat_template([user], add_generation_prompt=True, **apply_chat_template_kwargs)  # the RL prompt
    + tokens(assistant content) + [eos]                                                # the target

and the loss covers the target only. The prompt part is, token for token, what verl's
``RLHFDataset`` feeds the rollout (same template call, same ``apply_chat_template_kwargs``, e.g.
Qwen3's ``enable_thinking=False``), so the SFT stage teaches the format the RL stage samples in.
The tokenisation itself is :mod:`data_prep.sft_tokens`, which ``python -m data_prep
openmathreasoning`` also measures each row with.

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

from data_prep.sft_tokens import check_messages, encode_pair, prompt_ids, response_ids


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

    def sanity_check(
        self, input_ids: torch.Tensor, messages: list[dict], tools: list[dict], enable_thinking: bool
    ) -> None:
        """The row must be exactly RL prompt + target (the check verl's turn-by-turn rendering needs
        does not apply: the assistant turn is not rendered by the template here)."""
        checked = check_messages(messages, "SFT row")
        prompt, target = encode_pair(self.tokenizer, checked, **self._template_kwargs(enable_thinking))
        if input_ids.tolist() != prompt + target:
            raise AssertionError("SFT row tokens differ from RL prompt + target")
