"""The ``hf_cpu`` generation server: one Ray actor per replica answering what verl asks of a vLLM server.

It imports nothing of :mod:`verl_ext.cpu.rollout`: a Ray worker that unpickles the class imports this module
first, and ``import verl`` then imports the rollout module. docs/cpu_platform.md ("Asynchronous trainer modes").
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from verl.workers.rollout.replica import RolloutMode, TokenOutput

from verl_ext.cpu import ROLLOUT_NAME
from verl_ext.cpu.sampling import SamplingSpec, generate_batch, sampling_spec_from_params

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


def _log_to_stderr() -> None:
    """A stderr handler for this module's logger (nothing configures logging in the server process)."""
    if not logger.handlers:
        handler = logging.StreamHandler(stream=sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:%(asctime)s:%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


STOP_REASONS = {"stop": "completed", "length": "completed", "abort": "aborted"}
"""``generate_batch``'s finish reasons as verl's ``TokenOutput.stop_reason``."""


@dataclass(eq=False)
class GenerationRequest:
    """One admitted request and the future its caller awaits."""

    prompt_ids: list[int]
    spec: SamplingSpec
    max_tokens: int
    request_id: Optional[str]
    future: asyncio.Future = field(repr=False)


@dataclass(frozen=True)
class GenerationResult:
    """What one request's batch produced, and with which weights."""

    token_ids: list[int]
    log_probs: Optional[list[float]]
    finish_reason: str
    """``stop``, ``length`` or ``abort`` (see :func:`verl_ext.cpu.sampling.generate_batch`)."""
    global_steps: Optional[int]
    """The trainer step of the weights that generated ``token_ids``."""


def _token_output(result: GenerationResult) -> TokenOutput:
    return TokenOutput(
        token_ids=result.token_ids,
        log_probs=result.log_probs,
        stop_reason=STOP_REASONS[result.finish_reason],
        num_preempted=0,
        # no tokens, no version: an aborted request that had not started leaves the versions its
        # merged response spans (FullyAsyncLLMServerClient's min/max_global_steps) to the later pieces
        extra_fields={"global_steps": result.global_steps if result.token_ids else None},
    )


def load_hf_model(
    model_path: str, dtype: str = "float32", trust_remote_code: bool = False, override_config: Optional[dict] = None
) -> torch.nn.Module:
    """Load the policy for generation on CPU (``sdpa`` attention, eval mode, no grad)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from verl.utils.torch_dtypes import PrecisionType

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    for key, value in (override_config or {}).items():
        if key != "attn_implementation" and hasattr(config, key):
            setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        config=config,
        dtype=PrecisionType.to_dtype(dtype),
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )
    model.eval()
    model.requires_grad_(False)
    return model


def eos_token_ids(model_path: str, model: torch.nn.Module, trust_remote_code: bool = False) -> list[int]:
    """EOS ids from the generation config, the model config and the tokenizer (union)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
        else:
            ids.add(int(value))

    add(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    try:
        from transformers import AutoTokenizer

        add(AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code).eos_token_id)
    except Exception as exc:  # a model dir without a tokenizer still generates
        logger.warning("hf_cpu: no tokenizer in %s (%s); EOS from the model config only", model_path, exc)
    if not ids:
        raise ValueError(f"hf_cpu: no eos_token_id found for {model_path}; generation could never stop early")
    return sorted(ids)


class HFCpuServer:
    """Token-in/token-out generation server: the calls verl makes on a rollout server handle, and the
    weight-loading calls of :class:`verl_ext.cpu.rollout.HFCpuServerAdapter`.

    Args:
        config: ``actor_rollout_ref.rollout`` (dataclass or DictConfig).
        model_config: ``actor_rollout_ref.model`` (DictConfig, as ``RolloutReplica`` passes it).
        rollout_mode: hybrid (colocated with the actor ranks) or standalone (its own pool).
        replica_rank: this replica's rank; seeds the sampling generator and names the address.
        batch_wait_s: how long the batcher waits for a wave of requests (``HF_CPU_BATCH_WAIT_S``).
        num_threads: torch threads for generation (``HF_CPU_NUM_THREADS``, default 1).
    """

    def __init__(
        self,
        config: Any,
        model_config: Any,
        rollout_mode: RolloutMode,
        replica_rank: int,
        batch_wait_s: Optional[float] = None,
        num_threads: Optional[int] = None,
    ) -> None:
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig, RolloutConfig

        self.config = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        _log_to_stderr()
        if self.config.tensor_model_parallel_size != 1 or self.config.pipeline_model_parallel_size != 1:
            raise NotImplementedError(
                "hf_cpu rollout runs one process per replica: set actor_rollout_ref.rollout."
                "tensor_model_parallel_size=1 (and pipeline_model_parallel_size=1)"
            )
        torch.set_num_threads(int(num_threads or os.environ.get("HF_CPU_NUM_THREADS", 1)))
        self.batch_wait_s = float(
            batch_wait_s if batch_wait_s is not None else os.environ.get("HF_CPU_BATCH_WAIT_S", 0.005)
        )
        path = self.model_config.local_path
        trust = bool(self.model_config.trust_remote_code)
        self.model = load_hf_model(path, self.config.dtype, trust, dict(self.model_config.override_config or {}))
        self.eos_ids = eos_token_ids(path, self.model, trust)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else self.eos_ids[0])
        # as vLLM's server: max_model_len defaults to the model's context length
        self.max_model_len = int(self.config.max_model_len or self.model.config.max_position_embeddings)
        self.generator = torch.Generator().manual_seed(int(self.config.seed) + int(replica_rank))
        self.global_steps: Optional[int] = None
        self.weight_version = 0
        self._queue: list[GenerationRequest] = []
        self._admitted: set[GenerationRequest] = set()
        self._wakeup: Optional[asyncio.Event] = None
        self._batcher: Optional[asyncio.Task] = None
        self._model_lock: Optional[asyncio.Lock] = None
        # the admission gate (closed by abort_all_requests, opened by resume_generation)
        self._gate_open = True
        self._rejecting = False
        self._recheck_gate: Optional[asyncio.Event] = None  # set: waiting requests look at the gate again
        # read by the generating thread between decoding steps
        self._stop_decoding = threading.Event()
        self._pending_weights: Optional[dict[str, torch.Tensor]] = None
        self._param_names = {name for name, _ in self.model.named_parameters()} | {
            name for name, _ in self.model.named_buffers()
        }
        self.stats = dict.fromkeys(
            ("requests", "batches", "generated_tokens", "weight_updates", "aborted_requests", "rejected_requests"), 0
        )

    # -- address / lifecycle -------------------------------------------------------------

    def get_server_address(self) -> tuple[str, int]:
        """A label for verl's load balancer (it keys servers by address); there is no HTTP server."""
        return f"{ROLLOUT_NAME}-replica-{self.replica_rank}", 0

    async def _nothing(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to wake up, free, clear, release or resume, and no profiler: weights and cache stay in host
        memory (not handed to the trainer the way GPU memory is) and the KV cache lives only for one batch."""
        return None

    wake_up = sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = start_profile = stop_profile = _nothing

    async def wait_for_requests_to_drain(self) -> None:
        """Return once every admitted request has its answer."""
        pending = [request.future for request in self._admitted]
        if pending:
            await asyncio.wait(pending)

    async def set_global_steps(self, global_steps: int) -> None:
        """Record the trainer step of the current weights (returned with each output)."""
        self.global_steps = global_steps

    def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "weight_version": self.weight_version, "global_steps": self.global_steps}

    # -- partial rollout: abort and resume -------------------------------------------------

    def _gate_event(self) -> asyncio.Event:
        if self._recheck_gate is None:
            self._recheck_gate = asyncio.Event()
            if self._gate_open:
                self._recheck_gate.set()
        return self._recheck_gate

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Stop every in-flight request at the next token boundary (each returns its tokens so far, aborted,
        before this returns) and pause admission until :meth:`resume_generation`; with ``reject_request``
        waiting and later requests return at once, aborted and empty. ``kwargs`` (vLLM's ``reset_prefix_cache``):
        no cache here. Returns ``{"aborted_count": n, "request_ids": [...]}`` of the requests cut short."""
        self._gate_open = False
        self._rejecting = bool(reject_request)
        if self._rejecting:
            self._gate_event().set()  # requests parked by an earlier abort are rejected too
        else:
            self._gate_event().clear()
        self._stop_decoding.set()
        in_flight = list(self._admitted)
        if in_flight:
            await asyncio.wait([request.future for request in in_flight])
        aborted = [
            request
            for request in in_flight
            if not request.future.cancelled()
            and request.future.exception() is None
            and request.future.result().finish_reason == "abort"
        ]
        self.stats["aborted_requests"] += len(aborted)
        if aborted:
            kept = sum(len(request.future.result().token_ids) for request in aborted)
            logger.info(
                "hf_cpu replica %d: aborted %d of %d in-flight requests (%d tokens kept) at global_steps=%s%s",
                self.replica_rank,
                len(aborted),
                len(in_flight),
                kept,
                self.global_steps,
                "; rejecting new requests" if reject_request else "",
            )
        return {"aborted_count": len(aborted), "request_ids": [request.request_id for request in aborted]}

    async def resume_generation(self) -> None:
        """Open the admission gate again: waiting requests (and the client's re-sent partials) proceed."""
        self._stop_decoding.clear()
        self._rejecting = False
        self._gate_open = True
        self._gate_event().set()

    async def _admitted_or_rejected(self) -> bool:
        """Wait out a closed gate; False when the gate rejects late arrivals instead."""
        while not self._gate_open:
            if self._rejecting:
                self.stats["rejected_requests"] += 1
                return False
            await self._gate_event().wait()
        return True

    # -- weights -------------------------------------------------------------------------

    async def begin_weight_update(self) -> None:
        """Start a weight update; tensors arrive in buckets and are applied at the end."""
        self._pending_weights = {}

    async def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Stage one bucket of ``(name, tensor)`` pairs; return how many."""
        if self._pending_weights is None:
            raise RuntimeError("hf_cpu: load_weight_bucket before begin_weight_update")
        for name, tensor in bucket:
            if name not in self._param_names:
                raise KeyError(f"hf_cpu: actor sent weight {name!r}, which the rollout model does not have")
            self._pending_weights[name] = tensor
        return len(bucket)

    async def finish_weight_update(self, global_steps: Optional[int] = None) -> int:
        """Copy the staged tensors into the model (under the model lock); return how many."""
        pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            raise RuntimeError("hf_cpu: finish_weight_update without begin_weight_update")
        async with self._get_lock():
            state = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in pending.items():
                    target = state[name]
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(
                            f"hf_cpu: weight {name} has shape {tuple(tensor.shape)}, rollout model expects "
                            f"{tuple(target.shape)}"
                        )
                    target.copy_(tensor.to(dtype=target.dtype))
            self.weight_version += 1
            self.stats["weight_updates"] += 1
            if global_steps is not None:
                self.global_steps = global_steps
        if self.rollout_mode == RolloutMode.STANDALONE:  # hybrid replicas' updates are logged by the actor rank
            logger.info(
                "hf_cpu replica %d: loaded %d tensors (global_steps=%s)", self.replica_rank, len(pending), global_steps
            )
        return len(pending)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The rollout model's current weights (for tests)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    # -- generation ----------------------------------------------------------------------

    def _get_lock(self) -> asyncio.Lock:
        if self._model_lock is None:
            self._model_lock = asyncio.Lock()
        return self._model_lock

    def _max_tokens(self, prompt_len: int, params: dict[str, Any]) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt of {prompt_len} tokens leaves no room to generate within max_model_len={self.max_model_len}"
            )
        if "max_tokens" in params:
            wanted = int(params["max_tokens"])
        elif "max_new_tokens" in params:
            wanted = int(params["max_new_tokens"])
        else:
            wanted = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len
            )
        return max(1, min(wanted, room))

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: Optional[str] = None,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Generate one continuation (batched with concurrent requests); see docs/cpu_platform.md for aborts."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("hf_cpu rollout is text-only")
        kwargs.pop("priority", None)
        if kwargs:
            raise NotImplementedError(f"hf_cpu rollout does not support generate arguments {sorted(kwargs)}")
        from verl.utils import normalize_token_ids

        prompt = list(normalize_token_ids(prompt_ids))
        params = dict(sampling_params)
        spec = sampling_spec_from_params(params)
        max_tokens = self._max_tokens(len(prompt), params)
        if not await self._admitted_or_rejected():
            return _token_output(GenerationResult([], [] if spec.want_logprobs else None, "abort", None))
        # no await from the gate check to the queue: abort_all_requests sees every admitted request
        loop = asyncio.get_running_loop()
        request = GenerationRequest(prompt, spec, max_tokens, request_id, loop.create_future())
        self._admitted.add(request)
        request.future.add_done_callback(lambda _: self._admitted.discard(request))
        self._queue.append(request)
        self.stats["requests"] += 1
        if self._batcher is None or self._batcher.done():
            self._wakeup = asyncio.Event()
            self._batcher = loop.create_task(self._run_batches())
        self._wakeup.set()
        return _token_output(await request.future)

    async def _run_batches(self) -> None:
        """Background task: gather queued requests, group by sampling spec, generate in a thread."""
        assert self._wakeup is not None
        max_batch = max(1, int(self.config.max_num_seqs))
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(self.batch_wait_s)  # let concurrent requests of the same wave arrive
            while self._queue:
                taken, self._queue = self._queue[:max_batch], self._queue[max_batch:]
                groups: dict[SamplingSpec, list[GenerationRequest]] = {}
                for req in taken:
                    groups.setdefault(req.spec, []).append(req)
                for spec, reqs in groups.items():
                    try:
                        async with self._get_lock():
                            results = await asyncio.to_thread(self._generate_sync, reqs, spec)
                    except BaseException as exc:  # hand the error to every caller, keep serving
                        for req in reqs:
                            if not req.future.done():
                                req.future.set_exception(exc)
                        if isinstance(exc, asyncio.CancelledError):
                            raise
                        continue
                    for req, result in zip(reqs, results, strict=True):
                        if not req.future.done():
                            req.future.set_result(result)

    def _generate_sync(self, reqs: list[GenerationRequest], spec: SamplingSpec) -> list[GenerationResult]:
        version = self.global_steps  # under the model lock: the weights cannot change during the batch
        results = generate_batch(
            self.model,
            [r.prompt_ids for r in reqs],
            [r.max_tokens for r in reqs],
            spec,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            generator=self.generator,
            ignore_eos=bool(self.config.ignore_eos),
            logprobs_mode=str(self.config.logprobs_mode or "processed_logprobs"),
            should_stop=self._stop_decoding.is_set,
        )
        self.stats["batches"] += 1
        self.stats["generated_tokens"] += sum(len(t) for t, _, _ in results)
        return [GenerationResult(tokens, logprobs, finish, version) for tokens, logprobs, finish in results]


__all__ = ["GenerationRequest", "GenerationResult", "HFCpuServer", "STOP_REASONS", "eos_token_ids", "load_hf_model"]
