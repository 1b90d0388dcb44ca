"""How one SFT row becomes tokens: the RL prompt, then the target. Standard library only.

``messages = [user, assistant]`` is ``chat_template([user], add_generation_prompt=True)`` -- token for token the
prompt verl's ``RLHFDataset`` feeds the rollout -- then the assistant text and ``eos``. :mod:`data_prep.openmath`
measures rows and :mod:`recipe.sft_dataset` tokenises them with these functions, so their counts agree.
"""

from __future__ import annotations

from typing import Any

ROLES = ("user", "assistant")


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``[user, assistant]`` with non-empty string contents, else ValueError naming ``where``."""
    if not isinstance(messages, (list, tuple)) or len(messages) != 2:
        raise ValueError(f"{where}: 'messages' must be [user, assistant], got {messages!r:.120}")
    out = []
    for message, role in zip(messages, ROLES, strict=False):
        if not isinstance(message, dict) or message.get("role") != role:
            raise ValueError(
                f"{where}: 'messages' must be [user, assistant]; expected role {role!r}, got {message!r:.120}"
            )
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


def encode_pair(
    tokenizer: Any, messages: list[dict[str, str]], **chat_template_kwargs: Any
) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) of one ``[user, assistant]`` row; ``len(a) + len(b)`` is its length."""
    return prompt_ids(tokenizer, messages[0], **chat_template_kwargs), response_ids(tokenizer, messages[1]["content"])
