"""Mutation score of the loss path (issue 41): mutmut over the loss modules, against the tests that cover them.

    .venv/bin/python tools/mutation.py                       # run (or resume), then print the table
    .venv/bin/python tools/mutation.py --report              # the table of the last run, nothing run
    .venv/bin/python tools/mutation.py --tests-from 3934510  # the same modules, another revision's tests
    .venv/bin/python tools/mutation.py --label L --mutants NAME ...  # run named mutants again (new tests: --fresh)
    .venv/bin/python tools/mutation.py --label NEW --report --older OLD  # NEW's table, completed from OLD's copy
    .venv/bin/python tools/mutation.py --label L --quick TEST ...  # the undecided against these tests alone first

Each label (``--label``, default ``current``, or the ``--tests-from`` revision) runs in its own scratch copy,
``.mutation/<label>/``: the checkout's tracked and untracked files (``tests/`` replaced by the revision's with
``--tests-from``). mutmut 3 does not mutate decorated functions; in the copy every decorated function of the
mutated modules is rewritten ``def f ...; f = d(f)`` (the same object, bound after the definition), so the
registered constraints, ``check_policy_config`` and the ``torch.no_grad`` kernels are mutated too.

One process by default (``--children``; the machine is shared), forked from mutmut's fork server (torch is not
fork-safe from a pytest process). mutmut keeps every mutant's verdict in the copy, so ``--budget-s`` stops a
run (SIGINT) and the next invocation goes on where it stopped; ``--fresh`` starts over. The table counts, per
module: killed, survived, timed out, not covered (no selected test runs the function), other (segfault,
suspicious) -- and the score killed / (all - equivalent), the equivalent mutants being those listed in
:data:`EQUIVALENT` (docs/benchmarks.md says why for each).

Needs the ``dev`` extra (``pip install -e .[dev]``: mutmut). A tool, not product code: nothing imports it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the modules whose mutants are scored: the loss path and the config checks
MUTATED = [
    "verl_ext/core/*.py",
    "verl_ext/registry.py",
    "verl_ext/actor_loss.py",
    "verl_ext/verl_modes.py",
    "verl_ext/adaptive_delta.py",
    "verl_ext/config.py",
    "verl_ext/config_rules/*.py",
    "recipe/config_checks.py",
]

#: the tests run against them (mutmut runs, for each mutant, the selected tests that call the mutated function,
#: fastest first, stopping at the first failure). Engine runs (Ray, a model) are left out: minutes each.
TESTS = [
    "tests/test_losses.py",
    "tests/test_full_kl.py",
    "tests/test_loss_breaks.py",
    "tests/test_loss_mutants.py",
    "tests/test_verl_modes.py",
    "tests/test_adaptive_delta.py",
    "tests/test_plugin_config.py",
    "tests/test_rollout_correction.py",
    "tests/test_correct_nll.py",
    "tests/test_ppo_loss_parity.py",
    "tests/test_recipe_main.py",
    "tests/test_losses_properties.py",
    "tests/test_knobs.py",
    "tests/test_gauge_modes.py",
    "tests/test_engine_seam.py",
    "tests/test_vocab_pass.py",
    "tests/test_vocab_pass_tensor_cores.py",
    # the entropy's numerics, without the file's engine runs (its on-policy fixtures)
    *(
        f"tests/test_entropy_numerics.py::{name}"
        for name in (
            "test_entropy_fp32_matches_fp64_reference",
            "test_entropy_fp32_ties_masked_vocabulary_and_extremes",
            "test_verl_bf16_formula_is_what_breaks",
            "test_rows_are_independent_of_chunking_and_batch",
            "test_eager_path_equals_the_compiled_formula_uncompiled",
            "test_no_graph_and_logits_untouched",
        )
    ),
    # the config rules' own tests (config_rules/, config_checks): composed configs, no engine
    "tests/test_verl_keys.py",
    "tests/test_verl_key_reads.py",
    "tests/test_checkpoints.py",
    "tests/test_validation_length.py",
    "tests/test_launch.py::test_profile_validation_names_the_key",
    *(
        f"tests/test_old_pass_skip.py::{name}"
        for name in (
            "test_where_it_is_not_exact_it_is_not_taken",
            "test_kl_fulls_top_k_does_not_block_it",
            "test_asked_where_it_is_not_exact_is_refused_naming_the_key",
            "test_a_model_with_dropout_is_not_taken_on_the_worker",
            "test_rollout_correction_without_the_rollouts_log_probs_reads_no_pi_old",
            "test_a_local_model_with_dropout_is_not_taken_before_ray",
            "test_no_rollout_correction_at_all_blocks_nothing",
        )
    ),
    # the vocabulary pass's refusals (the file's other tests run engines)
    *(
        f"tests/test_vocab_pass_engine.py::{name}"
        for name in (
            "test_refusals_name_the_key",
            "test_config_key_is_declared_and_reaches_the_loss",
            "test_refused_combinations_name_the_key",
            "test_stored_topk_is_accepted_with_the_pass",
            "test_lora_elsewhere_is_accepted",
            "test_lm_head_in_the_targets_is_accepted_with_lora_off",
        )
    ),
]
#: tests of those files left out of the selection (minutes each): those taking one of these fixtures (they run
#: engines) and those named for a subprocess. Matched on the test's own fixtures and function name, not on
#: ``-k``, which also matches the file's name and left ``tests/test_engine_seam.py`` out whole.
ENGINE_FIXTURES = ("engine", "engine_run", "on_policy", "every_mode", "atr_shape")
DESELECT_NAMED = "subprocess"
#: functions that find their caller by counting frames (``sys._getframe``): mutmut 3.8's trampoline lives in its
#: own module (``mutmut.mutation.trampoline``), so around a mutated function it adds frames the count does not
#: expect, and the key recorder found no product frame where it counted (nothing recorded: its tests failed). In the
#: copy they stay as written (no trampoline, no mutants: unmeasured, not scored).
FRAME_COUNTING = {"verl_ext/core/key_reads.py": ("_reader", "record")}
#: results the tests cache across tests (module:name of a dict), emptied before each test of mutmut's stats run: mutmut
#: maps each test to the functions it calls then, and a test served from a cache would call none of them (seen:
#: ``test_no_grad_frac_counts_the_dropped_tokens`` read ``run_mode``'s cached kl3 run and was never run on
#: ``_metrics``' mutants, which it kills)
STATS_UNCACHED = ("tests.test_knobs:_RUNS",)
#: appended to the copy's tests/conftest.py: the deselection above, after the suite's own ordering, and the caches
_DESELECT_HOOK = """

