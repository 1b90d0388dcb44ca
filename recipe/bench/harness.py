"""verl 0.9.1's real actor training stack on CPU, for tests and benchmarks: its own ``TrainingWorker`` built
without Ray, so only the dispatch layer is skipped; no downloads. Importing registers the ``cpu`` platform but
does not select it (:func:`select_cpu_platform`, called by :mod:`recipe.bench.ranks`, does).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl_ext.cpu.platform import register_cpu_platform

register_cpu_platform()


def select_cpu_platform() -> None:
    """Select verl's ``cpu`` platform for this process (must precede verl's first ``get_platform()``)."""
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    register_cpu_platform()


FP32_MIXED_PRECISION: dict[str, str] = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
"""FSDP mixed-precision setting for exact comparisons (verl's default computes in bf16)."""


@dataclass(frozen=True)
class TinyQwen3Spec:
    """Shape of the random-weight Qwen3 model. Defaults: ~50K parameters, builds in < 1 s."""

    vocab_size: int = 512
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class BenchMicroBatch:
    """The model and the one micro-batch of an engine benchmark (see :func:`bench_micro_batch`)."""

    spec: TinyQwen3Spec
    sequences: int
    prompt_len: int
    response_len: int

    @property
    def prompt_lens(self) -> list[int]:
        """Per-sequence prompt lengths, as :func:`make_rollout_batch` takes them."""
        return [self.prompt_len] * self.sequences

    @property
    def response_lens(self) -> list[int]:
        """Per-sequence response lengths, as :func:`make_rollout_batch` takes them."""
        return [self.response_len] * self.sequences


def bench_micro_batch(tokens: int, sequences: int, vocab: int, hidden: int) -> BenchMicroBatch:
    """The tiny Qwen3 and the micro-batch that the engine benchmarks (``entropy-memory``, ``full-kl``,
    ``onpolicy --cost``) build from their ``--tokens``/``--sequences``/``--vocab``/``--hidden``: equal
    sequences, each a quarter prompt, and a small body, since the ``tokens x vocab`` logits dominate the
    memory they compare. Bad sizes raise a ``ValueError`` naming the options.
    """
    if tokens < 1 or sequences < 1:
        raise ValueError(f"--tokens ({tokens}) and --sequences ({sequences}) must be positive")
    if tokens % sequences:
        raise ValueError(f"--tokens ({tokens}) must be divisible by --sequences ({sequences})")
    seq_len = tokens // sequences
    if seq_len < 2:
        raise ValueError(
            f"--tokens ({tokens}) / --sequences ({sequences}) leaves fewer than 2 tokens per sequence "
            "(one prompt and one response token at least)"
        )
    prompt_len = max(1, seq_len // 4)
    spec = TinyQwen3Spec(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max(8192, seq_len),
    )
    return BenchMicroBatch(spec=spec, sequences=sequences, prompt_len=prompt_len, response_len=seq_len - prompt_len)


def save_tiny_qwen3(
    path: str | os.PathLike[str], spec: TinyQwen3Spec = TinyQwen3Spec(), seed: int = 0, head_scale: float = 1.0
) -> str:
    """Write a random-weight Qwen3 checkpoint (config + safetensors) to ``path`` for verl's engine to load;
    return the path. A large ``head_scale`` makes the policy confident (many tokens at an entropy of 1e-6 nats or
    less, as a trained reasoning model's, where bf16 entropy formulas break down).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**asdict(spec))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return str(out)


@dataclass
class WorkerOptions:
    """Knobs of :func:`build_actor_worker`, named after the verl config keys they set."""

    use_remove_padding: bool = True  # actor_rollout_ref.model.use_remove_padding
    micro_batch_size_per_gpu: int = 2  # actor.ppo_micro_batch_size_per_gpu
    use_dynamic_bsz: bool = False  # actor.use_dynamic_bsz
    max_token_len_per_gpu: int = 16384  # actor.ppo_max_token_len_per_gpu
    infer_max_token_len_per_gpu: Optional[int] = None  # rollout.log_prob_max_token_len_per_gpu (None: as above)
    infer_micro_batch_size_per_gpu: Optional[int] = None  # rollout.log_prob_micro_batch_size_per_gpu (None: as above)
    mixed_precision: Optional[dict[str, str]] = field(default_factory=lambda: dict(FP32_MIXED_PRECISION))
    optimizer: str = "AdamW"  # actor.optim.optimizer ("SGD" makes the update exactly -lr * grad)
    lr: float = 1e-2  # actor.optim.lr
    weight_decay: float = 0.0  # actor.optim.weight_decay
    clip_grad: float = 1.0  # actor.optim.clip_grad
    entropy_from_logits_with_chunking: bool = False  # actor.fsdp_config.entropy_from_logits_with_chunking
    entropy_checkpointing: bool = False  # actor.fsdp_config.entropy_checkpointing
    enable_gradient_checkpointing: bool = False  # actor_rollout_ref.model.enable_gradient_checkpointing
    attn_implementation: str = "sdpa"  # flash-attn does not exist on CPU
    seed: int = 42
    device: str = "cpu"  # verl platform the worker must run on ("cuda" for the GPU probe)
    use_torch_compile: bool = False  # actor.fsdp_config.use_torch_compile (verl's GPU default: True)
    use_fused_kernels: bool = False  # actor_rollout_ref.model.use_fused_kernels
    # actor_rollout_ref.model.fused_kernel_options.impl_backend (verl's yaml default)
    fused_kernels_backend: str = "torch"
    ulysses_sequence_parallel_size: int = 1  # actor.fsdp_config.ulysses_sequence_parallel_size
    strategy: str = "fsdp2"  # actor.strategy: "fsdp" is FSDP1 (GPU only in verl 0.9.1), "fsdp2" FSDP2
    lora_rank: int = 0  # actor_rollout_ref.model.lora_rank (> 0: verl wraps the model in a peft LoRA adapter)
    lora_alpha: int = 16  # actor_rollout_ref.model.lora_alpha
    target_modules: Any = "all-linear"  # actor_rollout_ref.model.target_modules (a name or a list of module names)
    model_type: str = "language_model"  # TrainingWorkerConfig.model_type: "value_model" builds verl's critic


def build_actor_worker(model_path: str, options: Optional[WorkerOptions] = None) -> Any:
    """Build and initialise verl's ``TrainingWorker`` for the actor (``options=None``: ``WorkerOptions()``), with
    the engine seam installed as a training run's actor worker has it.

    Needs the ``RANK``/``WORLD_SIZE``/``MASTER_*`` environment (:func:`recipe.bench.ranks.single_rank_env`, or the
    tests' ``run_ranks``). The value head and ``lora_A`` come from torch's global generator: seed it before
    building two workers that must start equal.
    """
    options = WorkerOptions() if options is None else options
    from verl.plugin.platform import get_platform

    from verl_ext.engine import seam

    seam.install()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    if get_platform().device_name != options.device:
        raise RuntimeError(
            f"verl resolved platform {get_platform().device_name!r}, the worker wants {options.device!r}: on CPU, "
            "import the harness (which selects VERL_PLATFORM=cpu) before anything calls verl's get_platform()."
        )
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=options.use_remove_padding,
        enable_gradient_checkpointing=options.enable_gradient_checkpointing,
        override_config={"attn_implementation": options.attn_implementation},
        use_fused_kernels=options.use_fused_kernels,
        # verl's yaml sets impl_backend: torch; HFModelConfig's dataclass default ({}) skips the fused
        # forward patch, and the engine then fails reading output.log_probs.
        fused_kernel_options={"impl_backend": options.fused_kernels_backend},
        lora_rank=options.lora_rank,
        lora_alpha=options.lora_alpha,
        target_modules=options.target_modules,
    )
    engine_config = FSDPEngineConfig(
        strategy=options.strategy,
        use_torch_compile=options.use_torch_compile,  # off by default: inductor on CPU compiles C++ for minutes
        mixed_precision=options.mixed_precision,
        use_dynamic_bsz=options.use_dynamic_bsz,
        max_token_len_per_gpu=options.max_token_len_per_gpu,
        micro_batch_size_per_gpu=options.micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=options.infer_max_token_len_per_gpu or options.max_token_len_per_gpu,
        infer_micro_batch_size_per_gpu=options.infer_micro_batch_size_per_gpu or options.micro_batch_size_per_gpu,
        entropy_from_logits_with_chunking=options.entropy_from_logits_with_chunking,
        entropy_checkpointing=options.entropy_checkpointing,
        ulysses_sequence_parallel_size=options.ulysses_sequence_parallel_size,
        seed=options.seed,
    )
    optimizer_config = FSDPOptimizerConfig(
        optimizer=options.optimizer, lr=options.lr, weight_decay=options.weight_decay, clip_grad=options.clip_grad
    )
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type=options.model_type,
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=CheckpointConfig(),
        )
    )
    value_model = options.model_type == "value_model"
    with _value_model_attention(options.attn_implementation) if value_model else nullcontext():
        worker.reset()  # TrainingWorker builds the model/optimizer here (Engine.initialize)
    return worker


@contextmanager
def _value_model_attention(attn_implementation: str) -> Iterator[None]:
    """While verl builds a critic, load it with ``attn_implementation`` where verl 0.9.1's
    ``load_valuehead_model`` hard-codes ``flash_attention_2``."""
    from transformers import AutoModelForTokenClassification as auto_class

    own = vars(auto_class).get("from_pretrained")  # transformers 5 sets it on each auto class
    original = auto_class.from_pretrained  # the classmethod, bound to the auto class

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attn_implementation") == "flash_attention_2":
            kwargs["attn_implementation"] = attn_implementation
        return original(*args, **kwargs)

    auto_class.from_pretrained = from_pretrained  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del auto_class.from_pretrained
        else:
            auto_class.from_pretrained = own  # type: ignore[method-assign]


def make_actor_config(**overrides: Any) -> Any:
    """An ``FSDPActorConfig`` for loss functions (``ppo_loss``-style ``config=``). Defaults: fsdp2,
    fixed micro-batches, token-mean aggregation, vanilla PPO clip 0.2."""
    from verl.workers.config import FSDPActorConfig

    kwargs: dict[str, Any] = dict(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False, rollout_n=1
    )
    kwargs.update(overrides)
    return FSDPActorConfig(**kwargs)


def ppo_loss_fn(actor_config: Any) -> Callable[..., Any]:
    """verl's own ``ppo_loss`` bound to ``actor_config``, as ``ActorRolloutRefWorker`` installs it."""
    from verl.workers.utils.losses import ppo_loss

    return functools.partial(ppo_loss, config=actor_config)


def _nested(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)


def make_rollout_batch(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    vocab_size: int,
    seed: int = 0,
    old_entropy: Optional[Sequence[torch.Tensor]] = None,
    old_log_probs: Optional[Sequence[torch.Tensor]] = None,
    advantages: Optional[Sequence[torch.Tensor]] = None,
) -> TensorDict:
    """A batch in verl's no-padding layout, as the v1 trainer passes it to ``update_actor``.

    Per-response tensors not given (as one 1-D tensor per sample) are random: ``old_log_probs`` in [-6, -3],
    ``advantages`` ~ N(0, 1), ``entropy`` (pi_old) in [0.5 ln V, ln V].
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"prompt_lens ({len(prompt_lens)}) and response_lens ({len(response_lens)}) differ")
    if min(prompt_lens) < 1 or min(response_lens) < 1:
        raise ValueError("every prompt and response needs at least one token (verl's no_padding_2_padding)")
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (p,), generator=gen) for p in prompt_lens]
    responses = [torch.randint(0, vocab_size, (r,), generator=gen) for r in response_lens]
    log_v = float(torch.log(torch.tensor(float(vocab_size))))
    if old_log_probs is None:
        old_log_probs = [-3.0 - 3.0 * torch.rand(r, generator=gen) for r in response_lens]
    if advantages is None:
        advantages = [torch.randn(r, generator=gen) for r in response_lens]
    if old_entropy is None:
        old_entropy = [log_v * (0.5 + 0.5 * torch.rand(r, generator=gen)) for r in response_lens]
    masks = [torch.ones(r, dtype=torch.int64) for r in response_lens]
    return TensorDict(
        {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "input_ids": _nested([torch.cat([p, r]) for p, r in zip(prompts, responses, strict=False)]),
            "position_ids": _nested([torch.arange(p + r) for p, r in zip(prompt_lens, response_lens, strict=False)]),
            "response_mask": _nested(masks),
            "loss_mask": _nested([m.clone() for m in masks]),
            "old_log_probs": _nested([t.float() for t in old_log_probs]),
            "advantages": _nested([t.float() for t in advantages]),
            "entropy": _nested([t.float() for t in old_entropy]),
        },
        batch_size=[len(prompt_lens)],
    )


@contextmanager
def bench_worker(shape: BenchMicroBatch, options: WorkerOptions, prefix: str) -> Iterator[tuple[Any, TensorDict]]:
    """An engine benchmark's actor worker (``options``) on ``shape``'s tiny Qwen3, saved in a temporary folder
    (``prefix``) for the block, and ``shape``'s micro-batch (seed 0)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        worker = build_actor_worker(save_tiny_qwen3(tmp, shape.spec, seed=0), options)
        yield worker, make_rollout_batch(shape.prompt_lens, shape.response_lens, shape.spec.vocab_size, seed=0)


def update_actor(
    worker: Any,
    batch: TensorDict,
    *,
    calculate_entropy: bool,
    global_batch_size: Optional[int] = None,
    temperature: float = 1.0,
    mini_batch_size: Optional[int] = None,
    epochs: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    extra_info: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """One actor update on this rank's shard, mirroring ``trainer/ppo/v1/trainer_base.py::_update_actor``;
    returns the metrics.

    By default the shard is one mini-batch; ``mini_batch_size`` (global, like ``ppo_mini_batch_size *
    rollout.n``), ``epochs``, ``shuffle`` and ``seed`` (``actor.data_loader_seed``) split it as the trainer does.
    ``extra_info``: more non-tensor keys, as ``recipe.trainer.DivClipTrainer._update_actor`` adds them.
    """
    from verl.utils import tensordict_utils as tu

    data = batch.clone()
    n_local = data.batch_size[0]
    world = torch.distributed.get_world_size()
    global_bs = int(mini_batch_size or global_batch_size or n_local * world)
    tu.assign_non_tensor(
        data,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=global_bs,
        mini_batch_size=global_bs,
        epochs=epochs,
        seed=seed,
        dataloader_kwargs={"shuffle": shuffle},
        temperature=temperature,
        **(extra_info or {}),
    )
    output = worker.train_mini_batch(data)
    return {} if output is None else dict(tu.get(output, "metrics"))  # None: an SP peer's rank


def compute_log_prob(
    worker: Any,
    batch: TensorDict,
    temperature: float = 1.0,
    packing: Any = None,
    old_topk: int = 0,
    old_from_update: bool = False,
    collect: bool = False,
) -> Optional[dict[str, torch.Tensor]]:
    """pi_old pass, mirroring ``_compute_old_log_prob``: this rank's response-layout nested ``old_log_probs`` and
    ``entropy`` (None on a rank whose SP group's output another rank collects).

    As ``DivClipTrainer`` asks it: ``packing`` (a ``verl_ext.engine.packing.UpdatePacking``; None: one
    mini-batch), ``old_topk > 0`` pi_old's top-k for ``kl_full`` (returned too), ``old_from_update`` and
    ``collect`` (:mod:`verl_ext.engine.old_from_update`).
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_from_nested

    from verl_ext.engine.old_from_update import COLLECT_KEY, OLD_FROM_UPDATE_KEY
    from verl_ext.engine.topk_capture import CAPTURE_KEY, OLD_TOPK_IDS, OLD_TOPK_LOG_PROBS

    data = batch.clone()
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, temperature=temperature)
    if packing is not None:
        tu.assign_non_tensor(data, **packing.as_extra_info())
    if old_topk:
        tu.assign_non_tensor(data, **{CAPTURE_KEY: int(old_topk)})
    if old_from_update:
        tu.assign_non_tensor(data, **{OLD_FROM_UPDATE_KEY: True})
    if collect:
        tu.assign_non_tensor(data, **{COLLECT_KEY: True})
    output = worker.infer_batch(data)
    if output is None:  # not the rank that collects its group's output (e.g. a Ulysses SP peer)
        return None
    result = {
        "old_log_probs": response_from_nested(output["log_probs"], batch["response_mask"]),
        "entropy": response_from_nested(output["entropy"], batch["response_mask"]),
    }
    if old_topk:
        result.update({key: output[key] for key in (OLD_TOPK_LOG_PROBS, OLD_TOPK_IDS)})
    return result


def with_old(batch: TensorDict, old: dict[str, torch.Tensor]) -> TensorDict:
    """A copy of ``batch`` with :func:`compute_log_prob`'s outputs set on it (``old_log_probs``, ``entropy``, and
    pi_old's top-k where asked), as the trainer hands them to the update."""
    data = batch.clone()
    for key, value in old.items():
        data[key] = value
    return data


def full_params(worker: Any) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of the actor's parameters. Collective under FSDP2: call on all ranks."""
    out: dict[str, torch.Tensor] = {}
    for name, param in worker.engine.module.named_parameters():
        data = param.detach()
        if hasattr(data, "full_tensor"):
            data = data.full_tensor()
        out[name] = data.clone()
    return out
