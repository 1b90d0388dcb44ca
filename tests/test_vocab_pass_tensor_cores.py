"""The vocabulary pass at tensor-core rate: why TF32 keeps its logits exact, and that the setting is scoped.

* TF32 rounding emulated in bit arithmetic (round to nearest even on the 13 dropped mantissa bits), checked
  on known values, and an emulated TF32 device (:class:`EmulatedTF32`: while cuBLAS's setting says "tf32",
  each float32 matmul rounds its operands to TF32 first; the pass's decision is the product's dtype rule as
  if on CUDA). On it the product's own code runs against the exact reference (every float32 product is
  exact in float64; ``math.fsum`` adds them without error and rounds once): with bf16/fp16 operands the
  pass's logit matmul (``_float32_logits_into``) stays within the recursive-summation bound
  gamma_n = n u / (1 - n u) (u = 2^-24) of the exact logits while differing from them (a bound, not an
  identity), the pass under TF32 equals its float32 path bit for bit (TF32 keeps half-precision values), and
  its log-probs are within the logits' bound of the exact log-softmax. With fp32 operands the product
  refuses TF32 (the float32 path, within gamma_n), and the control shows why: the same matmul forced onto
  TF32 leaves that bound. The logit gradient (a general float32) rounded to TF32 stays within 2^-11 per
  term: the arithmetic only (the pass's bf16 gradients cannot show it on a CPU).
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
from collections.abc import Callable
from typing import Any

import pytest
import torch

from verl_ext.core import vocab_pass as vp

MATMUL = torch.backends.cuda.matmul
UNIT_ROUNDOFF_TF32 = 2.0**-11  # 10 explicit mantissa bits, round to nearest
UNIT_ROUNDOFF_FP32 = 2.0**-24


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


def test_the_gradients_tf32_rounding_stays_within_its_bound() -> None:
    """The arithmetic behind docs/losses.md's gradient claim, on the emulation only (no product code): the
    backward's ``dW = dx^T h`` and ``dh = dx W`` with the logit gradient ``dx`` rounded to TF32 move each product
    term by at most 2^-11 of itself (plus float32 summation). Through the product this is not observable on a
    CPU: with half-precision operands the pass returns its gradients in bf16/fp16, whose rounding (2^-8 / 2^-11)
    is not finer than TF32's."""
    gen = torch.Generator().manual_seed(6)
    dz = torch.randn(48, 300, generator=gen) * 1e-3
    hidden, weight = half_valued((48, 64), torch.bfloat16, seed=7), half_valued((300, 64), torch.bfloat16, seed=8)
    for tf32_result, exact, bound in (
        (
            tf32_round(dz).t() @ hidden,
            (dz.double().t() @ hidden.double()),
            dz.abs().double().t() @ hidden.abs().double(),
        ),
        (tf32_round(dz) @ weight, (dz.double() @ weight.double()), dz.abs().double() @ weight.abs().double()),
    ):
        error = (tf32_result.double() - exact).abs()
        assert (error <= (UNIT_ROUNDOFF_TF32 + 64 * 2.0**-24) * bound).all()
        assert error.max() > 0  # the rounding is real: this is a bound, not an identity


def cuda_like(dtype: torch.dtype) -> Any:
    return types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), dtype=dtype)


# ------------------------------------------------------------------------------------------------
# The product's matmuls on an emulated TF32 device, against the exact (math.fsum) reference
# ------------------------------------------------------------------------------------------------


class EmulatedTF32:
    """A CPU that honours cuBLAS's TF32 setting as a tensor core does: while ``fp32_precision`` is "tf32", each
    float32 ``torch.mm`` / ``@`` / ``addmm_`` rounds its two operands to TF32 (:func:`tf32_round`) and then
    multiplies them in float32. The vocabulary pass's TF32 decision is the product's own dtype rule
    (:func:`~verl_ext.core.vocab_pass.tensor_core_matmuls`) applied as if the tensors were on CUDA. ``rounded``
    counts the matmuls that ran as TF32."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rounded = 0
        decide = vp.tensor_core_matmuls
        monkeypatch.setattr(
            vp,
            "tensor_core_matmuls",
            lambda hidden, weight, requested=None: decide(cuda_like(hidden.dtype), cuda_like(weight.dtype), requested),
        )
        for owner, name in ((torch, "mm"), (torch.Tensor, "__matmul__"), (torch.Tensor, "addmm_")):
            monkeypatch.setattr(owner, name, self._rounding(getattr(owner, name), name == "addmm_"))

    @staticmethod
    def _round_in_layout(x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to TF32 in a tensor of ``x``'s strides (a transposed operand stays transposed, so the CPU
        kernel and its summation order are the ones the unrounded call would take)."""
        return x.clone().copy_(tf32_round(x))

    def _rounding(self, original: Callable[..., Any], in_place: bool) -> Callable[..., Any]:
        def matmul(*args: Any, **kwargs: Any) -> Any:
            first = 1 if in_place else 0  # addmm_(self, mat1, mat2): self is the accumulator, not an operand
            a, b = args[first], args[first + 1]
            if MATMUL.fp32_precision == "tf32" and a.dtype == b.dtype == torch.float32:
                self.rounded += 1
                args = (*args[:first], self._round_in_layout(a), self._round_in_layout(b), *args[first + 2 :])
            return original(*args, **kwargs)

        return matmul