# appended by tools/mutation.py (the mutation copy only): its deselection, and no cached results in its stats run
import os as _os
import sys as _sys


@pytest.fixture(autouse=True)
def _stats_without_caches():
    if _os.environ.get("MUTANT_UNDER_TEST") == "stats":
        for entry in {uncached!r}:
            module, name = entry.split(":")
            if module in _sys.modules:
                getattr(_sys.modules[module], name).clear()
    yield


_suite_order = pytest_collection_modifyitems


def pytest_collection_modifyitems(items):
    _suite_order(items)
    items[:] = [
        item for item in items
        if not set(getattr(item, "fixturenames", ())) & {fixtures!r}
        and {named!r} not in getattr(item, "originalname", item.name)
    ]
"""

#: mutants that cannot change behaviour, by mutmut name, with the reason (docs/benchmarks.md, "Mutation score")
_EXTRA_REDUCTION = "only adds the reduction over valid tokens, whose result equals the value already there"
_LAST_OF_TWO = "dim +1 for -1 on tensors that always have two dims (batch, tokens), or unsqueeze of a 1-D one"
_NO_MOVE = "p == p_old counted on a side: its binary KL is exactly 0, never above a bound >= 0"
_JSON_LAYOUT = "the state file's indentation: restore reads any JSON layout"
_AGG_PASSED = "the default of loss_agg_mode, which verl's ppo_loss always passes (the default mirrors verl's signature)"
_HAS_MODULE = "the '?' for a registry entry without __module__: every Python callable has one (through its class)"
_EQUAL_ZIP = "zip's strict flag over the names and the values of one stack: always of equal length"
_CPU_SCALAR = (
    "eps made on the CPU instead of the entropies' device: a 0-dim CPU tensor enters TensorIterator as a scalar "
    "beside tensors of any device (addcmul and div_ give the same values on the entropies' device; checked on "
    "the meta device, the rule CUDA shares)"
)
_HALLEY = (
    "Lambert W's start, step or stop rule perturbed: Halley's iteration still reaches the root; over 12,143 z on "
    "both branches (the branch point to 1e6, and -1e-300) its residual |w e^w - z| / |z| stays within 2x the "
    "original's or 1e-15 (docs/benchmarks.md, sixth session)"
)
_DEFAULT_BRANCH = "lambert_w(z, ) for lambert_w(z, 0): the default branch is 0, the value passed"
_BISECTION = (
    "TRGPPO's bisection with one more halving, a bracket from -61 instead of -60 (the lower root lies well inside "
    "both), or a midpoint whose Bernoulli KL equals delta exactly counted above: the same roots to the bisection's "
    "2^-40 resolution (the product's table passes 60 halvings)"
)
_TOPK_DEFAULTS = "torch.topk's defaults (dim=-1, sorted=True), the values passed"
_TABLE_PRECISION = (
    "TRGPPO's table in float32, or its roots with 40 / 61 halvings: log-bounds move by < 1e-6 (measured: 9.9e-7, "
    "2.7e-11, 1.4e-16), inside the interpolation's documented 1e-3"
)
_LOG_PROBS_NONPOSITIVE = "the upper clamp at log q = 0: log-probs are <= 0, so it never binds"
_EMPTY_TAIL = "an empty tail's max replaced by 1 instead of 0: exp(-inf - 1) = 0 as well, log 0 = -inf either way"
_CLAMP_NEAR_ONE = (
    "the clamp keeping log(1 - q w) finite at +1e-30 instead of -1e-30: differs only for pi_theta within 1e-30 of 1, "
    "where both KLs are below 1e-29"
)
_STATIC_SHAPES = "torch.compile with static shapes: it recompiles for new shapes, the values are the same"
_BUFFER_ROWS = (
    "the cap of the eager buffer's rows at the input's row count, computed otherwise: only the buffer's size "
    "changes (more rows than the input has), never a value (a row's entropy is independent of the chunking)"
)
_BLOCK_ROWS = (
    "the block's row count computed otherwise (the given chunk_bytes ignored, or a block starting at every row): "
    "each row's masses are computed again from the same slices, equal up to the matmul's rounding at another row count"
)
_TOPK_2D = "topk without dim=1 on a tensor that is always 2-D: the default dim=-1 is the same axis"
_INT_NOT_DIFFERENTIABLE = (
    "top_ids (int64) left out of mark_non_differentiable: autograd never makes an integer tensor require grad, "
    "and backward ignores that output's slot"
)
_GRADS_MATERIALISED = (
    "a branch for an undefined incoming gradient: autograd.Function materialises undefined gradients as zeros "
    "(set_materialize_grads is never turned off), so grad_log_probs / grad_entropy are never None"
)
_AUTOGRAD_CASTS = (
    "the hidden states' float32 gradient returned without .to(hidden.dtype): autograd casts a returned gradient "
    "to its input's dtype (validate_outputs), the same rounding"
)
_PROMOTED = (
    "an input left in its own dtype (bf16 or float32) instead of the compute dtype: each use meets a float32 "
    "operand (the other log-prob, the ratio, the surrogate) or compares with 0, and torch promotes bf16 exactly; "
    "autograd casts the gradient back at that operation as at the cast (verl's weights and advantages are float32)"
)
_NEVER_CLIPPED_AT_ONE = (
    "upper_side at w exactly 1: read only where a token is clipped (GPPO's bound, clipfrac_upper), and w = 1 never "
    "is: (w - 1) A = 0 is not on the pessimistic side"
)
_CPU_BOUND = (
    "GPPO's bound and slope made as 0-dim CPU tensors instead of on the ratio's device: torch.where takes them "
    "beside tensors of any device as scalars, the same values (checked on the meta device, the rule CUDA shares)"
)
_LOSS_MODE_FIELD = (
    "policy_loss.get('loss_mode', <default>) with another default: verl's PolicyLossConfig always has the field "
    "(its own default is 'vanilla'), so the default is never read"
)
EQUIVALENT: dict[str, str] = {
    # VocabPass.forward / backward (seventh session, each read against the source)
    "verl_ext.core.vocab_pass.xǁVocabPassǁforward__mutmut_154": _TOPK_2D,
    "verl_ext.core.vocab_pass.xǁVocabPassǁforward__mutmut_175": _TOPK_2D,
    "verl_ext.core.vocab_pass.xǁVocabPassǁforward__mutmut_232": _INT_NOT_DIFFERENTIABLE,
    "verl_ext.core.vocab_pass.xǁVocabPassǁforward__mutmut_248": _INT_NOT_DIFFERENTIABLE,
    "verl_ext.core.vocab_pass.xǁVocabPassǁforward__mutmut_123": (
        "a label on a slice's upper edge (label == v1) taken as inside that slice too: the next slice, which holds "
        "it, runs later and overwrites the picked logit (labels are token ids below the vocabulary size, as verl's "
        "own log-prob functions assume)"
    ),
    "verl_ext.core.vocab_pass.xǁVocabPassǁbackward__mutmut_13": _GRADS_MATERIALISED,
    "verl_ext.core.vocab_pass.xǁVocabPassǁbackward__mutmut_37": _GRADS_MATERIALISED,
    "verl_ext.core.vocab_pass.xǁVocabPassǁbackward__mutmut_38": _AUTOGRAD_CASTS,
    "verl_ext.core.vocab_pass.xǁVocabPassǁbackward__mutmut_120": (
        "the float32 slice of the weight's gradient assigned without .to(weight.dtype): the slice assignment "
        "rounds to the buffer's dtype exactly as .to does"
    ),
    "verl_ext.core.vocab_pass.xǁVocabPassǁbackward__mutmut_125": _AUTOGRAD_CASTS,
    "verl_ext.core.vocab_pass.x_bucket_log_masses__mutmut_8": _LAST_OF_TWO,
    "verl_ext.core.vocab_pass.x_bucket_log_masses__mutmut_57": _BLOCK_ROWS,
    "verl_ext.core.vocab_pass.x_bucket_log_masses__mutmut_112": _BLOCK_ROWS,
    "verl_ext.core.vocab_pass.x_bucket_log_masses__mutmut_125": (
        "the bucket ids kept in their stored int32 instead of int64: gather and scatter_reduce take either"
    ),
    "verl_ext.core.vocab_pass.x_bucket_log_masses__mutmut_136": (
        "at_ids started at +inf instead of -inf: every id lies in exactly one slice, which overwrites it"
    ),
    "verl_ext.core.entropy.xǁEagerRowsǁstats__mutmut_12": _LAST_OF_TWO,
    "verl_ext.core.entropy.xǁEagerRowsǁstats__mutmut_24": _LAST_OF_TWO,
    "verl_ext.core.entropy.xǁEagerRowsǁstats__mutmut_34": _LAST_OF_TWO,
    "verl_ext.core.entropy.xǁEagerRowsǁstats__mutmut_37": _LAST_OF_TWO,
    "verl_ext.core.entropy.xǁEagerRowsǁstats__mutmut_40": _LAST_OF_TWO,
    "verl_ext.core.entropy.x_merge_row_stats__mutmut_3": (
        "equal maxima counted on the other side: both give r_1 + r_2 + 1 and s_1 + s_2 (the same two sums in the "
        "other order)"
    ),
    "verl_ext.core.entropy.x_entropy_fp32__mutmut_23": _BUFFER_ROWS,
    "verl_ext.core.entropy.x_entropy_fp32__mutmut_29": _BUFFER_ROWS,
    "verl_ext.core.entropy.x_entropy_fp32__mutmut_30": _BUFFER_ROWS,
    "verl_ext.core.entropy.x_entropy_fp32__mutmut_31": _BUFFER_ROWS,
    "verl_ext.core.entropy.x__entropy_rows__mutmut_9": _LAST_OF_TWO,
    "verl_ext.core.entropy.x__entropy_rows__mutmut_33": _LAST_OF_TWO,
    "verl_ext.core.entropy.x__entropy_rows__mutmut_37": _LAST_OF_TWO,
    "verl_ext.core.entropy.x__compiled_entropy_rows__mutmut_2": _STATIC_SHAPES,
    "verl_ext.core.entropy.x__compiled_entropy_rows__mutmut_4": _STATIC_SHAPES,
    "verl_ext.core.entropy.x__compiled_entropy_rows__mutmut_5": _STATIC_SHAPES,
    "verl_ext.core.entropy.x__entropy_rows__mutmut_21": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_topk_rows__mutmut_18": "the top-k ids unsorted: every consumer reads pi_old's and "
    "pi_theta's masses on the same ids, and the KL and the tail sum over buckets in any order",
    "verl_ext.core.entropy.x__chunked__mutmut_30": "a chunk starting at every row instead of every rows-th: each row "
    "is recomputed, to the same value (a row's entropy never depends on the others)",
    "verl_ext.core.entropy.x__chunked__mutmut_14": "exactly one chunk's rows then go through the loop as one chunk: "
    "the same kernel on the same rows",
    "verl_ext.core.coarsened_kl.x_log_masses_rows__mutmut_10": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_log_masses_rows__mutmut_18": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_log_masses_rows__mutmut_27": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_log_masses_rows__mutmut_36": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_log_masses_of_rows__mutmut_20": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_tail_log_mass___mutmut_6": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_tail_log_mass___mutmut_25": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_topk_rows__mutmut_5": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_topk_rows__mutmut_16": _LAST_OF_TWO,
    "verl_ext.core.coarsened_kl.x_topk_rows__mutmut_14": _TOPK_DEFAULTS,
    "verl_ext.core.coarsened_kl.x_topk_rows__mutmut_15": _TOPK_DEFAULTS,
    "verl_ext.core.coarsened_kl.x_tail_log_mass___mutmut_17": _EMPTY_TAIL,
    "verl_ext.core.divergences.x__bernoulli_kl_where_feasible__mutmut_18": _CLAMP_NEAR_ONE,
    "verl_ext.core.divergences.x_trgppo_bound_table__mutmut_4": _TABLE_PRECISION,
    "verl_ext.core.divergences.x_trgppo_bound_table__mutmut_7": _TABLE_PRECISION,
    "verl_ext.core.divergences.x_trgppo_bound_table__mutmut_19": _TABLE_PRECISION,
    "verl_ext.core.divergences.x_trgppo_bound_table__mutmut_20": _TABLE_PRECISION,
    "verl_ext.core.divergences.x_trgppo_ratio_bounds_interpolated__mutmut_15": _LOG_PROBS_NONPOSITIVE,
    "verl_ext.core.divergences.x_trgppo_ratio_bounds_interpolated__mutmut_17": _LOG_PROBS_NONPOSITIVE,
    "verl_ext.core.divergences.x_trgppo_ratio_bounds__mutmut_1": _BISECTION,
    "verl_ext.core.divergences.x_trgppo_ratio_bounds__mutmut_13": _BISECTION,
    "verl_ext.core.divergences.x_trgppo_ratio_bounds__mutmut_26": _BISECTION,
    "verl_ext.core.divergences.x_trgppo_ratio_bounds__mutmut_50": _BISECTION,
    "verl_ext.core.divergences.x_lambert_w__mutmut_28": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_31": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_33": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_41": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_44": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_45": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_53": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_54": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_60": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_63": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_64": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_65": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_66": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_71": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_73": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_74": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_75": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_83": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_87": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_97": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_98": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_101": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_106": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_108": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_112": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_113": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_115": _HALLEY,
    "verl_ext.core.divergences.x_lambert_w__mutmut_116": _HALLEY,
    "verl_ext.core.divergences.x_kl3_ratio_bounds__mutmut_12": _DEFAULT_BRANCH,
    "verl_ext.core.divergences.x_is_kl3_ratio_bounds__mutmut_13": _DEFAULT_BRANCH,
    "verl_ext.core.erc.x_entropy_ratio__mutmut_11": "mask.to(None): a 0/1 mask (bool or int) multiplies exactly; "
    "the float entropy sets the result dtype",
    "verl_ext.core.erc.x_entropy_ratio__mutmut_5": _CPU_SCALAR,
    "verl_ext.core.erc.x_entropy_ratio__mutmut_9": _CPU_SCALAR,
    "verl_ext.core.erc.x_gate_log_prob_gradient__mutmut_3": "converting keep to the dtype it already has is a no-op",
    "verl_ext.core.erc.x_finish_entropy_band_metrics__mutmut_7": _EXTRA_REDUCTION,
    "verl_ext.core.erc.x_finish_entropy_band_metrics__mutmut_17": _EXTRA_REDUCTION,
    "verl_ext.core.erc.x_finish_entropy_band_metrics__mutmut_20": _EXTRA_REDUCTION,
    "verl_ext.core.erc.x_finish_entropy_band_metrics__mutmut_32": _EXTRA_REDUCTION,
    "verl_ext.core.erc.x_finish_entropy_band_metrics__mutmut_35": _EXTRA_REDUCTION,
    "verl_ext.core.erc.x_finish_entropy_band_metrics__mutmut_36": _EXTRA_REDUCTION,
    "verl_ext.core.surrogate.x_outside_trust_region__mutmut_18": "log_prob left in bf16 before subtracting the "
    "promoted old log-prob: torch promotes the difference to the wider dtype, converting bf16 exactly",
    "verl_ext.core.surrogate.x_outside_trust_region__mutmut_30": _LAST_OF_TWO,
    "verl_ext.core.surrogate.x_sequence_mean_log_ratio__mutmut_4": _LAST_OF_TWO,
    "verl_ext.core.surrogate.x_sequence_mean_log_ratio__mutmut_16": _LAST_OF_TWO,
    "verl_ext.core.surrogate.x__metrics__mutmut_40": _LAST_OF_TWO,
    "verl_ext.core.surrogate.x__metrics__mutmut_109": "zip(strict=None): None is falsy, as strict=False",
    "verl_ext.core.surrogate.x__metrics__mutmut_112": "zip() without strict: its default is strict=False",
    "verl_ext.core.surrogate.x__metrics__mutmut_114": "zip(strict=True): the keys of sums and the values stacked from "
    "them always have the same length",
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_20": _PROMOTED,
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_24": _PROMOTED,
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_208": _PROMOTED,
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_66": _LAST_OF_TWO,
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_104": _NEVER_CLIPPED_AT_ONE,
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_121": _CPU_BOUND,
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_124": _CPU_BOUND,
    "verl_ext.core.surrogate.x_constrained_policy_loss__mutmut_235": "vocab_sums '' instead of None without kl_full: "
    "_metrics updates its sums with it, and an empty string adds nothing",
    "verl_ext.verl_modes.x__sequence_interval__mutmut_16": _LAST_OF_TWO,
    "verl_ext.verl_modes.x__sequence_interval__mutmut_19": _LAST_OF_TWO,
    "verl_ext.verl_modes.x__binary_kl_interval__mutmut_23": _NO_MOVE,
    "verl_ext.verl_modes.x__binary_kl_interval__mutmut_26": _NO_MOVE,
    "verl_ext.verl_modes.x__sequence_interval__mutmut_12": _LAST_OF_TWO,
    "verl_ext.actor_loss.x__correct_response_nll__mutmut_3": _LAST_OF_TWO,
    "verl_ext.actor_loss.x__correct_response_nll__mutmut_9": _LAST_OF_TWO,
    "verl_ext.actor_loss.x_padded_response__mutmut_7": _LAST_OF_TWO,
    # numbered as in the source of d547341 on (the loss's key_reads.bind line gone: 7, 9, 12, 13 before)
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_3": _LOSS_MODE_FIELD,
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_5": _LOSS_MODE_FIELD,
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_8": _LOSS_MODE_FIELD,
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_9": _LOSS_MODE_FIELD,
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_88": "the padded copy of the micro-batch's fields made on "
    "every call: each of its readers runs only under the flags that asked for it, so only its cost changes",
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_92": "log_prob / entropy start as '' instead of None: both are "
    "set wherever a reader runs (the gauge, the NLL and the dump need the padded copy; the entropy is read only "
    "with ERC on, which pads it)",
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_141": _LAST_OF_TWO,
    "verl_ext.actor_loss.x_divclip_actor_loss__mutmut_147": _LAST_OF_TWO,
    "verl_ext.actor_loss.x_build_actor_loss__mutmut_31": "the loss partial's positional arguments dropped: it has none "
    "(the config is bound by keyword, and declare keeps the partial's arguments as they are)",
    # key_reads.py (thirteenth session)
    **{
        f"verl_ext.core.key_reads.{name}": "the recorder's files hold ASCII keys and module names, one tab per line: "
        "read and written alike in any encoding that reads ASCII, split alike from either end"
        for name in (
            "x__write__mutmut_14",
            "x__write__mutmut_17",
            "x__write__mutmut_22",
            "x_read_records__mutmut_6",
            "x_read_records__mutmut_8",
            "x_read_records__mutmut_11",
        )
    },
    "verl_ext.core.key_reads.x__wrap_dictconfig__mutmut_59": "OmegaConf's _get_full_key(None) is _get_full_key(''): "
    "the node's own key (checked for a root and a nested config)",
    "verl_ext.registry.x_register_modes__mutmut_10": _HAS_MODULE,
    "verl_ext.registry.x_register_modes__mutmut_13": _HAS_MODULE,
    "verl_ext.registry.x_register_modes__mutmut_16": _HAS_MODULE,
    "verl_ext.registry.x__make_registry_loss__mutmut_1": _AGG_PASSED,
    "verl_ext.registry.x__make_registry_loss__mutmut_2": _AGG_PASSED,
    "verl_ext.registry.x_resolve_policy_config__mutmut_2": "config['policy_loss'] for config.policy_loss: verl's "
    "configs are Mappings of their fields",
    "verl_ext.registry.x__erc_on_verl_mode__mutmut_1": _AGG_PASSED,
    "verl_ext.registry.x__erc_on_verl_mode__mutmut_2": _AGG_PASSED,
    "verl_ext.verl_modes.x__erc_metrics__mutmut_4": "n_valid summed in the mask's integer dtype: torch.stack "
    "promotes it to the band's float dtype, where a count is exact",
    "verl_ext.verl_modes.x__erc_metrics__mutmut_10": _EQUAL_ZIP,
    "verl_ext.verl_modes.x__erc_metrics__mutmut_13": _EQUAL_ZIP,
    "verl_ext.verl_modes.x__erc_metrics__mutmut_16": _EQUAL_ZIP,
    "verl_ext.adaptive_delta.xǁAdaptiveDeltaǁsave__mutmut_20": _JSON_LAYOUT,
    "verl_ext.adaptive_delta.xǁAdaptiveDeltaǁsave__mutmut_23": _JSON_LAYOUT,
    "verl_ext.adaptive_delta.xǁAdaptiveDeltaǁsave__mutmut_25": _JSON_LAYOUT,
    # the config rules (sixteenth session)
    "verl_ext.config_rules.composed.x_check_separate_async_micro_batches__mutmut_23": (
        "(rows // ranks) % size -> (rows / ranks) % size: evaluated only when rows % ranks == 0 (the `or` before it), "
        "where both quotients are the same integer"
    ),
}

#: mutmut's verdicts (``mutmut.stats.status_by_exit_code``) as the table groups them
GROUP = {
    "killed": "killed",
    "caught by type check": "killed",
    "survived": "survived",
    "timeout": "timeout",
    "no tests": "no_tests",
    "not checked": "not_run",
    "check was interrupted by user": "not_run",
}
COLUMNS = ("killed", "survived", "timeout", "no_tests", "other", "not_run")


def source_files() -> list[str]:
    """The checkout's files: tracked and untracked, less what git ignores."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [name for name in out.split("\0") if name and (ROOT / name).is_file()]


