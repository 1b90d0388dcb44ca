"""What the GPU probe (:mod:`recipe.bench.gpu`) and the GPU acceptance (:mod:`recipe.bench.acceptance`) share:
the model, the strategies, the losses and the measurements; below both, so neither imports the other.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from recipe.bench.child import subset

STRATEGIES = ("fsdp", "fsdp2")
"""``actor.strategy``: verl 0.9.1 builds ``fsdp`` (what the launch scripts resolve to) as FSDP1 and
``fsdp2`` as FSDP2; only FSDP2 runs on the CPU platform."""

R1_DISTILL_QWEN_1_5B: dict[str, Any] = dict(  # DeepSeek-R1-Distill-Qwen-1.5B's config.json (Qwen2 architecture)
    vocab_size=151_936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=131_072,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def build_model(path: Path, args: argparse.Namespace) -> None:
    """Write a random-weight Qwen2 model of ``args``' shape to ``path`` (bf16 safetensors); ``--layers`` and
    ``--hidden`` left ``None`` keep R1-Distill-Qwen-1.5B's, ``--head-scale`` makes most tokens confident."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(R1_DISTILL_QWEN_1_5B)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    if args.hidden is not None:
        shape.update(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_attention_heads=max(1, args.hidden // 128),
            num_key_value_heads=1,
        )
    shape["vocab_size"] = args.vocab
    torch.manual_seed(0)
    device = "cuda" if args.device == "cuda" else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    with torch.no_grad():
        model.lm_head.weight.mul_(args.head_scale)
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    if device == "cuda":  # the children measure the GPU: hand the parent's cached blocks back
        torch.cuda.empty_cache()


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options the probe and the acceptance share: the device and strategies, the micro-batch, the model
    :func:`build_model` writes, ``kl_full_top_k``, and the two a child gets from its parent."""
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated subset of {list(STRATEGIES)} (default: both on cuda, fsdp2 on cpu)",
    )
    parser.add_argument("--tokens", type=int, default=16_384, help="tokens in the update's micro-batch")
    parser.add_argument("--sequences", type=int, default=8, help="sequences the tokens are split into")
    parser.add_argument("--vocab", type=int, default=R1_DISTILL_QWEN_1_5B["vocab_size"])
    parser.add_argument("--layers", type=int, default=None, help="override the model's layer count (small runs)")
    parser.add_argument("--hidden", type=int, default=None, help="override the model's hidden size (small runs)")
    parser.add_argument("--head-scale", type=float, default=50.0, help="multiplies the random output head (peakiness)")
    parser.add_argument("--k", type=int, default=32, help="kl_full_top_k of the kl_full losses")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_model", default=None, help=argparse.SUPPRESS)


def chosen_strategies(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """``--strategies`` checked, in the order given (default: both on CUDA, FSDP2 on the CPU platform, where
    FSDP1 does not run); a bad one exits through ``parser.error`` (exit code 2)."""
    default = ",".join(STRATEGIES if args.device == "cuda" else ("fsdp2",))
    strategies = subset(parser, "--strategies", args.strategies or default, STRATEGIES, allow_none=True)
    if args.device == "cpu" and "fsdp" in strategies:
        parser.error("--strategies fsdp (FSDP1) needs --device cuda: verl 0.9.1 runs only FSDP2 on the CPU platform")
    return strategies


def actor_loss(sequences: int, k: int, erc: bool = False, mode: Optional[str] = None, vocab_pass: bool = False) -> Any:
    """The actor loss of a variant, the update as one mini-batch and one micro-batch of ``sequences``: ERC-DAPO
    (``erc``: clip-higher 0.2 / 0.28, ERC band 0.05 / 0.05, dual-clip 10), divclip's ``mode`` at delta = 0.07 and
    ``kl_full_top_k = k``, or else verl's ``ppo_loss``; ``vocab_pass`` routes both passes through the chunked
    vocabulary pass."""
    from recipe.bench.harness import make_actor_config, ppo_loss_fn
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig

    batches = dict(ppo_mini_batch_size=sequences, ppo_micro_batch_size_per_gpu=sequences)
    if erc:
        policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05, vocab_pass=vocab_pass)
        clips = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
        return build_actor_loss(make_actor_config(policy_loss=policy, **clips, **batches))
    if mode is not None:
        policy = DivClipPolicyLossConfig(loss_mode=mode, delta=0.07, kl_full_top_k=k, vocab_pass=vocab_pass)
        return build_actor_loss(make_actor_config(policy_loss=policy, **batches))
    return ppo_loss_fn(make_actor_config(**batches))


def probe_worker(model_path: str, args: argparse.Namespace, **options: Any) -> Any:
    """verl's actor worker on the model at ``model_path`` as the probe and the acceptance build it: ``args.strategy``
    on ``args.device`` at verl's default precision (bf16 compute, fp32 reduce), gradient checkpointing, learning rate
    1e-6, ``torch.compile`` on CUDA only (inductor on CPU compiles C++ for minutes); ``options`` (fields of
    ``recipe.bench.harness.WorkerOptions``) add to or override these."""
    from recipe.bench.harness import WorkerOptions, build_actor_worker

    defaults = dict(device=args.device, strategy=args.strategy, mixed_precision=None, lr=1e-6)
    defaults.update(enable_gradient_checkpointing=True, use_torch_compile=args.device == "cuda")
    return build_actor_worker(model_path, WorkerOptions(**{**defaults, **options}))


def probe_batch(args: argparse.Namespace, sequences: int, seed: int = 0) -> Any:
    """``sequences`` rollouts of the probe's sequence length (``--tokens`` / ``--sequences``), each an eighth
    prompt (at least one token) and the rest response (``recipe.bench.harness.make_rollout_batch``)."""
    from recipe.bench.harness import make_rollout_batch

    seq_len = args.tokens // args.sequences
    prompt_len = max(1, seq_len // 8)
    return make_rollout_batch([prompt_len] * sequences, [seq_len - prompt_len] * sequences, args.vocab, seed=seed)


# ------------------------------------------------------------------------------------------------
# What the acceptance measures on any device: memory per phase, the longest micro-batch, FLOPs, lengths
# ------------------------------------------------------------------------------------------------

PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


class MemoryMeter:
    """Memory in use now and the peak since the last :meth:`reset_peak`, on the device the update runs on.

    ``cuda``: the caching allocator's counters (exact). ``cpu``: ``VmRSS`` and ``VmHWM``, reset by writing ``5``
    to ``/proc/self/clear_refs`` (Linux >= 4.0); run under :data:`recipe.bench.child.LIVE_RSS_ENV` so that the
    peak tracks live memory.
    """

    def __init__(self, device: str) -> None:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"MemoryMeter: device must be 'cuda' or 'cpu', got {device!r}")
        self.device = device

    def sync(self) -> None:
        """Wait for the device's queued work, so that the counters and a clock see it done."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def now(self) -> int:
        """Bytes in use now."""
        if self.device == "cuda":
            import torch

            return int(torch.cuda.memory_allocated())
        return self._status_kib("VmRSS") * 1024

    def reset_peak(self) -> None:
        """Start a new peak at the memory in use now."""
        if self.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            CLEAR_REFS.write_text("5")

    def peak(self) -> int:
        """The most bytes in use since the last :meth:`reset_peak`."""
        if self.device == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated())
        return self._status_kib("VmHWM") * 1024

    def release(self) -> None:
        """Hand freed memory back (collect garbage; CUDA: empty the allocator's cache; CPU: ``malloc_trim``),
        so that what a failed or finished try left behind is not counted as held by the next one."""
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()
        else:
            ctypes.CDLL(None).malloc_trim(0)

    @staticmethod
    def _status_kib(key: str) -> int:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
        raise RuntimeError(f"{PROC_STATUS} has no {key} line: the CPU memory meter needs Linux")


