"""The vocabulary pass at tensor-core rate: why TF32 keeps its logits exact, and that the setting is scoped.

* TF32 rounding emulated in bit arithmetic (round to nearest even on the 13 dropped mantissa bits), and a
  TF32 matmul emulated against an exact reference (every float32 product is exact in float64; ``math.fsum``
  adds them without error and rounds once). For bf16- and fp16-valued operands rounding to TF32 changes
  nothing, so the emulated TF32 matmul equals the exact product of the original operands bit for bit; what
  the hardware adds is float32 accumulation, and the float32 matmul stays within the recursive-summation
  bound gamma_n = n u / (1 - n u) (u = 2^-24, n the inner dimension) of the exact result while differing
  from it (a bound, not an identity). For general float32 operands the emulated TF32 matmul differs from
  the exact one, within 2 * 2^-11 + 2^-22 per product term. The logit gradient (a general float32) rounded
  to TF32 stays within 2^-11 per term.
* :func:`tensor_core_matmuls` takes the TF32 path only on CUDA with half-precision operands; on CPU and
  with fp32 parameters nothing changes.
* :func:`tf32_matmuls` sets cuBLAS's float32 precision for its block only and restores it on every exit
  path, whatever the user had set; run through the pass with the path forced, every one of the pass's
  matmuls (forward, recompute, gradients) runs under TF32, nothing else does, and a matmul that raises
  leaves the user's setting in place.

The CUDA path itself (log-probs, entropies and top-k against the float32 path; the on-policy invariant
through it) is tested in tests/test_gpu.py behind the ``gpu`` marker.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable

import pytest
import torch

from verl_ext.core import vocab_pass as vp

MATMUL = torch.backends.cuda.matmul
UNIT_ROUNDOFF_TF32 = 2.0**-11  # 10 explicit mantissa bits, round to nearest
UNIT_ROUNDOFF_FP32 = 2.0**-24
UNIT_ROUNDOFF_FP64 = 2.0**-53


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, finite) rounded to TF32's 10 explicit mantissa bits, ties to even, in bit arithmetic."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    kept_lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + kept_lsb) & ~0x1FFF & 0xFFFFFFFF
    signed = torch.where(rounded >= 2**31, rounded - 2**32, rounded)
    return signed.to(torch.int32).view(torch.float32)


def half_valued(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """float32 tensors holding ``dtype`` values over many binades (what the bf16 head and hidden states hold)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 12, shape, generator=gen).float())
    return x.to(dtype).float()


def exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.t()`` for float32-valued ``a`` and ``b``, each entry the exact sum rounded once to float64.

    A product of two float32 values has at most 48 significant bits, so it is exact in float64;
    :func:`math.fsum` adds the products without intermediate rounding. This is the reference a matmul's
    own rounding is measured against.
    """
    products = a.double()[:, None, :] * b.double()[None, :, :]
    return torch.tensor([[math.fsum(terms) for terms in row] for row in products.tolist()], dtype=torch.float64)


def tf32_matmul_emulated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A TF32 tensor-core matmul ``a @ b.t()`` without its accumulation error: the operands rounded to
    TF32, multiplied exactly and summed exactly (:func:`exact_matmul`). What TF32 itself changes is
    the difference to :func:`exact_matmul` of the original operands."""
    return exact_matmul(tf32_round(a), tf32_round(b))