def exact_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, ...]:
    """float64 ``log softmax(hidden @ weight^T / T)`` at ``labels`` from the exact logits (:func:`exact_matmul`),
    and per token the bound of the logits' float32 summation error, ``gamma_n * max_j sum_k |h_k w_jk| / T``."""
    exact = exact_matmul(hidden.float(), weight.float()) / temperature
    magnitude = exact_matmul(hidden.float().abs(), weight.float().abs()) / temperature
    log_probs = torch.log_softmax(exact, dim=1).gather(1, labels.unsqueeze(1)).squeeze(1)
    return log_probs, gamma(hidden.shape[1], UNIT_ROUNDOFF_FP32) * magnitude.max(dim=1).values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_pass_under_tf32_computes_the_exact_logits_up_to_float32_summation(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The product's logit matmul (``_float32_logits_into``) and the whole pass with half-precision operands on
    the emulated TF32 device: the pass takes the TF32 path, and since TF32 keeps bf16/fp16 values the logits are
    the exact (fsum) ones up to float32 summation -- within gamma_n, not equal -- and the pass's log-probs,
    entropies and top-k equal its float32 path's bit for bit and the exact log-probs within the logits' bound."""
    device = EmulatedTF32(monkeypatch)
    hidden, weight = half_valued((32, 128), dtype, seed=3).to(dtype), half_valued((256, 128), dtype, seed=4).to(dtype)
    tf32 = vp.tensor_core_matmuls(hidden, weight)
    assert tf32  # the product's rule: half-precision operands on CUDA take tensor cores
    logits = torch.empty(32, 256)
    vp._float32_logits_into(logits, hidden.float(), weight, tf32)
    exact = exact_matmul(hidden.float(), weight.float())
    error = (logits.double() - exact).abs()
    assert (error <= gamma(128, UNIT_ROUNDOFF_FP32) * exact_matmul(hidden.float().abs(), weight.float().abs())).all()
    assert error.max() > 0  # float32 accumulation does round: a bound, not an identity
    assert device.rounded == 1  # and it ran as one TF32 matmul

    hidden, weight = (
        half_valued((40, 32), dtype, seed=9).to(dtype),
        (half_valued((700, 32), dtype, seed=10) * 1e-2).to(dtype),
    )
    labels = torch.randint(0, 700, (40,), generator=torch.Generator().manual_seed(11))
    before = device.rounded
    out = vp.vocab_pass(hidden, weight, labels, 0.7, top_k=4, chunk_bytes=4096)
    assert device.rounded > before  # the pass ran its matmuls as TF32
    float32 = vp.vocab_pass(hidden, weight, labels, 0.7, top_k=4, chunk_bytes=4096, tensor_cores=False)
    for name in ("log_probs", "entropy", "top_log_probs", "top_ids"):
        assert torch.equal(getattr(out, name), getattr(float32, name)), name
    reference, logit_bound = exact_log_probs(hidden, weight, labels, 0.7)
    # log pi_y = z_y - logsumexp(z) moves by at most 2 logit errors, plus the float32 arithmetic of the reduction
    bound = 2 * logit_bound + 16 * UNIT_ROUNDOFF_FP32 * (reference.abs() + 1)
    assert ((out.log_probs.double() - reference).abs() <= bound).all()


def test_general_float32_operands_are_refused_tf32_by_the_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 parameters: the product's rule keeps the pass off TF32 (no matmul rounded, the float32 path bit for
    bit, the logits within gamma_n of the exact ones). The control: the same logit matmul forced onto TF32 on
    the emulated device is not within that bound -- what the refusal avoids."""
    device = EmulatedTF32(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(32, 96, generator=gen), torch.randn(200, 96, generator=gen)
    labels = torch.randint(0, 200, (32,), generator=gen)
    assert not vp.tensor_core_matmuls(hidden, weight) and not vp.tensor_core_matmuls(hidden.bfloat16(), weight)
    out = vp.vocab_pass(hidden, weight, labels, 0.7, top_k=4)
    float32 = vp.vocab_pass(hidden, weight, labels, 0.7, top_k=4, tensor_cores=False)
    assert (
        device.rounded == 0
        and torch.equal(out.log_probs, float32.log_probs)
        and torch.equal(out.entropy, float32.entropy)
    )
    exact, magnitude = exact_matmul(hidden, weight), exact_matmul(hidden.abs(), weight.abs())
    bound = gamma(96, UNIT_ROUNDOFF_FP32) * magnitude
    for tf32, within in ((False, True), (True, False)):
        logits = torch.empty(32, 200)
        vp._float32_logits_into(logits, hidden, weight, tf32)
        assert bool(((logits.double() - exact).abs() <= bound).all()) is within, tf32
    assert device.rounded == 1


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


def test_every_matmul_of_the_pass_runs_under_tf32_and_nothing_else(
    restored_precision: None, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_a_matmul_that_raises_inside_the_pass_restores_the_users_setting(
    restored_precision: None, monkeypatch: pytest.MonkeyPatch
) -> None:
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
