"""``hf_cpu``: a CPU rollout backend for verl 0.9.1 built on Hugging Face transformers.

verl 0.9.1 only generates through inference *servers* (vLLM, SGLang, TensorRT-LLM), all of which
need an accelerator here (vLLM's CPU build needs a torch wheel that is not on PyPI). This module
adds a small server that runs the policy with plain ``transformers`` on CPU and plugs it into the
three seams verl uses for its own backends, so the v1 trainer runs unchanged:

1. :class:`HFCpuReplica` (a ``RolloutReplica``) registered in ``RolloutReplicaRegistry`` as
   ``hf_cpu``. ``LLMServerManager`` builds one replica per ``rollout.tensor_model_parallel_size``
   actor ranks and calls ``init_hybrid(actor_worker_group)``; :meth:`HFCpuReplica.launch_servers`
   starts one :class:`HFCpuServer` Ray actor on the node of the replica's first actor worker
   (``NodeAffinitySchedulingStrategy``, as ``vLLMReplica`` does), named
   ``hf_cpu_server_<replica_rank>_0``.
2. :class:`HFCpuServerAdapter` (a ``BaseRollout``) registered in ``_ROLLOUT_REGISTRY`` under
   ``("hf_cpu", "async")``. ``ActorRolloutRefWorker.init_model`` builds it inside each actor
   worker (``get_rollout_class``), exactly where it builds vLLM's ``ServerAdapter``.
3. Weight sync. The sync trainer calls ``CheckpointEngineManager.update_weights`` after every
   step (backend ``naive``), which calls ``ActorRolloutRefWorker.update_weights`` on every actor
   rank, which streams ``engine.get_per_tensor_param()`` into ``self.rollout.update_weights``:
   our adapter. Every rank iterates the generator (each ``full_tensor()`` is an FSDP
   collective); the replica's leader rank copies the tensors to CPU and ships them to its server
   in buckets of ``checkpoint_engine.update_weights_bucket_megabytes`` through the Ray object
   store (vLLM uses CUDA IPC at this point), and the server copies them into its model. So the
   rollout policy is the actor's policy after every update, at the place verl syncs vLLM.

The server batches concurrent requests (the agent loop sends one request per sample): requests
that arrive within ``HF_CPU_BATCH_WAIT_S`` (default 5 ms) of each other and share sampling
parameters are generated together, left-padded, with a KV cache (:mod:`verl_ext.cpu.sampling`).
Sampling follows vLLM's semantics as verl uses them: ``temperature == 0`` is greedy, ``top_k <= 0`` / ``top_p == 1`` are
off, ``max_tokens`` defaults to ``min(response_length, prompt_length + response_length - len(prompt))``,
generation stops at the model's EOS ids unless ``rollout.ignore_eos``, and ``logprobs=True``
returns the log-probability of each sampled token under ``rollout.logprobs_mode``
(``processed_logprobs``, the default: after temperature/top-k/top-p, i.e. the distribution the
token was drawn from; ``raw_logprobs``: the model's log-softmax).

Not supported (fails loudly): multimodal inputs, LoRA adapters synced unmerged
(``peft_config``; use ``model.lora.merge=True``), delta checkpoint engines, tensor/pipeline
parallel rollout (``tensor_model_parallel_size`` must be 1), HTTP/OpenAI chat endpoints (the
server is token-in/token-out over Ray only; ``server_address`` is a label, not a URL).

The server shares its node's cores with the colocated trainer the way vLLM shares the GPU in
verl's hybrid mode: it asks Ray for no CPU (``num_cpus=0``) so it never competes with the actor
workers for the resource pool, and uses ``HF_CPU_NUM_THREADS`` torch threads (default 1).
"""

from __future__ import annotations

import threading
from typing import Any

ROLLOUT_NAME = "hf_cpu"
"""Value of ``actor_rollout_ref.rollout.name`` that selects this backend."""

SERVER_NAME_PREFIX = f"{ROLLOUT_NAME}_server_"
_ADAPTER_FQN = f"{__name__}.HFCpuServerAdapter"
_lock = threading.Lock()