class Clock:
    """Seconds of one phase (``.seconds``), the device's queued work included (``meter.sync()`` on both ends)."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.meter = meter

    def __enter__(self) -> Clock:
        self.meter.sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.meter.sync()
        self.seconds = time.perf_counter() - self.start


@dataclass(frozen=True)
class Phase:
    """One phase of verl's engine as :class:`UpdatePhases` saw it: ``name`` is ``"forward_backward"``,
    ``"forward"`` (a log-prob pass) or ``"optimizer_step"``; ``peak_bytes`` is absolute, not above
    ``held_bytes`` (in use when the phase began); ``gradient_bytes`` this rank's, when it ended."""

    name: str
    held_bytes: int
    peak_bytes: int
    gradient_bytes: int


def gradient_bytes(module: Any) -> int:
    """Bytes of ``module``'s gradients on this rank (an FSDP2 ``DTensor`` counts its local shard)."""
    total = 0
    for param in module.parameters():
        grad = param.grad
        if grad is not None:
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            total += grad.numel() * grad.element_size()
    return total


class UpdatePhases:
    """Records memory per phase by wrapping one engine instance's ``forward_backward_batch`` and
    ``optimizer_step`` (verl's run unchanged inside). ``hold_gradients``: ``optimizer_zero_grad`` zeroes the
    gradients in place instead of freeing them, so that they are held before each forward from the second
    update on, as under gradient accumulation (docs/benchmarks.md, "GPU acceptance").
    """

    def __init__(self, engine: Any, meter: MemoryMeter, hold_gradients: bool = False) -> None:
        self.records: list[Phase] = []
        forward_backward, optimizer_step = engine.forward_backward_batch, engine.optimizer_step
        if hold_gradients:
            engine.optimizer_zero_grad = lambda: engine.optimizer.zero_grad(set_to_none=False)

        def measured(name: str, run: Callable[[], Any]) -> Any:
            meter.sync()
            held = meter.now()
            meter.reset_peak()
            out = run()
            meter.sync()
            self.records.append(Phase(name, held, meter.peak(), gradient_bytes(engine.module)))
            return out

        def forward_backward_batch(data: Any, loss_function: Any, forward_only: bool = False) -> Any:
            return measured(
                "forward" if forward_only else "forward_backward",
                lambda: forward_backward(data, loss_function, forward_only=forward_only),
            )

        engine.forward_backward_batch = forward_backward_batch
        engine.optimizer_step = lambda: measured("optimizer_step", optimizer_step)

    def mark(self) -> int:
        """A position in :attr:`records`; :meth:`since` gives the phases recorded after it."""
        return len(self.records)

    def since(self, mark: int) -> list[Phase]:
        return self.records[mark:]