def undecorate(source: str) -> str:
    """``@d1 @d2 def f`` as ``def f ...`` followed by ``f = d1(d2(f))``, for the module's and its classes'
    functions (``staticmethod`` / ``classmethod`` alone stay: mutmut handles those)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []  # (first decorator line, def line, end line, indent, assignment), 1-based
    bodies = [tree.body] + [node.body for node in tree.body if isinstance(node, ast.ClassDef)]
    for body in bodies:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.decorator_list:
                continue
            names = [ast.unparse(d) for d in node.decorator_list]
            if names in (["staticmethod"], ["classmethod"]):
                continue
            applied = node.name
            for name in reversed(names):
                applied = f"({name})({applied})"
            indent = " " * node.col_offset
            edits.append(
                (
                    node.decorator_list[0].lineno,
                    node.lineno,
                    node.end_lineno,
                    indent,
                    f"{indent}{node.name} = {applied}\n",
                )
            )
    for first, def_line, end, _, assignment in sorted(edits, reverse=True):
        lines[end:end] = [assignment]
        del lines[first - 1 : def_line - 1]
    return "".join(lines)


def unmutated(source: str, names: tuple[str, ...]) -> str:
    """The module's top-level functions ``names`` marked ``# pragma: no mutate block`` (on their header line):
    mutmut then leaves them as written, with no trampoline and no mutants."""
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            header = node.body[0].lineno - 2  # the line before the body's first statement (0-based): the colon
            while not lines[header].rstrip().endswith(":"):
                header -= 1
            lines[header] = lines[header].rstrip("\n") + "  # pragma: no mutate block\n"
    return "".join(lines)


def mutmut_config(mutated: list[str], tests: list[str]) -> str:
    quoted = lambda items: "[" + ", ".join(json.dumps(item) for item in items) + "]"  # noqa: E731
    return (
        "\n[tool.mutmut]\n"
        f'source_paths = ["verl_ext", "recipe"]\n'
        'also_copy = ["README.md", "configs", "docs", "launch", "data_prep"]\n'  # files the tests read
        f"only_mutate = {quoted(mutated)}\n"
        f"pytest_add_cli_args_test_selection = {quoted(tests)}\n"
        f'pytest_add_cli_args = ["-p", "no:xdist", "-p", "no:cacheprovider"]\n'
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
    )


def prepare(work: Path, tests_from: str | None, mutated: list[str], tests: list[str]) -> None:
    """The scratch copy: the checkout (tests from ``tests_from`` when given), decorated functions unwrapped,
    mutmut's config appended to its pyproject.toml."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for name in source_files():
        if tests_from is not None and name.startswith("tests/"):
            continue
        target = work / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    if tests_from is not None:
        archive = subprocess.run(
            ["git", "archive", tests_from, "tests"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
    missing = [test for test in tests if not (work / test.split("::")[0]).exists()]
    if missing:
        print(f"not in the copy's tests, left out of the selection: {missing}")
        tests = [test for test in tests if test not in missing]
    for pattern in mutated:
        for path in work.glob(pattern):
            source = undecorate(path.read_text())
            names = FRAME_COUNTING.get(str(path.relative_to(work)), ())
            path.write_text(unmutated(source, names) if names else source)
    with open(work / "pyproject.toml", "a", encoding="utf-8") as handle:
        handle.write(mutmut_config(mutated, tests))
    with open(work / "tests" / "conftest.py", "a", encoding="utf-8") as handle:
        handle.write(
            _DESELECT_HOOK.format(fixtures=set(ENGINE_FIXTURES), named=DESELECT_NAMED, uncached=STATS_UNCACHED)
        )


def run_mutmut(work: Path, budget_s: float, log: Path, children: int = 1, names: tuple[str, ...] = ()) -> float:
    """``mutmut run --max-children children [names]`` in ``work`` (every mutant without a verdict, or the named
    ones again), stopped with SIGINT after ``budget_s``; the wall seconds."""
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    with open(log, "a", encoding="utf-8") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *names],
            cwd=work,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            process.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return time.monotonic() - start


def quick_kills(work: Path, tests: list[str], children: int, names: tuple[str, ...] = ()) -> Counter[str]:
    """Every mutant without a verdict (or the named ones) against ``tests`` alone, one pytest process each
    (mutmut's trampoline reads ``MUTANT_UNDER_TEST`` at every call), ``children`` at once: a failing test is
    recorded as mutmut records a kill (exit code 1); a mutant the selection misses keeps no verdict, for mutmut's
    own run over the whole selection. The selection must pass unmutated first. Returns the exit codes' counts."""
    from concurrent.futures import ThreadPoolExecutor

    mutants = work / "mutants"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(mutants)}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *tests]

    def run(name: str) -> int:
        out = subprocess.run(command, cwd=mutants, env={**env, "MUTANT_UNDER_TEST": name}, capture_output=True)
        return out.returncode

    if (code := run("none")) != 0:
        raise SystemExit(f"the quick selection fails unmutated (pytest exit {code}): {' '.join(tests)}")
    metas = {meta: json.loads(meta.read_text()) for meta in mutants.rglob("*.py.meta")}
    todo = [
        (meta, name)
        for meta, data in metas.items()
        for name, code in data["exit_code_by_key"].items()
        if (name in names if names else code is None)
    ]
    codes: Counter[str] = Counter()
    with ThreadPoolExecutor(children) as pool:
        for (meta, name), code in zip(todo, pool.map(lambda item: run(item[1]), todo), strict=True):
            codes[str(code)] += 1
            if code == 1:
                metas[meta]["exit_code_by_key"][name] = 1
                meta.write_text(json.dumps(metas[meta], indent=4))
    return codes


