"""The GPU acceptance's measuring pieces (``recipe.bench.gpu_workload``), on the CPU, without verl's engine:
the longest-micro-batch search against predicates whose answer is known, the memory meter and the phase
recorder against allocations of known size, the memory figures of an update from its phases, and the packing
run's response lengths. ``tests/test_bench_gpu_probe_cpu.py`` runs them inside the acceptance at CPU size."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch

from recipe.bench.gpu_workload import (
    MemoryMeter,
    Phase,
    UpdatePhases,
    gradient_bytes,
    longest_fitting,
    pass_memory,
    response_lengths,
    update_memory,
)

MIB = 2**20


def _search(threshold: int, **kwargs: Any) -> tuple[Any, list[int]]:
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= threshold

    options = dict(start=4, limit=128, resolution=0.0, deadline=float("inf"))
    options.update(kwargs)
    return longest_fitting(fits, **options), tried


@pytest.mark.parametrize("threshold", [1, 3, 4, 5, 7, 8, 9, 31, 32, 33, 100, 127, 128, 500])
def test_the_search_finds_the_longest_size_that_fits_exactly_at_resolution_zero(threshold: int) -> None:
    found, tried = _search(threshold)
    assert found.fits == min(threshold, 128)
    assert found.stopped == ("limit" if threshold >= 128 else "resolved")
    assert found.fails == (None if threshold >= 128 else threshold + 1)
    assert found.tries == [(n, n <= threshold) for n in tried] and len(set(tried)) == len(tried)
    assert len(tried) <= 2 * 7 + 1  # doubling to 128 then bisection: logarithmic, not a sweep


@pytest.mark.parametrize("threshold", [5, 9, 40, 77, 127])
def test_the_search_stops_within_its_resolution_and_never_tries_below_a_known_fit(threshold: int) -> None:
    found, tried = _search(threshold, resolution=0.25, known_fit=4, start=8)
    assert found.stopped == "resolved" and found.fits <= threshold < found.fails
    assert found.fails <= 1.25 * found.fits or found.fails == found.fits + 1
    assert min(tried) > 4


def test_the_search_starts_no_try_after_its_deadline_and_says_so() -> None:
    now = [0.0]

    def fits(n: int) -> bool:
        now[0] += 1.0  # each try takes one second
        return n <= 100

    found = longest_fitting(fits, 4, limit=1000, resolution=0.0, deadline=3.0, clock=lambda: now[0])
    assert found.tries == [(4, True), (8, True), (16, True)] and found.stopped == "time"
    assert found.fits == 16 and found.fails is None  # a lower bound


def test_the_search_refuses_a_start_outside_its_limit() -> None:
    with pytest.raises(ValueError, match="start=0"):
        longest_fitting(lambda n: True, 0, limit=8, resolution=0.0, deadline=1.0)


def test_response_lengths_are_seeded_varied_and_long_tailed() -> None:
    lengths = response_lengths(2000, mean=700.0, max_len=7936, seed=3)
    assert lengths == response_lengths(2000, mean=700.0, max_len=7936, seed=3)
    assert lengths != response_lengths(2000, mean=700.0, max_len=7936, seed=4)
    assert 1 <= min(lengths) and max(lengths) <= 7936
    assert statistics.mean(lengths) == pytest.approx(700.0, rel=0.1)  # log-normal with the asked mean
    assert max(lengths) > 8 * statistics.median(lengths)  # a long tail, as reasoning responses have
    assert statistics.median(lengths) < 0.75 * statistics.mean(lengths)
    clipped = response_lengths(2000, mean=700.0, max_len=1000, seed=3)
    assert max(clipped) == 1000 and clipped.count(1000) == sum(n >= 1000 for n in lengths)
    with pytest.raises(ValueError, match="count >= 1"):
        response_lengths(0, mean=1.0, max_len=1, seed=0)


def test_update_memory_is_the_phases_peaks_above_what_was_held_before_the_forward() -> None:
    phases = [Phase("forward_backward", 1000, 1700, 300), Phase("optimizer_step", 1300, 1450, 300)]
    assert update_memory(phases) == {
        "held_bytes": 1000,
        "loss_peak_bytes": 700,
        "optimizer_peak_bytes": 450,
        "update_peak_bytes": 1700,
        "gradient_bytes": 300,
    }
    assert pass_memory([Phase("forward", 1000, 1250, 0)]) == 250
    with pytest.raises(ValueError, match="one optimizer step"):
        update_memory(phases[:1])
    with pytest.raises(ValueError, match="one forward phase"):
        pass_memory(phases)


def test_the_cpu_meter_sees_an_allocation_above_what_was_held_and_resets_its_peak() -> None:
    meter = MemoryMeter("cpu")
    meter.release()
    meter.reset_peak()
    held = meter.now()
    block = torch.ones(64 * MIB // 4)  # 64 MiB, written: resident
    assert meter.peak() - held >= 60 * MIB and meter.now() - held >= 60 * MIB
    del block
    meter.release()
    assert meter.now() - held < 16 * MIB  # handed back
    meter.reset_peak()
    assert meter.peak() - held < 16 * MIB  # a new peak starts at what is in use now
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        MemoryMeter("xpu")


class _Engine:
    """What :class:`UpdatePhases` needs of verl's engine: its two methods and its module."""

    def __init__(self, width: int = 256) -> None:
        self.module = torch.nn.Linear(width, width, bias=False)  # width**2 * 4 bytes of float32 gradients
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.0)

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> str:
        scratch = torch.ones(32 * MIB // 4)  # 32 MiB of activations, freed before it returns
        if not forward_only:  # the backward allocates the gradients, or adds into those held
            weight = self.module.weight
            weight.grad = torch.ones_like(weight) if weight.grad is None else weight.grad.add_(1.0)
        del scratch
        return f"{data}/{loss_function}/{forward_only}"

    def optimizer_zero_grad(self) -> None:  # verl's FSDP engines: optimizer.zero_grad(), which frees them
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        state = torch.ones(96 * MIB // 4)  # 96 MiB of temporaries
        del state
        return 1.5

    def train_batch(self, data: Any, loss_function: Any) -> float:  # verl's BaseEngine.train_batch, in short
        self.optimizer_zero_grad()
        self.forward_backward_batch(data, loss_function, forward_only=False)
        return self.optimizer_step()


def test_update_phases_records_each_phase_of_the_engine_instance_and_passes_its_results_through() -> None:
    engine = _Engine()
    phases = UpdatePhases(engine, MemoryMeter("cpu"))
    assert engine.forward_backward_batch("d", "f", forward_only=True) == "d/f/True"
    mark = phases.mark()
    assert engine.train_batch("d", "f") == 1.5
    assert [p.name for p in phases.records] == ["forward", "forward_backward", "optimizer_step"]
    assert pass_memory(phases.records[:mark]) >= 30 * MIB
    memory = update_memory(phases.since(mark))
    assert 30 * MIB <= memory["loss_peak_bytes"] < 48 * MIB
    assert 94 * MIB <= memory["optimizer_peak_bytes"] < 112 * MIB
    assert memory["gradient_bytes"] == 256 * 256 * 4 == gradient_bytes(engine.module)
    assert "forward_backward_batch" not in vars(_Engine()) and "forward_backward_batch" in vars(engine)  # instance only


@pytest.mark.parametrize("hold", [False, True], ids=["verl_frees_the_gradients", "gradients_held"])
def test_held_gradients_move_from_the_loss_phase_into_the_held_memory(hold: bool) -> None:
    """With ``hold_gradients`` the second update's gradients (16 MiB) are held before its forward and zeroed in
    place; without it verl frees them and the backward allocates them inside the loss phase."""
    engine = _Engine(width=2048)
    phases = UpdatePhases(engine, MemoryMeter("cpu"), hold_gradients=hold)
    engine.train_batch("d", "f")
    grad = engine.module.weight.grad
    mark = phases.mark()
    engine.train_batch("d", "f")
    memory = update_memory(phases.since(mark))
    assert memory["gradient_bytes"] == 16 * MIB
    assert (engine.module.weight.grad is grad) is hold  # zeroed in place, not reallocated
    assert torch.equal(engine.module.weight.grad, torch.ones(2048, 2048))  # the same numbers either way
    if hold:
        assert 30 * MIB <= memory["loss_peak_bytes"] < 44 * MIB  # the 32 MiB of activations alone
    else:
        assert 46 * MIB <= memory["loss_peak_bytes"] < 60 * MIB  # the activations and the new gradients


def test_update_flops_is_six_n_t_plus_the_attention_term_counted_from_the_model(tmp_path: Any) -> None:
    """verl's model-FLOPs estimate of one update, against the count done here from the saved model itself:
    ``6 x (every 2-D weight: embedding, head, projections) x tokens + 6 x sum(s_i^2) x heads x head_dim x
    layers``, over sequences of unequal lengths."""
    import argparse

    from transformers import AutoConfig, AutoModelForCausalLM

    from recipe.bench.gpu_workload import build_model, update_flops

    build_model(tmp_path, argparse.Namespace(layers=2, hidden=256, vocab=1024, head_scale=1.0, device="cpu"))
    config = AutoConfig.from_pretrained(tmp_path)
    weights = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tmp_path).parameters() if p.dim() == 2)
    lengths = [32, 32, 7, 300]
    attention = 6 * sum(s * s for s in lengths) * config.num_attention_heads * (256 // config.num_attention_heads) * 2
    assert update_flops(str(tmp_path), lengths) == pytest.approx(6 * weights * sum(lengths) + attention, rel=1e-9)
