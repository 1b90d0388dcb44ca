"""Test support for tests/test_vllm_cpu.py: records what vLLM's engine is asked for, in every process of a run.

Put this folder on ``PYTHONPATH`` and name a file in ``VLLM_REQUEST_LOG``: when a process imports vLLM's
``AsyncLLM`` (verl's ``vLLMHttpServer`` does, in the rollout server actor), its ``generate`` is wrapped to append
one JSON line per request -- the ``SamplingParams`` verl built (``max_tokens``, ``ignore_eos``, temperature,
log-probs) and the prompt's token ids -- and one when the request ends (vLLM's finish reason, the tokens it
produced: ids). Without ``VLLM_REQUEST_LOG`` this module does nothing. Nothing in the product imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from typing import Any

_TARGET = "vllm.v1.engine.async_llm"
_LOG = os.environ.get("VLLM_REQUEST_LOG")


def _write(record: dict[str, Any]) -> None:
    with open(_LOG, "a") as sink:  # one short append per line: lines of concurrent writers do not interleave
        sink.write(json.dumps(record) + "\n")


def _wrap(async_llm: type) -> None:
    original = async_llm.generate

    async def generate(self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        _write(
            {
                "event": "request",
                "id": request_id,
                "pid": os.getpid(),
                "prompt_ids": list(ids or []),
                "max_tokens": sampling_params.max_tokens,
                "ignore_eos": sampling_params.ignore_eos,
                "temperature": sampling_params.temperature,
                "logprobs": sampling_params.logprobs,
            }
        )
        last = None
        async for output in original(self, prompt, sampling_params, request_id, *args, **kwargs):
            last = output
            yield output
        done = last.outputs[0] if last is not None and last.outputs else None
        _write(
            {
                "event": "done",
                "id": request_id,
                "finish_reason": None if done is None else done.finish_reason,
                "token_ids": [] if done is None else list(done.token_ids),
            }
        )

    async_llm.generate = generate


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when vLLM's async engine module is imported, lets the normal finders load it and
    wraps ``AsyncLLM.generate`` once the module has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _wrap(module.AsyncLLM)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _LOG:
    sys.meta_path.insert(0, _WrapOnImport())