def update_memory(phases: Sequence[Phase]) -> dict[str, int]:
    """Memory figures of one update (one mini-batch) from its phases: ``held_bytes`` before the forward
    (the gradients included only when :class:`UpdatePhases` holds them), ``loss_peak_bytes`` and
    ``optimizer_peak_bytes`` above it (the first the part a loss can change), the absolute
    ``update_peak_bytes`` and the ``gradient_bytes`` after the backward.
    """
    forward = [p for p in phases if p.name == "forward_backward"]
    step = [p for p in phases if p.name == "optimizer_step"]
    if len(forward) != 1 or len(step) != 1:
        raise ValueError(
            f"one update must have one forward/backward and one optimizer step, got {[p.name for p in phases]}"
        )
    held = forward[0].held_bytes
    return {
        "held_bytes": held,
        "loss_peak_bytes": forward[0].peak_bytes - held,
        "optimizer_peak_bytes": step[0].peak_bytes - held,
        "update_peak_bytes": max(forward[0].peak_bytes, step[0].peak_bytes),
        "gradient_bytes": forward[0].gradient_bytes,
    }


def pass_memory(phases: Sequence[Phase]) -> int:
    """A log-prob pass's peak above the memory in use before it (one ``forward`` phase)."""
    forward = [p for p in phases if p.name == "forward"]
    if len(forward) != 1:
        raise ValueError(f"one log-prob pass must have one forward phase, got {[p.name for p in phases]}")
    return forward[0].peak_bytes - forward[0].held_bytes