# ----------------------------------------------------------------------------------------------
# Registration. Defined before the module imports verl: importing this module can itself trigger
# ``import verl``, whose ``verl.plugins`` entry point calls register_cpu_rollout() on this
# still-initialising module; verl's registries hold a loader and a dotted path, resolved later.
# ----------------------------------------------------------------------------------------------


def _load_replica() -> type:
    return HFCpuReplica


def register_cpu_rollout() -> None:
    """Register ``hf_cpu`` with verl's rollout registries. Idempotent; cheap (no model is loaded).

    Must run in every process that resolves the rollout by name: the trainer process
    (``LLMServerManager`` -> ``RolloutReplicaRegistry``) and the actor workers
    (``get_rollout_class`` -> ``_ROLLOUT_REGISTRY``); the ``verl.plugins`` entry point does.
    """
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    with _lock:
        existing = _ROLLOUT_REGISTRY.get((ROLLOUT_NAME, "async"))
        if existing not in (None, _ADAPTER_FQN):
            raise RuntimeError(f"rollout ({ROLLOUT_NAME!r}, 'async') already registered to {existing}")
        _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = _ADAPTER_FQN
        RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)


import asyncio  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import AsyncIterator, Generator, Optional  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from verl.workers.rollout.base import BaseRollout  # noqa: E402
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput  # noqa: E402

from verl_ext.cpu.sampling import SamplingSpec, generate_batch, sampling_spec_from_params  # noqa: E402

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


@dataclass
class GenerationRequest:
    """One queued request and the future its caller awaits."""

    prompt_ids: list[int]
    spec: SamplingSpec
    max_tokens: int
    future: asyncio.Future = field(repr=False)


# ----------------------------------------------------------------------------------------------
# The policy copy the server generates with
# ----------------------------------------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    from verl.utils.torch_dtypes import PrecisionType

    return PrecisionType.to_dtype(name)