def gamma(n: int, unit_roundoff: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): a sum of n exact terms in any order, each addition rounded to
    unit roundoff u, is within gamma_n * sum |term| of the exact sum (gamma_{n-1} suffices)."""
    return n * unit_roundoff / (1 - n * unit_roundoff)


def test_the_emulated_rounding_is_tf32s() -> None:
    one_ulp = torch.tensor([1.0 + 2.0**-10, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-12])
    assert tf32_round(one_ulp).tolist() == [1.0 + 2.0**-10, 1.0, 1.0 + 2 * 2.0**-10, 1.0]  # ties to even
    assert tf32_round(-one_ulp).tolist() == [-(1.0 + 2.0**-10), -1.0, -(1.0 + 2 * 2.0**-10), -1.0]
    x = torch.randn(10_000) * 1e3
    assert ((tf32_round(x) - x).abs() <= UNIT_ROUNDOFF_TF32 * x.abs()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_valued_operands_are_exact_in_tf32_so_a_tf32_matmul_errs_only_by_float32_summation(dtype: torch.dtype) -> None:
    """bf16 (8 significant bits) and fp16 (11) values are TF32 values (11): rounding keeps them, the
    product of two has at most 22 significant bits, exact in float32. So the TF32 matmul without its
    accumulation equals the exact product of the *original* operands bit for bit, and the only error
    left is float32 summation: the float32 matmul's, within gamma_n of the exact result and not zero."""
    a, b = half_valued((64, 96), dtype, seed=1), half_valued((64, 96), dtype, seed=2)
    assert torch.equal(tf32_round(a), a) and torch.equal(tf32_round(b), b)
    assert torch.equal((a * b).double(), a.double() * b.double())  # float32 products exact: <= 22 significant bits
    hidden, weight = half_valued((32, 128), dtype, seed=3), half_valued((256, 128), dtype, seed=4)
    exact = exact_matmul(hidden, weight)
    assert torch.equal(tf32_matmul_emulated(hidden, weight), exact)  # TF32 loses nothing on these operands
    float32 = (hidden @ weight.t()).double()
    summation_error = (float32 - exact).abs()
    magnitude = exact_matmul(hidden.abs(), weight.abs())  # sum |h_k w_k| per logit
    assert (summation_error <= gamma(hidden.shape[1], UNIT_ROUNDOFF_FP32) * magnitude).all()
    assert summation_error.max() > 0  # float32 accumulation does round: a bound, not an identity


def test_general_float32_operands_are_not_exact_in_tf32() -> None:
    """For general float32 operands TF32 rounding is real: per element and per matmul, the TF32 result
    differs from the exact one, by at most 2u + u^2 (u = 2^-11, one rounding per operand) of each
    product term's magnitude, plus the two float64 roundings of the references."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 96, generator=gen), torch.randn(64, 96, generator=gen)
    changed = (tf32_round(a) * tf32_round(b) != a * b).float().mean()
    assert changed > 0.9  # the bit-for-bit equality above is a property of half-precision values
    assert not torch.equal(tf32_round(a) @ tf32_round(b).t(), a @ b.t())
    rounding_error = (tf32_matmul_emulated(a, b) - exact_matmul(a, b)).abs()
    magnitude = exact_matmul(a.abs(), b.abs())
    per_term = 2 * UNIT_ROUNDOFF_TF32 + UNIT_ROUNDOFF_TF32**2
    assert (rounding_error <= (per_term + 4 * UNIT_ROUNDOFF_FP64) * magnitude).all()
    assert (rounding_error > 0).float().mean() > 0.99  # differs almost everywhere


def test_the_gradients_tf32_rounding_stays_within_its_bound() -> None:
    """The backward's ``dW = dx^T h`` and ``dh = dx W`` take the logit gradient ``dx`` rounded to TF32:
    each product term moves by at most 2^-11 of itself (plus float32 summation)."""
    gen = torch.Generator().manual_seed(6)
    dz = torch.randn(48, 300, generator=gen) * 1e-3
    hidden, weight = half_valued((48, 64), torch.bfloat16, seed=7), half_valued((300, 64), torch.bfloat16, seed=8)
    for tf32_result, exact, bound in (
        (tf32_round(dz).t() @ hidden, (dz.double().t() @ hidden.double()), dz.abs().double().t() @ hidden.abs().double()),
        (tf32_round(dz) @ weight, (dz.double() @ weight.double()), dz.abs().double() @ weight.abs().double()),
    ):
        error = (tf32_result.double() - exact).abs()
        assert (error <= (UNIT_ROUNDOFF_TF32 + 64 * 2.0**-24) * bound).all()
        assert error.max() > 0  # the rounding is real: this is a bound, not an identity


def cuda_like(dtype: torch.dtype) -> Any:
    return types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), dtype=dtype)


def test_the_tensor_core_path_is_taken_only_on_cuda_with_half_precision_operands() -> None:
    bf16, fp32 = cuda_like(torch.bfloat16), cuda_like(torch.float32)
    assert vp.tensor_core_matmuls(bf16, bf16) and vp.tensor_core_matmuls(cuda_like(torch.float16), bf16)
    assert not vp.tensor_core_matmuls(bf16, fp32) and not vp.tensor_core_matmuls(fp32, fp32)  # fp32 parameters
    assert not vp.tensor_core_matmuls(bf16, bf16, requested=False)  # forced float32
    cpu = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert not vp.tensor_core_matmuls(cpu, cpu) and not vp.tensor_core_matmuls(cpu, cpu, requested=True)


@pytest.fixture
def restored_precision() -> Any:
    saved = MATMUL.fp32_precision
    yield
    MATMUL.fp32_precision = saved


@pytest.mark.parametrize("user_setting", ["none", "ieee", "tf32"])
def test_the_setting_is_scoped_and_restored_also_on_error(restored_precision: None, user_setting: str) -> None:
    MATMUL.fp32_precision = user_setting
    with vp.tf32_matmuls(True):
        assert MATMUL.fp32_precision == "tf32"
    assert MATMUL.fp32_precision == user_setting
    with pytest.raises(RuntimeError, match="inside"):
        with vp.tf32_matmuls(True):
            raise RuntimeError("inside")
    assert MATMUL.fp32_precision == user_setting
    with vp.tf32_matmuls(False):
        assert MATMUL.fp32_precision == user_setting  # off: nothing touched


class MatmulSpy:
    """Records cuBLAS's float32 precision setting at each of the pass's matmul calls (``torch.mm``,
    ``@``, ``addmm_``); optionally raises at call ``fail_at``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> None:
        self.settings: list[str] = []
        self.fail_at = fail_at
        for owner, name in ((torch, "mm"), (torch.Tensor, "__matmul__"), (torch.Tensor, "addmm_")):
            monkeypatch.setattr(owner, name, self._spy(getattr(owner, name)))

    def _spy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            self.settings.append(MATMUL.fp32_precision)
            if self.fail_at is not None and len(self.settings) == self.fail_at:
                raise RuntimeError("a matmul failed")
            return original(*args, **kwargs)

        return spy