@dataclass
class Search:
    """The longest micro-batch that fits, as :func:`longest_fitting` found it (in the search's unit): the largest
    size that fitted (0: none), the smallest that did not (None: none), every try in order, and why it
    ``stopped``: ``"resolved"``, ``"limit"`` or ``"time"`` (``fits`` then only a lower bound).
    """

    fits: int = 0
    fails: Optional[int] = None
    tries: list[tuple[int, bool]] = field(default_factory=list)
    stopped: str = "time"


def longest_fitting(
    fits: Callable[[int], bool],
    start: int,
    *,
    limit: int,
    resolution: float,
    deadline: float,
    known_fit: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> Search:
    """The largest ``n`` in ``[1, limit]`` with ``fits(n)`` (assumed monotone), by doubling from ``start`` then
    bisection until the smallest failure is within ``resolution`` (0.25: 25 %) of the largest fit or one above.

    No try starts once ``clock() >= deadline``; sizes up to ``known_fit`` (0: none) are taken as fitting, untried.
    """
    if start < 1 or limit < start:
        raise ValueError(f"longest_fitting: need 1 <= start <= limit, got start={start}, limit={limit}")
    found = Search(fits=known_fit)

    def attempt(n: int) -> Optional[bool]:
        if clock() >= deadline:
            return None
        ok = bool(fits(n))
        found.tries.append((n, ok))
        if ok:
            found.fits = n
        else:
            found.fails = n
        return ok

    n = start
    while found.fails is None:
        if found.fits >= limit:
            found.stopped = "limit"
            return found
        if n > found.fits and attempt(n) is None:
            return found
        n = min(2 * max(n, found.fits), limit)
    while found.fails > found.fits + 1 and found.fails > found.fits * (1 + resolution):
        if attempt((found.fits + found.fails) // 2) is None:
            return found
    found.stopped = "resolved"
    return found


def response_lengths(count: int, mean: float, max_len: int, seed: int, sigma: float = 1.0) -> list[int]:
    """Seeded response lengths, long-tailed as an RL batch's: log-normal with shape ``sigma`` and mean ``mean``
    before each is rounded and clipped to ``[1, max_len]`` (a response cut at the rollout's maximum length)."""
    if count < 1 or max_len < 1 or mean <= 0:
        raise ValueError(f"response_lengths: need count >= 1, max_len >= 1, mean > 0; got {count}, {max_len}, {mean}")
    draw = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    return [min(max_len, max(1, round(draw.lognormvariate(mu, sigma)))) for _ in range(count)]


def update_flops(model_path: str, sequence_lengths: Sequence[int]) -> float:
    """Model FLOPs of one training update (forward + backward) over sequences of these lengths: verl's own
    estimate, as its ``perf/mfu`` uses it (the formula is in docs/benchmarks.md, "What it runs")."""
    from transformers import AutoConfig
    from verl.utils.flops_counter import ESTIMATE_FUNC

    config = AutoConfig.from_pretrained(model_path)
    if config.model_type not in ESTIMATE_FUNC:
        raise ValueError(f"verl's FlopsCounter has no estimate for model_type {config.model_type!r} ({model_path})")
    lengths = list(sequence_lengths)
    # FlopsCounter.estimate_flops without its device lookup: TFLOP/s over one second, the update's FLOPs
    return float(ESTIMATE_FUNC[config.model_type](config, sum(lengths), lengths, 1.0)) * 1e12


def device_peak_flops(device: str) -> tuple[Optional[float], str]:
    """The device's dense bf16 peak in FLOP/s (None where verl's ``get_device_flops`` table does not know it)
    and its name."""
    from verl.utils.flops_counter import get_device_flops

    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
    else:
        name = "CPU"
    peak = float(get_device_flops(unit="T", device_name=name)) * 1e12
    return (peak if math.isfinite(peak) and peak > 0 else None), name
