"""SFT rows tokenised exactly as the RL rollouts see their prompts (``data.custom_cls`` of verl's SFT trainer).

Each ``[user, assistant]`` row is the RL prompt then the target (:mod:`data_prep.sft_tokens`), the loss on the target
only; why not verl's ``MultiTurnSFTDataset``: docs/experiments.md, "SFT stage". Padding, truncation and batching
stay verl's: this subclass replaces only how one message becomes tokens.
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