def pass_inputs() -> tuple[torch.Tensor, ...]:
    hidden = half_valued((40, 32), torch.bfloat16, seed=9).to(torch.bfloat16).requires_grad_()
    weight = (half_valued((700, 32), torch.bfloat16, seed=10) * 1e-2).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 700, (40,), generator=torch.Generator().manual_seed(11))
    return hidden, weight, labels


def test_every_matmul_of_the_pass_runs_under_tf32_and_nothing_else(restored_precision: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the setting changes no arithmetic, so the path can be forced here to see *where* it applies."""
    MATMUL.fp32_precision = "ieee"  # the user's
    monkeypatch.setattr(vp, "tensor_core_matmuls", lambda hidden, weight, requested=None: requested is not False)
    hidden, weight, labels = pass_inputs()
    spy = MatmulSpy(monkeypatch)
    out = vp.vocab_pass(hidden, weight, labels, 0.7, top_k=4, entropy_grad=True, chunk_bytes=4096)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    masses = vp.bucket_log_masses(hidden.detach(), weight.detach(), out.top_ids, 0.7, chunk_bytes=4096)
    assert len(spy.settings) > 6 and set(spy.settings) == {"tf32"}  # forward, recompute, gradients, buckets
    assert MATMUL.fp32_precision == "ieee" and torch.isfinite(masses).all()
    calls = len(spy.settings)
    x = torch.randn(3, 3)
    x @ x  # a matmul outside the pass keeps the user's setting
    assert spy.settings[calls:] == ["ieee"]


def test_a_matmul_that_raises_inside_the_pass_restores_the_users_setting(restored_precision: None, monkeypatch: pytest.MonkeyPatch) -> None:
    MATMUL.fp32_precision = "none"
    monkeypatch.setattr(vp, "tensor_core_matmuls", lambda hidden, weight, requested=None: True)
    hidden, weight, labels = pass_inputs()
    MatmulSpy(monkeypatch, fail_at=3)
    with pytest.raises(RuntimeError, match="a matmul failed"):
        vp.vocab_pass(hidden, weight, labels, chunk_bytes=4096)
    assert MATMUL.fp32_precision == "none"


def test_on_cpu_the_pass_is_unchanged_float32(restored_precision: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU: no TF32 anywhere (the decision is made, and says no), and auto equals forced float32 bit for bit."""
    hidden, weight, labels = pass_inputs()
    spy = MatmulSpy(monkeypatch)
    auto = vp.vocab_pass(hidden.detach(), weight.detach(), labels, 0.7, top_k=4)
    forced = vp.vocab_pass(hidden.detach(), weight.detach(), labels, 0.7, top_k=4, tensor_cores=False)
    assert "tf32" not in spy.settings
    for name in ("log_probs", "entropy", "top_log_probs", "top_ids"):
        assert torch.equal(getattr(auto, name), getattr(forced, name)), name