def verdicts(work: Path) -> dict[str, dict[str, str]]:
    """Per mutated module, each mutant's verdict (``not_run`` when it has none yet)."""
    from mutmut.stats import status_by_exit_code

    out: dict[str, dict[str, str]] = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        module = str(meta.relative_to(work / "mutants"))[: -len(".meta")]
        data = json.loads(meta.read_text())
        out[module] = {
            name: GROUP.get(status_by_exit_code[code], "other")
            for name, code in data.get("exit_code_by_key", {}).items()
        }
    return out


def table(found: dict[str, dict[str, str]]) -> str:
    rows = [f"| module | {' | '.join(COLUMNS)} | equivalent | score |", "|" + " --- |" * (len(COLUMNS) + 3)]
    total: Counter[str] = Counter()
    for module, by_name in found.items():
        counts = Counter(by_name.values())
        equivalent = sum(1 for name, verdict in by_name.items() if name in EQUIVALENT and verdict == "survived")
        counts["equivalent"] = equivalent
        total.update(counts)
        rows.append(_row(module, counts))
    rows.append(_row("**all**", total))
    return "\n".join(rows)


def _row(name: str, counts: Counter[str]) -> str:
    scored = sum(counts[c] for c in COLUMNS) - counts["equivalent"] - counts["not_run"]
    score = f"{100 * counts['killed'] / scored:.1f} %" if scored else "-"
    return f"| {name} | {' | '.join(str(counts[c]) for c in COLUMNS)} | {counts['equivalent']} | {score} |"


