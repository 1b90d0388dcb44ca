"""The vocabulary pass inside verl 0.9.1's actor engine: ``log pi(y_t)`` and the entropy from
:func:`verl_ext.core.vocab_pass.vocab_pass`, never the logits. The LM head's ``forward`` is swapped, not bypassed,
so FSDP's hooks still fire. Unservable combinations raise. docs/engine.md ("One forward step"), docs/losses.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from verl_ext.core import key_reads
from verl_ext.core.vocab_pass import vocab_pass
from verl_ext.engine.guard import engine_attribute
from verl_ext.engine.request import POLICY_LOSS_KEY, request_of
from verl_ext.engine.swap import Swap

#: The config key verl's temperatures carry into the micro-batch (the trainer puts the rollout's there).
ROLLOUT_TEMPERATURE = "actor_rollout_ref.rollout.temperature"

VOCAB_PASS_KEY = f"{POLICY_LOSS_KEY}.vocab_pass"


def refuse_fused_kernels(engine: Any) -> None:
    """The vocabulary pass replaces the LM head's logits; verl's fused kernels replace the whole forward."""
    if bool(engine_attribute(engine, "model_config.use_fused_kernels")):
        raise ValueError(
            f"{VOCAB_PASS_KEY}=true replaces the LM head's logits; actor_rollout_ref.model.use_fused_kernels=true "
            "replaces the model forward with verl's fused kernel: choose one"
        )


class HeadObserver(Protocol):
    """A consumer of the LM head's input during one vocabulary-pass step."""

    def requested_top_k(self, vocab: int) -> int:
        """How many top ids per token to ask the pass for (0: none); may raise naming its config key."""

    def on_head(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor, top_ids: Optional[torch.Tensor]
    ) -> None:
        """Called once per step inside the head's forward, without a graph: ``(tokens, hidden)`` states
        in verl's packed order, the head weight, ``(tokens,)`` temperatures, ``(tokens, k)`` top ids."""

    def model_outputs(self) -> dict[str, torch.Tensor]:
        """Fields to add to the step's ``model_output``."""


@dataclass
class _StepState:
    """What the head needs from ``prepare_model_inputs`` for one micro-batch."""

    observers: Sequence[HeadObserver] = field(default_factory=tuple)
    labels: Optional[torch.Tensor] = None  # (rows,) rolled input ids, in the head's row order
    temperature: Optional[torch.Tensor] = None  # (rows,) per-token temperature
    valid: Optional[torch.Tensor] = None  # padded path: (batch, seq) mask of real tokens
    entropy_grad: bool = False


def output_head(module: Any) -> torch.nn.Module:
    """The LM head module of an (FSDP-wrapped) causal LM."""
    inner = getattr(module, "_fsdp_wrapped_module", module)  # FSDP1 wrapper
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(
            f"{VOCAB_PASS_KEY}=true needs a causal LM with an output head; {type(inner).__name__} has none"
        )
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(
            f"{VOCAB_PASS_KEY}=true: the LM head {type(head).__name__} has no plain weight (a LoRA/PEFT-wrapped "
            "head?); turn the vocabulary pass off or keep the head out of the adapter's target_modules"
        )
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{VOCAB_PASS_KEY}=true: the LM head has a bias, which the vocabulary pass does not add")
    if hasattr(head, "base_layer") or hasattr(head, "lora_A"):
        raise ValueError(
            f"{VOCAB_PASS_KEY}=true: the LM head carries a LoRA adapter; the pass reads only its base weight"
        )
    return head


def _head_forward(head: torch.nn.Module, state: _StepState, hidden_states: torch.Tensor) -> torch.Tensor:
    """The LM head's forward during a vocabulary-pass step: ``[log pi(y_t), H_t]`` per token."""
    if state.labels is None or state.temperature is None:
        raise RuntimeError("the vocabulary-pass head was called outside a prepared forward step")
    if state.valid is not None:  # padded path: only the real tokens, in verl's packed order
        hidden = hidden_states[state.valid]
    else:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    observers = state.observers
    vocab = head.weight.shape[0]
    top_k = max((observer.requested_top_k(vocab) for observer in observers), default=0)
    out = vocab_pass(hidden, head.weight, state.labels, state.temperature, top_k=top_k, entropy_grad=state.entropy_grad)
    with torch.no_grad():
        for observer in observers:
            observer.on_head(hidden.detach(), head.weight.detach(), state.temperature, out.top_ids)
    return torch.stack([out.log_probs, out.entropy], dim=-1)


