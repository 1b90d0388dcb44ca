"""``python -m recipe.bench losses [--json]``: forward+backward time of every divclip mode
against verl's ``vanilla`` policy loss, interleaved in one process.

A variant's figure is its median over rounds against ``vanilla``'s. ERC variants get the entropies as inputs.
``--heap steady`` (the default) holds glibc's heap with ``mallopt`` so the timings measure the arithmetic, not
page faults (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import functools
import json
import resource
import statistics
import time
from collections.abc import Callable

import torch
import verl  # noqa: F401  (loads the divclip plugin)
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import FSDPActorConfig, PolicyLossConfig

from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.config_rules.policy import check_policy_config
from verl_ext.core.region import CONSTRAINTS
from verl_ext.registry import LossInputs, supplying
from verl_ext.verl_modes import verl_policy_loss

SHAPES: tuple[tuple[int, int], ...] = ((64, 4096), (8, 16384))
VERL_MODES_WITH_ERC: tuple[str, ...] = ("vanilla", "gspo", "sapo")
"""verl's own modes benchmarked with ERC composed on top (``verl_ext.verl_modes``)."""
TARGET_RATIO = 1.25
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit


_heap_held = False  # mallopt lasts for the process: a later "glibc-default" run must say so


def hold_heap_steady() -> bool:
    """Keep freed memory in glibc's heap (no mmap per tensor, no trimming) so that steps do not page-fault their
    tensors in again; False where the C library is not glibc."""
    global _heap_held
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    _heap_held = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _heap_held


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _actor_config(policy: PolicyLossConfig) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=8,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=policy,
    )


def _variants() -> dict[str, tuple[str, FSDPActorConfig, bool]]:
    """name -> (registry mode, actor config, needs entropies)."""
    variants = {"vanilla": ("vanilla", _actor_config(PolicyLossConfig(loss_mode="vanilla")), False)}
    # modes that read pi_old's stored top-k run only in the engine (python -m recipe.bench full-kl)
    registry_modes = [mode for mode, spec in CONSTRAINTS.items() if not spec.needs_old_topk]
    for mode in registry_modes:
        variants[mode] = (mode, _actor_config(DivClipPolicyLossConfig(loss_mode=mode)), False)
    for mode in (*registry_modes, *VERL_MODES_WITH_ERC):
        policy = DivClipPolicyLossConfig(loss_mode=mode, erc_beta_low=0.05, erc_beta_high=0.05)
        check_policy_config(policy)  # the verl modes' ERC goes to verl_policy_loss, which does not resolve it
        variants[f"{mode}+erc"] = (mode, _actor_config(policy), True)
    return variants


def _make_step(
    shape: tuple[int, int], mode: str, config: FSDPActorConfig, with_entropy: bool, seed: int
) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    old = -torch.rand(rows, cols, generator=gen) * 3 - 0.01
    new = (old + torch.randn(rows, cols, generator=gen) * 0.3).clamp(max=0.0)
    adv = torch.randn(rows, 1, generator=gen).expand(rows, cols).contiguous()
    mask = torch.ones(rows, cols)
    mask[:, cols - cols // 8 :] = 0  # some padding, as in real batches
    old_entropy = torch.rand(rows, cols, generator=gen) * 2
    entropy = old_entropy * (1 + 0.1 * torch.randn(rows, cols, generator=gen))
    loss_fn = get_policy_loss_fn(mode)
    extra: dict[str, torch.Tensor] = {}
    inputs = None  # a registry entry gets ERC's entropies as the actor loss gives them (supplying)
    if with_entropy and mode not in CONSTRAINTS:  # ERC on a verl mode: the composition, not the registry
        loss_fn = functools.partial(verl_policy_loss, mode, policy=config.policy_loss)
        extra = {"old_entropy": old_entropy, "entropy": entropy}
    elif with_entropy:
        inputs = LossInputs(old_entropy=old_entropy, entropy=entropy)

    def step() -> None:
        log_prob = new.clone().requires_grad_(True)
        with supplying(inputs) if inputs is not None else contextlib.nullcontext():
            loss, _ = loss_fn(
                old_log_prob=old,
                log_prob=log_prob,
                advantages=adv,
                response_mask=mask,
                loss_agg_mode="token-mean",
                config=config,
                **extra,
            )
        loss.backward()

    return step


def run(rounds: int, warmup: int, shapes: tuple[tuple[int, int], ...] = SHAPES, heap: str = "steady") -> list[dict]:
    if heap == "steady" and not hold_heap_steady():
        heap = "glibc-default (mallopt unavailable)"
    elif heap == "glibc-default" and _heap_held:
        heap = "steady (held earlier in this process)"
    results = []
    variants = _variants()
    for shape in shapes:
        steps = {name: _make_step(shape, mode, cfg, ent, seed=0) for name, (mode, cfg, ent) in variants.items()}
        wall: dict[str, list[float]] = {name: [] for name in steps}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        faults: dict[str, list[int]] = {name: [] for name in steps}
        for r in range(warmup + rounds):
            for name, step in steps.items():
                faults_start = _minor_faults()
                wall_start, cpu_start = time.perf_counter(), time.process_time()
                step()
                if r >= warmup:
                    wall[name].append(time.perf_counter() - wall_start)
                    cpu[name].append(time.process_time() - cpu_start)
                    faults[name].append(_minor_faults() - faults_start)
        base_wall = statistics.median(wall["vanilla"])
        base_cpu = statistics.median(cpu["vanilla"])
        for name in steps:
            median_wall, median_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
            results.append(
                {
                    "mode": name,
                    "shape": list(shape),
                    "median_ms": round(median_wall * 1e3, 3),
                    "vanilla_median_ms": round(base_wall * 1e3, 3),
                    "ratio_vs_vanilla": round(median_wall / base_wall, 3),
                    # process CPU time: less sensitive to other load on the machine
                    "cpu_ratio_vs_vanilla": round(median_cpu / base_cpu, 3),
                    "target": TARGET_RATIO,
                    "meets_target": median_wall / base_wall <= TARGET_RATIO,
                    "rounds": rounds,
                    "threads": torch.get_num_threads(),
                    "heap": heap,
                    "minor_faults_per_step": statistics.median(faults[name]),
                }
            )
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench losses", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object per (mode, shape)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--heap",
        choices=("steady", "glibc-default"),
        default="steady",
        help="hold glibc's heap steady (default) or keep its defaults (see the module doc)",
    )
    args = parser.parse_args(argv)
    results = run(args.rounds, args.warmup, heap=args.heap)
    if args.json:
        for row in results:
            print(json.dumps(row))
    else:
        print(f"heap: {results[0]['heap'] if results else args.heap}")
        print(f"{'mode':<14}{'shape':<14}{'median ms':>10}{'ratio':>8}{'cpu ratio':>10}{'faults':>8}")
        for row in results:
            print(
                f"{row['mode']:<14}{str(tuple(row['shape'])):<14}{row['median_ms']:>10.2f}"
                f"{row['ratio_vs_vanilla']:>8.3f}{row['cpu_ratio_vs_vanilla']:>10.3f}{row['minor_faults_per_step']:>8.0f}"
            )
    return 0
