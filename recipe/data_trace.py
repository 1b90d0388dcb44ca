"""Which prompts each training step fetched and trained on, as JSON lines (``divclip.data_trace=FILE``, opt-in).

It makes checkable that a resume neither skips nor repeats prompts. A prompt is its dataset ``index`` and a hash of
its text (stable across runs, unlike verl's per-fetch uid); the events: docs/experiments.md, "Resuming".
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

DATA_TRACE_KEY = "divclip.data_trace"


def prompt_id(index: Any, raw_prompt: Any) -> list[Any]:
    """``[dataset index, 12-hex-digit hash of the prompt]``: the hash tells prompts apart even where a
    dataset gives every row index 0 (verl's default without ``extra_info.index``)."""
    text = json.dumps(raw_prompt, sort_keys=True, default=str)
    return [int(index) if index is not None else -1, hashlib.sha1(text.encode()).hexdigest()[:12]]


class DataTrace:
    """The trace of one attempt (see the module docstring)."""

    def __init__(self, path: str) -> None:
        if not os.path.isabs(path):
            raise ValueError(f"{DATA_TRACE_KEY}={path!r} must be an absolute path (the trainer runs on a Ray node)")
        self.path = path
        self.attempt = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        self._prompts: dict[str, list[Any]] = {}

    def fetched(self, step: int, uids: Iterable[str], indices: Iterable[Any], raw_prompts: Iterable[Any]) -> None:
        """Prompts the trainer fetched from the dataloader at step ``step``: verl's uid of each, its dataset index
        and its prompt."""
        self._append("fetched", step, prompts=self._hold(uids, indices, raw_prompts))

    def restored(
        self,
        step: int,
        uids: Iterable[str],
        indices: Iterable[Any],
        raw_prompts: Iterable[Any],
        statuses: Iterable[str],
    ) -> None:
        """The prompt groups an asynchronous resume took back from TransferQueue before step ``step``, as
        :meth:`fetched`, with verl's status of each group at the checkpoint."""
        ids = self._hold(uids, indices, raw_prompts)
        status = [str(value) for value in statuses]
        if len(status) != len(ids):
            raise ValueError(f"{DATA_TRACE_KEY}: {len(ids)} restored prompts but {len(status)} statuses")
        self._append("restored", step, prompts=ids, status=status)

    def _hold(self, uids: Iterable[str], indices: Iterable[Any], raw_prompts: Iterable[Any]) -> list[list[Any]]:
        """Note the prompts the trainer holds from now on; returns their ids."""
        ids = []
        for uid, index, raw in zip(uids, indices, raw_prompts, strict=True):
            self._prompts[str(uid)] = prompt_id(index, raw)
            ids.append(self._prompts[str(uid)])
        return ids

    def trained(self, step: int, sample_keys: Iterable[str], tags: Iterable[dict[str, Any]]) -> None:
        """Step ``step`` updated the actor on these samples (verl's ``{uid}_{session}_{index}`` keys, with their
        TransferQueue tags): the synthetic samples verl appends to make a batch divisible (tagged ``is_padding``,
        ``verl.trainer.ppo.padding_utils``) belong to no prompt and are left out."""
        samples = Counter(
            str(key).split("_", 1)[0]
            for key, tag in zip(sample_keys, tags, strict=True)
            if not tag.get("is_padding", False)
        )
        unknown = sorted(uid for uid in samples if uid not in self._prompts)
        if unknown:
            raise KeyError(f"{DATA_TRACE_KEY}: step {step} trained on prompts never fetched: {unknown[:3]}")
        prompts = sorted(self._prompts.pop(uid) for uid in samples)
        self._append("trained", step, prompts=prompts, samples=sum(samples.values()))

    def _append(self, event: str, step: int, **fields: Any) -> None:
        line = {"event": event, "step": int(step), "attempt": self.attempt, **fields}
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