def _capture_inputs(prepare: Callable[..., Any], state: _StepState) -> Callable[..., Any]:
    def prepare_model_inputs(micro_batch: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        model_inputs, output_args = prepare(micro_batch=micro_batch)
        for key, consumer in (
            ("use_fused_kernels", "actor_rollout_ref.model.use_fused_kernels"),
            ("distillation_use_topk", "top-k distillation (distillation.distillation_loss.loss_settings.use_topk)"),
            ("calculate_sum_pi_squared", "actor_rollout_ref.actor.calculate_sum_pi_squared"),
        ):
            if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
                raise ValueError(f"{VOCAB_PASS_KEY}=true never materialises the logits that {consumer} needs")
        if "input_ids_rmpad_rolled" not in output_args:
            raise ValueError(f"{VOCAB_PASS_KEY}=true: verl's inputs carry no rolled labels (pad_mode?)")
        state.labels = output_args["input_ids_rmpad_rolled"].reshape(-1)
        key_reads.record(ROLLOUT_TEMPERATURE)  # verl's per-token temperatures: the rollout's, divided out here
        if "temperature_rmpad" in output_args:  # remove-padding (and Ulysses) path: one per row
            state.temperature = output_args["temperature_rmpad"].reshape(-1)
            state.valid = None
        else:  # padded path: per sample, expanded over its real tokens
            lengths = micro_batch["input_ids"].offsets().diff()
            state.temperature = output_args["temperature"].reshape(-1).repeat_interleave(lengths)
            max_len = int(lengths.max())
            state.valid = torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
        return model_inputs, output_args

    return prepare_model_inputs


def _prepare_vocab_pass_outputs(engine: Any, observers: Sequence[HeadObserver]) -> Callable[..., dict[str, Any]]:
    """verl's ``prepare_model_outputs`` for a head that returned ``[log pi, H]``."""

    def prepare_model_outputs(
        output: Any, output_args: dict[str, Any], micro_batch: Any, logits_processor_func: Any = None
    ) -> dict[str, Any]:
        from verl.utils import tensordict_utils as tu

        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        if tu.get_non_tensor_data(data=micro_batch, key="distillation_only", default=False):
            raise ValueError(f"{VOCAB_PASS_KEY}=true cannot serve distillation-only steps (they need the logits)")
        packed = output.logits.reshape(-1, 2)
        log_probs, entropy = packed[:, 0], packed[:, 1]
        if "pad_size" in output_args:  # remove-padding: all-gather the Ulysses group, drop the pad
            log_probs = engine._gather_and_unpad_packed(log_probs, output_args["pad_size"])
            if calculate_entropy:
                entropy = engine._gather_and_unpad_packed(entropy, output_args["pad_size"])
        cu_seqlens = micro_batch["input_ids"].offsets()
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)}
        if calculate_entropy:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, cu_seqlens)
        for observer in observers:
            model_output.update(observer.model_outputs())
        return model_output

    return prepare_model_outputs


def vocab_pass_swaps(
    engine: Any, loss_function: Optional[Callable[..., Any]], observers: Sequence[HeadObserver] = ()
) -> list[Swap]:
    """The swaps that route one forward step of ``engine`` through the vocabulary pass (module docstring)."""
    refuse_fused_kernels(engine)
    head = output_head(engine.module)
    state = _StepState(
        observers=tuple(observers),
        entropy_grad=torch.is_grad_enabled()
        and loss_function is not None
        and not request_of(loss_function).entropy_as_mask,
    )
    return [
        Swap(head, "forward", functools.partial(_head_forward, head, state), "vocabulary pass"),
        Swap(engine, "prepare_model_inputs", _capture_inputs(engine.prepare_model_inputs, state), "vocabulary pass"),
        Swap(engine, "prepare_model_outputs", _prepare_vocab_pass_outputs(engine, state.observers), "vocabulary pass"),
    ]