def survivors(found: dict[str, dict[str, str]]) -> list[str]:
    return [
        name
        for by_name in found.values()
        for name, verdict in by_name.items()
        if verdict in ("survived", "no_tests") and name not in EQUIVALENT
    ]


def _function_code(work: Path, module: str) -> dict[str, str]:
    """mutmut's mangled function name -> the function's code (AST, docstrings left out) in ``work``'s copy."""

    def code(node: ast.AST) -> str:
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
            node.body = body[1:]
        return ast.dump(node)

    dotted = module[: -len(".py")].replace("/", ".")
    out: dict[str, str] = {}
    for node in ast.parse((work / module).read_text()).body:
        if isinstance(node, ast.FunctionDef):
            out[f"{dotted}.x_{node.name}"] = code(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{dotted}.xǁ{node.name}ǁ{item.name}"] = code(item)
    return out


def combined(work: Path, older: Path) -> dict[str, dict[str, str]]:
    """``work``'s verdicts, completed from ``older``'s copy: per function, the verdicts of the copy that ran all
    of its mutants, ``work`` first; ``older``'s only where the function's code is the same in both copies."""
    new, old = verdicts(work), verdicts(older)
    function = lambda name: name.rsplit("__mutmut_", 1)[0]  # noqa: E731
    out: dict[str, dict[str, str]] = {}
    for module, by_name in new.items():
        done = {function(n) for n in by_name} - {function(n) for n, v in by_name.items() if v == "not_run"}
        same_code = _function_code(work, module).items() & _function_code(older, module).items()
        kept = {name for name, _ in same_code} - done
        out[module] = {n: v for n, v in by_name.items() if function(n) not in kept}
        out[module].update({n: v for n, v in old.get(module, {}).items() if function(n) in kept})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests-from", help="run the tests of this git revision instead of the checkout's")
    parser.add_argument("--label", help="scratch copy .mutation/<label> (default: current, or the revision)")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop mutmut after this many seconds (resumable)")
    parser.add_argument("--fresh", action="store_true", help="rebuild the scratch copy, dropping earlier verdicts")
    parser.add_argument("--only", nargs="+", default=MUTATED, help="mutate these globs only (default: MUTATED)")
    parser.add_argument("--tests", nargs="+", default=TESTS, help="the test selection (default: TESTS)")
    parser.add_argument("--children", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--mutants", nargs="+", default=(), help="run these mutants (mutmut names) again")
    parser.add_argument(
        "--quick",
        nargs="+",
        help="run only these tests, each undecided (or named) mutant alone: a failure kills, the rest stay undecided",
    )
    parser.add_argument("--report", action="store_true", help="print the table of the last run, run nothing")
    parser.add_argument("--survivors", action="store_true", help="list the surviving mutants' names too")
    parser.add_argument(
        "--older",
        help="with --report: complete the table from this older label's copy (functions "
        "this one did not run whose code is the same in both)",
    )
    args = parser.parse_args(argv)
    label = args.label or (re.sub(r"\W", "_", args.tests_from) if args.tests_from else "current")
    work = ROOT / ".mutation" / label
    wall = 0.0
    if not args.report:
        if args.fresh or not (work / "mutants").exists():
            prepare(work, args.tests_from, args.only, args.tests)
        if args.quick:
            codes = quick_kills(work, args.quick, args.children, tuple(args.mutants))
            print("quick selection, pytest exit codes (1: killed):", dict(codes))
        else:
            wall = run_mutmut(work, args.budget_s, work / "mutmut.log", args.children, tuple(args.mutants))
    found = combined(work, ROOT / ".mutation" / args.older) if args.older else verdicts(work)
    if not found:
        print(f"no mutmut results in {work}; see {work / 'mutmut.log'}")
        return 1
    tests = "" if args.report else f" (tests {'from ' + args.tests_from if args.tests_from else 'of the checkout'})"
    print(f"mutation score, {label}{tests}")
    print(table(found))
    if wall:
        print(f"wall time of this run: {wall:.0f} s")
    if args.survivors:
        print("\n".join(["survivors (not equivalent):", *survivors(found)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