def load_hf_model(model_path: str, dtype: str = "float32", trust_remote_code: bool = False, override_config: Optional[dict] = None) -> torch.nn.Module:
    """Load the policy for generation on CPU (``sdpa`` attention, eval mode, no grad)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    for key, value in (override_config or {}).items():
        if key != "attn_implementation" and hasattr(config, key):
            setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        config=config,
        dtype=_torch_dtype(dtype),
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


# ----------------------------------------------------------------------------------------------
# The server (a Ray actor)
# ----------------------------------------------------------------------------------------------


class HFCpuServer:
    """Token-in/token-out generation server holding a transformers copy of the policy on CPU.

    Implements the methods verl calls on a rollout server handle: ``generate`` (agent loop, via
    ``LLMServerClient``), ``wake_up``/``sleep``/``clear_kv_cache``/``release_kv_cache``/
    ``resume_kv_cache``/``abort_all_requests``/``resume_generation``/``start_profile``/
    ``stop_profile`` (``RolloutReplica`` and the checkpoint-engine manager), ``set_global_steps``,
    plus the weight-loading calls of :class:`HFCpuServerAdapter`.
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

        # RolloutReplica passes the rollout config as a dataclass and the model config as the raw
        # DictConfig (as for vLLM's server, which converts it the same way).
        self.config = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        if self.config.tensor_model_parallel_size != 1 or self.config.pipeline_model_parallel_size != 1:
            raise NotImplementedError(
                "hf_cpu rollout runs one process per replica: set actor_rollout_ref.rollout."
                "tensor_model_parallel_size=1 (and pipeline_model_parallel_size=1)"
            )
        torch.set_num_threads(int(num_threads or os.environ.get("HF_CPU_NUM_THREADS", 1)))
        self.batch_wait_s = float(batch_wait_s if batch_wait_s is not None else os.environ.get("HF_CPU_BATCH_WAIT_S", 0.005))
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
        self._wakeup: Optional[asyncio.Event] = None
        self._batcher: Optional[asyncio.Task] = None
        self._model_lock: Optional[asyncio.Lock] = None
        self._pending_weights: Optional[dict[str, torch.Tensor]] = None
        self._param_names = {name for name, _ in self.model.named_parameters()} | {name for name, _ in self.model.named_buffers()}
        self.stats = {"requests": 0, "batches": 0, "generated_tokens": 0, "weight_updates": 0}

    # -- address / lifecycle -------------------------------------------------------------

    def get_server_address(self) -> tuple[str, int]:
        """A label for verl's load balancer (it keys servers by address); there is no HTTP server."""
        return f"{ROLLOUT_NAME}-replica-{self.replica_rank}", 0

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Nothing to restore: weights and cache stay in host memory."""
        return None

    async def sleep(self) -> None:
        """Nothing to free: host memory is not handed to the trainer the way GPU memory is."""
        return None

    async def clear_kv_cache(self) -> None:
        """The KV cache lives only for one batch, so there is nothing to clear."""
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self._queue:
            await asyncio.sleep(0.01)
        if self._model_lock is not None:
            async with self._model_lock:
                pass

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Sync training never aborts; requests in flight simply finish (nothing is partial)."""
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def set_global_steps(self, global_steps: int) -> None:
        """Record the trainer step of the current weights (returned with each output)."""
        self.global_steps = global_steps

    def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "weight_version": self.weight_version, "global_steps": self.global_steps}

    # -- weights -------------------------------------------------------------------------

    async def begin_weight_update(self) -> None:
        """Start a weight update; tensors arrive in buckets and are applied at the end."""
        self._pending_weights = {}

    async def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        if self._pending_weights is None:
            raise RuntimeError("hf_cpu: load_weight_bucket before begin_weight_update")
        for name, tensor in bucket:
            if name not in self._param_names:
                raise KeyError(f"hf_cpu: actor sent weight {name!r}, which the rollout model does not have")
            self._pending_weights[name] = tensor
        return len(bucket)

    async def finish_weight_update(self, global_steps: Optional[int] = None) -> int:
        """Copy the received tensors into the model (under the model lock); return how many."""
        pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            raise RuntimeError("hf_cpu: finish_weight_update without begin_weight_update")
        lock = self._get_lock()
        async with lock:
            state = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in pending.items():
                    target = state[name]
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(f"hf_cpu: weight {name} has shape {tuple(tensor.shape)}, rollout model expects {tuple(target.shape)}")
                    target.copy_(tensor.to(dtype=target.dtype))
        self.weight_version += 1
        self.stats["weight_updates"] += 1
        if global_steps is not None:
            self.global_steps = global_steps
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
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate within max_model_len={self.max_model_len}")
        if "max_tokens" in params:
            wanted = int(params["max_tokens"])
        elif "max_new_tokens" in params:
            wanted = int(params["max_new_tokens"])
        else:
            wanted = min(self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len)
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
        """Generate one continuation (batched with concurrent requests)."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("hf_cpu rollout is text-only")
        kwargs.pop("priority", None)
        if kwargs:
            raise NotImplementedError(f"hf_cpu rollout does not support generate arguments {sorted(kwargs)}")
        from verl.utils import normalize_token_ids

        prompt = list(normalize_token_ids(prompt_ids))
        params = dict(sampling_params)
        spec = sampling_spec_from_params(params)
        loop = asyncio.get_running_loop()
        request = GenerationRequest(prompt, spec, self._max_tokens(len(prompt), params), loop.create_future())
        self._queue.append(request)
        self.stats["requests"] += 1
        if self._batcher is None or self._batcher.done():
            self._wakeup = asyncio.Event()
            self._batcher = loop.create_task(self._run_batches())
        self._wakeup.set()
        tokens, logprobs, finish = await request.future
        return TokenOutput(
            token_ids=tokens,
            log_probs=logprobs,
            stop_reason="completed" if finish in ("stop", "length") else finish,
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps},
        )

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

    def _generate_sync(self, reqs: list[GenerationRequest], spec: SamplingSpec) -> list[tuple[list[int], Optional[list[float]], str]]:
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
        )
        self.stats["batches"] += 1
        self.stats["generated_tokens"] += sum(len(t) for t, _, _ in results)
        return results


# ----------------------------------------------------------------------------------------------
# The adapter in the actor worker (BaseRollout) and the replica (RolloutReplica)
# ----------------------------------------------------------------------------------------------


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """Ray actor name of a replica's server (how the adapter finds it, as vLLM's adapter does)."""
    return f"{SERVER_NAME_PREFIX}{replica_rank}_{node_rank}"


class HFCpuServerAdapter(BaseRollout):
    """The rollout object inside each actor worker: forwards weights to the replica's server.

    Built by ``ActorRolloutRefWorker.init_model`` through ``get_rollout_class("hf_cpu", "async")``
    (or by ``CheckpointEngineWorker`` in standalone mode). ``update_weights`` is called with the
    actor engine's ``get_per_tensor_param()`` generator on every actor rank after each training
    step (sync trainer: ``CheckpointEngineManager.update_weights`` -> ``ActorRolloutRefWorker.
    update_weights``).
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        if self.config.tensor_model_parallel_size != 1 or self.config.pipeline_model_parallel_size != 1:
            raise NotImplementedError("hf_cpu rollout: set actor_rollout_ref.rollout.tensor_model_parallel_size=1")
        rank = int(os.environ.get("RANK", "0"))
        rollout_world_size = self.config.tensor_model_parallel_size * self.config.data_parallel_size * self.config.pipeline_model_parallel_size
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.is_leader_rank = self.rollout_rank == 0
        self.server_handle: Optional[ray.actor.ActorHandle] = None
        self.sleep_level = 1

    def _server(self) -> Optional[ray.actor.ActorHandle]:
        if not self.is_leader_rank:
            return None
        if self.server_handle is None:
            # The server is launched after the hybrid engine, so look it up lazily (as vLLM does).
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        server = self._server()
        if server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        server = self._server()
        if server is not None:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None] | AsyncIterator[tuple[str, torch.Tensor]],
        global_steps: Optional[int] = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        """Stream ``(name, full_tensor)`` pairs to the server in buckets, then apply them.

        Every rank must exhaust ``weights``: with FSDP each item is produced by a collective
        (``DTensor.full_tensor``). Only the replica's leader rank sends.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf_cpu rollout only takes wire_format='named_tensors', got {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("hf_cpu rollout cannot load LoRA adapters; set actor_rollout_ref.model.lora.merge=True")
        from verl.workers.rollout.utils import ensure_async_iterator

        start = time.time()
        server = self._server()
        bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20
        if server is not None:
            await server.begin_weight_update.remote()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        sent = 0
        async for name, tensor in ensure_async_iterator(weights):
            if server is None:
                continue  # still iterate: the generator's collectives need every rank
            cpu = tensor.detach().to("cpu", copy=True).contiguous()
            bucket.append((name, cpu))
            size += cpu.numel() * cpu.element_size()
            if size >= bucket_bytes:
                sent += await server.load_weight_bucket.remote(bucket)
                bucket, size = [], 0
        if server is not None:
            if bucket:
                sent += await server.load_weight_bucket.remote(bucket)
            applied = await server.finish_weight_update.remote(global_steps)
            if self.replica_rank == 0:
                logger.info("hf_cpu update_weights: %d tensors in %.2fs (global_steps=%s)", applied, time.time() - start, global_steps)

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError("hf_cpu is a server backend: generation goes through HFCpuReplica / LLMServerClient")


class HFCpuReplica(RolloutReplica):
    """verl ``RolloutReplica`` for the ``hf_cpu`` backend: one :class:`HFCpuServer` per replica."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.world_size != 1:
            raise NotImplementedError(
                "hf_cpu rollout: each replica is one process; set actor_rollout_ref.rollout."
                f"tensor_model_parallel_size/data_parallel_size/pipeline_model_parallel_size to 1 (world size {self.world_size})"
            )
        self.server_class = ray.remote(HFCpuServer)

    async def launch_servers(self) -> None:
        """Start the server actor on the node of this replica's first worker."""
        if self.is_reward_model or self.is_teacher_model:
            raise NotImplementedError("hf_cpu rollout serves the policy only (no reward/teacher model servers)")
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        else:
            node_id = ray.get_runtime_context().get_node_id()
        name = server_actor_name(self.replica_rank) + self.name_suffix
        server = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            name=name,
            num_cpus=0,
            max_concurrency=self.max_concurrency,
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
        )
        self.servers = [server]
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{address}:{port}"


__all__ = [
    "ROLLOUT_NAME",
    "HFCpuReplica",
    "HFCpuServer",
    "HFCpuServerAdapter",
    "eos_token_ids",
    "load_hf_model",
    "register_cpu_rollout",
    "server_actor_name",
]
