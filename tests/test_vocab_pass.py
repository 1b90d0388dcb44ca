"""The vocabulary pass (``verl_ext.core.vocab_pass``) against an fp64 reference of the materialised math.

* fp32 inputs: log pi(y), the entropy and the gradients w.r.t. the hidden states and the head
  weight (log-prob loss, and log-prob + entropy-bonus loss) within 1e-5 relative of fp64; top-k
  log-probs and ids equal the reference's; tied heads (one weight for the embedding and the head)
  get the embedding's and the head's gradient summed exactly as with the materialised path.
* bf16 inputs (verl's default mixed precision): every quantity's error against fp64 (computed on
  the same bf16 values) is measured for the materialised bf16 path (``F.linear`` in bf16, verl's
  ``logprobs_from_logits`` and ``entropy_from_logits``) and for the pass; the pass's error is at most
  the materialised path's and within the fp32 bound (it never rounds a logit to bf16).
* Results do not depend on the chunk size (rows are independent), per-token temperatures equal
  the per-row scalar computation, confident rows keep relative precision, and the entropy carries
  no graph unless asked.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from verl_ext.core.vocab_pass import bucket_log_masses, vocab_pass

TOKENS, HIDDEN, VOCAB = 96, 32, 1000


def make_inputs(
    dtype: torch.dtype, seed: int = 0, scale_range: tuple[float, float] = (-1.0, 1.5)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states whose logit scale is log-spaced over tokens: from nearly uniform to
    confident (entropy down to ~1e-10 nats), as a trained policy's tokens are."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen) * torch.logspace(*scale_range, TOKENS).unsqueeze(1)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    return hidden.to(dtype), weight.to(dtype), _labels(hidden, weight, gen)


def exact_logit_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 inputs whose logits ``hidden @ weight^T`` are exact in float32 (dyadic values: products
    are multiples of 2^-5 times a power of two, sums stay below 2^24 units), so an fp64 reference
    on the same inputs measures the pass's own error, not the matmul's rounding. Scales 2^-3..2^4
    run from nearly uniform rows to entropies ~1e-20."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-4, 5, (TOKENS, 1), generator=gen).float()
    hidden = torch.randint(-8, 9, (TOKENS, HIDDEN), generator=gen).float() / 8 * scale
    weight = torch.randint(-4, 5, (VOCAB, HIDDEN), generator=gen).float() / 4
    assert torch.equal((hidden.double() @ weight.double().t()).float().double(), hidden.double() @ weight.double().t())
    return hidden, weight, _labels(hidden, weight, gen)


def _labels(hidden: torch.Tensor, weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random labels, half of them the arg-max token (the sampled token of a confident policy)."""
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels[::2] = (hidden.double() @ weight.double().t()).argmax(-1)[::2]
    return labels


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    entropy_coeff: float,
    g: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """fp64 log-probs, entropies, and the gradients of ``sum(g * logp) + coeff * sum(g * H)``.

    ``logsumexp`` is taken as ``max + log1p(r)`` (r: the other terms' sum) even in fp64: the plain
    ``log_softmax`` loses 1e-16 absolute to ``1 + r - 1``, i.e. 1% of a confident token's
    ``log pi ~ -1e-14``, more than the fp32 pass under test."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    t = temperature if not isinstance(temperature, torch.Tensor) else temperature.double().unsqueeze(1)
    z = (h @ w.t()) / t
    arg_top = z.detach().argmax(dim=-1, keepdim=True)
    top = z.gather(1, arg_top)
    shifted = z - top
    rest = shifted.exp().scatter(1, arg_top, 0.0).sum(-1, keepdim=True)
    log_p = shifted - torch.log1p(rest)
    logp_y = log_p.gather(1, labels.unsqueeze(1)).squeeze(1)
    p = shifted.exp() / (1 + rest)
    entropy = torch.log1p(rest).squeeze(1) - (p * shifted).sum(-1)
    (logp_y * g).sum().add(entropy_coeff * (entropy * g).sum()).backward()
    return logp_y.detach(), entropy.detach(), h.grad, w.grad, log_p.detach()


def ours(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    entropy_coeff: float,
    g: torch.Tensor,
    chunk_bytes: Optional[int] = None,
    top_k: int = 0,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = vocab_pass(h, w, labels, temperature, top_k=top_k, entropy_grad=entropy_coeff != 0, chunk_bytes=chunk_bytes)
    loss = (out.log_probs * g).sum()
    if entropy_coeff:
        loss = loss + entropy_coeff * (out.entropy * g).sum()
    loss.backward()
    return out, h.grad, w.grad


def rel_err(a: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """Elementwise relative error, max over elements."""
    return float(((a.detach().double() - ref).abs() / ref.abs().clamp_min(floor)).max())


def norm_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of a gradient tensor, as ||a - ref|| / ||ref|| (rows of near-zero gradient
    make elementwise relative errors meaningless)."""
    return float((a.detach().double() - ref).norm() / ref.norm())


@pytest.fixture(params=["one_slice", "sliced"])
def vocab_slices(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The whole vocabulary in one slice, or 8 slices of 128 columns (the last one 104): the
    slices' row sums are merged (``verl_ext.core.entropy.merge_row_stats``)."""
    if request.param == "sliced":
        monkeypatch.setattr("verl_ext.core.vocab_pass.VOCAB_SLICE", 128)
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.3])
def test_fp32_matches_fp64_reference(temperature: float, entropy_coeff: float, vocab_slices: str) -> None:
    """Exact fp32 logits (and power-of-two temperatures, exact in fp32): the pass's reductions and
    gradients are within 1e-5 relative of fp64, confident rows included."""
    hidden, weight, labels = exact_logit_inputs()
    g = torch.randn(TOKENS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_lp, ref_h, ref_gh, ref_gw, _ = reference(hidden, weight, labels, temperature, entropy_coeff, g)
    assert (ref_h < 1e-6).any() and (ref_h > 1).any(), "the sample must cover confident and flat rows"
    out, gh, gw = ours(hidden, weight, labels, temperature, entropy_coeff, g.float(), chunk_bytes=16 * VOCAB * 4)
    assert out.log_probs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    assert rel_err(out.log_probs, ref_lp) <= 1e-5
    big = ref_h >= 1e-6
    assert rel_err(out.entropy[big], ref_h[big]) <= 1e-5
    assert float((out.entropy.detach()[~big].double() - ref_h[~big]).abs().max()) <= 1e-10
    assert norm_rel_err(gh, ref_gh) <= 1e-5
    assert norm_rel_err(gw, ref_gw) <= 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_random_inputs_no_worse_than_the_materialised_fp32_path(temperature: float) -> None:
    """Random fp32 inputs: the fp32 matmul rounds each logit (|dx| ~ 6e-8 |x|), an error every fp32
    path shares. The pass's error against fp64 is at most the materialised fp32 path's
    (``F.linear`` + ``log_softmax`` + the project's ``entropy_fp32``), gradients within 1e-5."""
    from verl_ext.core.entropy import entropy_fp32

    hidden, weight, labels = make_inputs(torch.float32)
    g = torch.randn(TOKENS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_lp, ref_h, ref_gh, ref_gw, _ = reference(hidden, weight, labels, temperature, 0.0, g)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logits = F.linear(h, w) / temperature
    mat_lp = torch.log_softmax(logits, -1).gather(1, labels.unsqueeze(1)).squeeze(1)
    mat_h = entropy_fp32(logits)
    (mat_lp.double() * g).sum().backward()
    out, gh, gw = ours(hidden, weight, labels, temperature, 0.0, g.float(), chunk_bytes=16 * VOCAB * 4)
    assert rel_err(out.log_probs, ref_lp) <= rel_err(mat_lp, ref_lp)
    assert (out.entropy.double() - ref_h).abs().max() <= 2 * (mat_h.double() - ref_h).abs().max()
    assert norm_rel_err(gh, ref_gh) <= max(1e-5, norm_rel_err(h.grad, ref_gh))
    assert norm_rel_err(gw, ref_gw) <= max(1e-5, norm_rel_err(w.grad, ref_gw))


def test_fp32_top_k_matches_reference(vocab_slices: str) -> None:
    hidden, weight, labels = make_inputs(torch.float32, scale_range=(-1.0, 0.5))
    g = torch.ones(TOKENS, dtype=torch.float64)
    *_, ref_log_p = reference(hidden, weight, labels, 1.0, 0.0, g)
    out, _, _ = ours(hidden, weight, labels, 1.0, 0.0, g.float(), top_k=5)
    ref_values, ref_ids = ref_log_p.topk(5, dim=-1)
    assert out.top_ids is not None and out.top_log_probs is not None
    assert torch.equal(out.top_ids, ref_ids)
    assert rel_err(out.top_log_probs, ref_values) <= 1e-5
    assert not out.top_log_probs.requires_grad


def test_top_k_across_a_last_slice_narrower_than_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 333 columns: the last holds one (1000 = 3 x 333 + 1), fewer than k, and the merged top-k is
    still the whole vocabulary's."""
    monkeypatch.setattr("verl_ext.core.vocab_pass.VOCAB_SLICE", 333)
    hidden, weight, labels = make_inputs(torch.float32, scale_range=(-1.0, 0.5))
    weight[-1] = hidden.mean(0) / hidden.mean(0).norm() * 4  # the last column among some rows' top-5
    g = torch.ones(TOKENS, dtype=torch.float64)
    *_, ref_log_p = reference(hidden, weight, labels, 1.0, 0.0, g)
    out, _, _ = ours(hidden, weight, labels, 1.0, 0.0, g.float(), top_k=5)
    ref_values, ref_ids = ref_log_p.topk(5, dim=-1)
    assert (ref_ids == VOCAB - 1).any()
    assert torch.equal(out.top_ids, ref_ids)
    assert rel_err(out.top_log_probs, ref_values) <= 1e-5


@pytest.mark.parametrize("tokens, vocab", [(1, 1), (3, 33), (96, 1000), (5, 9000), (20000, 151936)])
def test_each_sweeps_float32_block_is_the_largest_that_fits_chunk_bytes(tokens: int, vocab: int) -> None:
    """The forward's ``rows x slice`` block and the backward's ``tokens x slice`` logits: at most
    ``chunk_bytes`` of float32 (one row where a row alone is larger), and no smaller than that allows."""
    from verl_ext.core.vocab_pass import VOCAB_SLICE, _backward_slice, _forward_blocks

    width = min(vocab, VOCAB_SLICE)
    for chunk in sorted({1, 3, 4, 7, 4 * width - 1, 4 * width, 8 * width - 1, 8 * width, 4 * tokens * 3, 2**20, 2**33}):
        rows, slice_width = _forward_blocks(tokens, vocab, chunk)
        assert slice_width == width and 1 <= rows <= tokens
        assert rows == 1 or rows * 4 * width <= chunk, (tokens, vocab, chunk, rows)
        assert rows == tokens or (rows + 1) * 4 * width > chunk, (tokens, vocab, chunk, rows)
        head_rows = _backward_slice(tokens, vocab, chunk)
        assert 1 <= head_rows <= vocab
        assert head_rows == 1 or 4 * tokens * head_rows <= chunk, (tokens, vocab, chunk, head_rows)
        assert head_rows == vocab or 4 * tokens * (head_rows + 1) > chunk, (tokens, vocab, chunk, head_rows)


def test_the_forward_computes_each_logit_once(vocab_slices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 16 rows (``chunk_bytes`` for 16 rows of the widest slice) over 96 tokens, each against every
    vocabulary slice in turn: each ``(block, slice)`` logits computed once, at the slice's width."""
    import verl_ext.core.vocab_pass as module

    calls: list[tuple[int, int]] = []
    compute = module._float32_logits_into

    def counted(out: torch.Tensor, hidden32: torch.Tensor, weight_slice: torch.Tensor, tf32: bool) -> None:
        calls.append((hidden32.shape[0], weight_slice.shape[0]))
        compute(out, hidden32, weight_slice, tf32)

    monkeypatch.setattr(module, "_float32_logits_into", counted)
    hidden, weight, labels = make_inputs(torch.float32)
    width = min(VOCAB, module.VOCAB_SLICE)
    vocab_pass(hidden, weight, labels, 1.0, chunk_bytes=16 * 4 * width)
    slices = [min(v0 + width, VOCAB) - v0 for v0 in range(0, VOCAB, width)]
    assert calls == [(16, columns) for _ in range(TOKENS // 16) for columns in slices]
    assert len(slices) == (1 if vocab_slices == "one_slice" else 8)


@pytest.mark.parametrize("requested", [None, False, True])
def test_tensor_cores_reaches_the_decision(requested: Optional[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """``tensor_cores`` of :func:`vocab_pass` and :func:`bucket_log_masses` is the ``requested`` of
    :func:`tensor_core_matmuls` (``False`` forces float32 on a GPU; on the CPU, where the decision is always
    float32, nothing else shows it)."""
    import verl_ext.core.vocab_pass as module

    asked: list[Optional[bool]] = []
    decide = module.tensor_core_matmuls

    def recorded(hidden: torch.Tensor, weight: torch.Tensor, request: Optional[bool] = None) -> bool:
        asked.append(request)
        return decide(hidden, weight, request)

    monkeypatch.setattr(module, "tensor_core_matmuls", recorded)
    hidden, weight, labels = make_inputs(torch.float32)
    out = vocab_pass(hidden, weight, labels, 1.0, top_k=4, tensor_cores=requested)
    bucket_log_masses(hidden, weight, out.top_ids, 1.0, tensor_cores=requested)
    assert asked == [requested, requested]


def test_each_slices_logits_are_written_into_the_blocks_buffer() -> None:
    """``_logit_slices`` yields each slice's ``(rows, v1 - v0)`` logits as a view of the one buffer (no new
    allocation per slice), the last, narrower slice included, each ``hidden @ weight[v0:v1]^T / T``."""
    from verl_ext.core.vocab_pass import _logit_slices

    hidden, weight, _ = exact_logit_inputs()
    rows, width = 7, 128
    buffer = torch.empty(rows, width)
    inv_t = torch.full((rows, 1), 2.0)
    seen = []
    for v0, v1, z in _logit_slices(hidden[:rows], weight, inv_t, buffer, False):
        assert z.shape == (rows, v1 - v0) and z.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert z.stride() == buffer.stride()  # the buffer's own columns, not a resized view of its memory
        assert torch.equal(z, hidden[:rows] @ weight[v0:v1].t() * 2.0)
        seen.append((v0, v1))
    assert seen == [(v0, min(v0 + width, VOCAB)) for v0 in range(0, VOCAB, width)] and seen[-1] == (896, 1000)


def test_tied_head_gradients_match_reference() -> None:
    """One weight as embedding and head: hidden = RMS-free toy ``E[ids] * s``; logits ``E h``."""
    gen = torch.Generator().manual_seed(3)
    embedding = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels = torch.roll(ids, -1)
    scale = torch.logspace(0, 2, TOKENS).unsqueeze(1)
    g = torch.randn(TOKENS, generator=gen, dtype=torch.float64)

    e64 = embedding.double().requires_grad_(True)
    log_p = torch.log_softmax((e64[ids] * scale.double()) @ e64.t(), dim=-1)
    (log_p.gather(1, labels.unsqueeze(1)).squeeze(1) * g).sum().backward()

    e32 = embedding.clone().requires_grad_(True)
    out = vocab_pass(e32[ids] * scale, e32, labels, chunk_bytes=8 * VOCAB * 4)
    (out.log_probs * g.float()).sum().backward()
    assert norm_rel_err(e32.grad, e64.grad) <= 1e-5


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.3])
def test_bf16_error_is_at_most_the_materialised_bf16_paths(entropy_coeff: float, vocab_slices: str) -> None:
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    hidden, weight, labels = make_inputs(torch.bfloat16)
    temperature = 0.7
    g = torch.randn(TOKENS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_lp, ref_h, ref_gh, ref_gw, _ = reference(hidden, weight, labels, temperature, entropy_coeff, g)

    # verl's materialised path at bf16: logits in bf16, scaled in bf16, verl's functions
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logits = F.linear(h, w) / temperature
    mat_lp = logprobs_from_logits(logits, labels)
    mat_h = entropy_from_logits(logits)
    ((mat_lp.double() * g).sum() + entropy_coeff * (mat_h.double() * g).sum()).backward()

    out, gh, gw = ours(hidden, weight, labels, temperature, entropy_coeff, g.float(), chunk_bytes=16 * VOCAB * 4)
    errors = {
        "log_probs": ((out.log_probs.double() - ref_lp).abs().max(), (mat_lp.double() - ref_lp).abs().max()),
        "entropy": ((out.entropy.double() - ref_h).abs().max(), (mat_h.double() - ref_h).abs().max()),
        "grad_hidden": (norm_rel_err(gh, ref_gh), norm_rel_err(h.grad, ref_gh)),
        "grad_weight": (norm_rel_err(gw, ref_gw), norm_rel_err(w.grad, ref_gw)),
    }
    for name, (pass_error, materialised_error) in errors.items():
        assert pass_error <= materialised_error, (
            f"{name}: pass {pass_error:.3e} > materialised bf16 {materialised_error:.3e}"
        )
    # the pass only rounds its outputs: log-probs and entropies at fp32 accuracy on bf16 inputs
    assert rel_err(out.log_probs, ref_lp) <= 1e-5
    big = ref_h >= 1e-6
    assert rel_err(out.entropy[big], ref_h[big]) <= 1e-5
    # the gradients are rounded once, to bf16 (relative 2^-8 per element)
    assert errors["grad_hidden"][0] <= 2**-8 and errors["grad_weight"][0] <= 2**-8


def test_rows_do_not_depend_on_the_chunking(vocab_slices: str) -> None:
    """With exact logits the reductions are bit-identical whatever the block of rows (the vocabulary
    slices are fixed); the gradients sum over tokens in another order, so they agree to rounding."""
    hidden, weight, labels = exact_logit_inputs()
    g = torch.randn(TOKENS, generator=torch.Generator().manual_seed(2))
    results = [ours(hidden, weight, labels, 0.9, 0.0, g, chunk_bytes=rows * VOCAB * 4) for rows in (1, 7, TOKENS)]
    for out, gh, gw in results[1:]:
        assert torch.equal(out.entropy, results[0][0].entropy)
        assert torch.equal(out.log_probs, results[0][0].log_probs)
        assert norm_rel_err(gh, results[0][1].double()) <= 1e-6
        assert norm_rel_err(gw, results[0][2].double()) <= 1e-6


def test_per_token_temperature_equals_scalar_rows() -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    temps = torch.tensor([0.5, 1.0, 1.3]).repeat_interleave(TOKENS // 3)
    per_token = vocab_pass(hidden, weight, labels, temps)
    for value in (0.5, 1.0, 1.3):
        rows = temps == value
        scalar = vocab_pass(hidden[rows], weight, labels[rows], value)
        torch.testing.assert_close(per_token.log_probs[rows], scalar.log_probs, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(per_token.entropy[rows], scalar.entropy, rtol=1e-6, atol=1e-12)


def test_entropy_is_graph_free_unless_asked_and_bad_input_is_named() -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    out = vocab_pass(hidden.requires_grad_(True), weight, labels)
    assert out.log_probs.requires_grad and not out.entropy.requires_grad
    with_grad = vocab_pass(hidden, weight, labels, entropy_grad=True)
    assert with_grad.entropy.requires_grad
    with pytest.raises(ValueError, match="temperature"):
        vocab_pass(hidden, weight, labels, 0.0)
    with pytest.raises(ValueError, match="labels"):
        vocab_pass(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="top_k"):
        vocab_pass(hidden, weight, labels, top_k=VOCAB + 1)


# ------------------------------------------------------------------------------------------------
# bucket_log_masses: the k + 1 buckets of kl_full, from the pass's float32 slices
# ------------------------------------------------------------------------------------------------


def reference_buckets(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """fp64 log-masses on ``ids`` plus the tail (every other id), from the full log-softmax."""
    from tests.loss_reference import bucket_log_masses_fp64

    return bucket_log_masses_fp64((hidden.double() @ weight.double().t()) / temperature, ids)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_bucket_log_masses_match_fp64_and_k_equal_vocab_is_the_exact_kl(temperature: float, vocab_slices: str) -> None:
    """Exact fp32 logits: each log-mass within 1e-5 of fp64 (relative to max(1, |log p|)); at
    k = vocabulary the coarsened KL between two policies is the full-vocabulary KL (1e-6 relative)."""
    from verl_ext.core.coarsened_kl import coarsened_kl

    old_hidden, weight, _ = exact_logit_inputs(0)
    new_hidden, _, _ = exact_logit_inputs(1)
    for k in (8, VOCAB):
        ids = (old_hidden.double() @ weight.double().t()).topk(k, dim=-1).indices
        old = bucket_log_masses(old_hidden, weight, ids, temperature)
        new = bucket_log_masses(new_hidden, weight, ids, temperature)
        for got, hidden in ((old, old_hidden), (new, new_hidden)):
            ref = reference_buckets(hidden, weight, ids, temperature)
            finite = torch.isfinite(ref)
            assert torch.equal(torch.isfinite(got), finite)  # k = vocabulary: the tail alone is -inf
            assert float(((got.double() - ref)[finite].abs() / ref[finite].abs().clamp_min(1.0)).max()) <= 1e-5
        if k == VOCAB:
            assert torch.isneginf(old[:, -1]).all()
            for direction in ("forward", "reverse"):
                exact = coarsened_kl(
                    reference_buckets(new_hidden, weight, ids, temperature),
                    reference_buckets(old_hidden, weight, ids, temperature),
                    direction,
                )
                assert rel_err(coarsened_kl(new, old, direction), exact) <= 1e-6


def test_bucket_log_masses_rows_do_not_depend_on_the_chunking_and_bad_ids_are_named(vocab_slices: str) -> None:
    """Row blocks of 1, 7 and all tokens give bit-identical results on exact logits; the tail is a
    direct sum (a tail of ~1e-20 keeps its digits); malformed ids raise naming the shapes."""
    hidden, weight, _ = exact_logit_inputs(0)
    ids = (hidden.double() @ weight.double().t()).topk(4, dim=-1).indices
    results = [bucket_log_masses(hidden, weight, ids, 0.9, chunk_bytes=rows * 4 * VOCAB) for rows in (1, 7, TOKENS)]
    for other in results[1:]:
        assert torch.equal(other, results[0])
    ref = reference_buckets(hidden, weight, ids, 0.9)
    tiny = ref[:, -1] < -30.0  # confident rows: the tail holds < 1e-13 of the mass (down to e^-37.8 here)
    assert bool(tiny.any())
    assert float(((results[0][tiny, -1].double() - ref[tiny, -1]) / ref[tiny, -1]).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match=r"the number of bucket ids k=1001 must lie in \[1, vocabulary size 1000\]"):
        bucket_log_masses(hidden, weight, torch.zeros(TOKENS, VOCAB + 1, dtype=torch.long))
    out_of_range = ids.clone()
    out_of_range[3, 1] = VOCAB + 4
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab=1000\), got \[\d+, 1004\].*divclip_old_topk_ids"):
        bucket_log_masses(hidden, weight, out_of_range)


def test_bucket_log_masses_per_token_temperature_equals_scalar_rows(vocab_slices: str) -> None:
    """verl's per-token temperatures (``temperature_rmpad``): each row as its scalar computation
    (bit for bit: exact logits), within 1e-5 of fp64."""
    hidden, weight, _ = exact_logit_inputs(1)
    ids = (hidden.double() @ weight.double().t()).topk(6, dim=-1).indices.to(torch.int32)
    temperature = torch.linspace(0.5, 1.5, TOKENS)
    got = bucket_log_masses(hidden, weight, ids, temperature)
    for row in (0, 17, TOKENS - 1):
        alone = bucket_log_masses(hidden[row : row + 1], weight, ids[row : row + 1], float(temperature[row]))
        torch.testing.assert_close(got[row : row + 1], alone, rtol=0, atol=0)
        ref = reference_buckets(hidden[row : row + 1], weight, ids[row : row + 1].long(), float(temperature[row]))
        assert float(((got[row].double() - ref[0]).abs() / ref[0].abs().clamp_min(1.0)).max()) <= 1e-5


# ------------------------------------------------------------------------------------------------
# The pass's contract at its edges: dtype and device of everything it makes, its defaults, the shapes
# it takes and the inputs it refuses (held by mutation testing: tools/mutation.py)
# ------------------------------------------------------------------------------------------------


def _pass_and_grads(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: Any, entropy_grad: bool
) -> tuple[torch.Tensor, ...]:
    """Every output and both gradients of one call (log-prob loss, plus the entropy's when it has a graph)."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = vocab_pass(h, w, labels, temperature, top_k=4, entropy_grad=entropy_grad, chunk_bytes=7 * VOCAB * 4)
    loss = out.log_probs.sum() + (0.3 * out.entropy.sum() if entropy_grad else 0.0)
    loss.backward()
    return out.log_probs, out.entropy, out.top_log_probs, out.top_ids, h.grad, w.grad


@pytest.mark.parametrize("default_dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_pass_computes_in_float32_whatever_the_default_dtype(
    default_dtype: torch.dtype, entropy_grad: bool, vocab_slices: str
) -> None:
    """Every buffer the pass makes is float32 (ids int64) by its own choice, not the process's default dtype: a
    float64 or float16 default changes no bit of any output or gradient (random inputs, not the exact-logit ones,
    so that a buffer rounded through another dtype shows)."""
    hidden, weight, labels = make_inputs(torch.float32)
    temperature = torch.linspace(0.6, 1.4, TOKENS)
    expected = _pass_and_grads(hidden, weight, labels, temperature, entropy_grad)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        got = _pass_and_grads(hidden, weight, labels, temperature, entropy_grad)
        scalar_t = _pass_and_grads(hidden, weight, labels, 0.7, entropy_grad)
    finally:
        torch.set_default_dtype(previous)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.float32, torch.int64] + [torch.float32] * 2
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(scalar_t[0], _pass_and_grads(hidden, weight, labels, 0.7, entropy_grad)[0])


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [0.7, "per token"])
def test_the_pass_stays_on_its_inputs_device_under_another_default_device(
    entropy_grad: bool, temperature: Any, vocab_slices: str
) -> None:
    """Every buffer the pass makes, forward and backward, is put on the inputs' device: under another default device
    (``meta``, which holds no values) the outputs and gradients are the CPU ones, bit for bit."""
    hidden, weight, labels = make_inputs(torch.float32)
    t = torch.linspace(0.6, 1.4, TOKENS) if temperature == "per token" else temperature
    expected = _pass_and_grads(hidden, weight, labels, t, entropy_grad)
    with torch.device("meta"):
        got = _pass_and_grads(hidden, weight, labels, t, entropy_grad)
    for a, b in zip(got, expected, strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b)


def test_no_top_k_unless_asked() -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    for out in (vocab_pass(hidden, weight, labels), vocab_pass(hidden, weight, labels, top_k=0)):
        assert out.top_log_probs is None and out.top_ids is None
    hidden.requires_grad_(True)
    with_entropy_grad = vocab_pass(hidden, weight, labels, top_k=3, entropy_grad=True)
    assert with_entropy_grad.top_log_probs.shape == (TOKENS, 3) and not with_entropy_grad.top_log_probs.requires_grad
    assert with_entropy_grad.top_ids.dtype == torch.int64


def test_leading_dims_and_narrow_integer_labels_give_the_flat_int64_call() -> None:
    """``(batch, seq, hidden)`` states are the flat call reshaped (seq != hidden, so a wrong axis shows); labels of
    any integer dtype (uint8, int16) are the int64 labels' results, gradients included."""
    hidden, weight, labels = make_inputs(torch.float32)
    vocab = 200
    weight, labels = weight[:vocab].contiguous(), labels % vocab
    flat = _pass_and_grads(hidden, weight, labels, 0.8, True)
    h = hidden.detach().clone().reshape(2, TOKENS // 2, HIDDEN).requires_grad_(True)
    out = vocab_pass(h, weight, labels.reshape(2, TOKENS // 2), 0.8, top_k=4)
    assert out.log_probs.shape == (2, TOKENS // 2) and out.top_ids.shape == (2, TOKENS // 2, 4)
    assert torch.equal(out.log_probs.reshape(-1), flat[0]) and torch.equal(out.top_ids.reshape(-1, 4), flat[3])
    for dtype in (torch.uint8, torch.int16):
        narrow = _pass_and_grads(hidden, weight, labels.to(dtype), 0.8, True)
        for a, b in zip(narrow, flat, strict=True):
            assert torch.equal(a, b), dtype


def test_the_pass_refuses_bad_input_naming_it() -> None:
    """Each refusal's whole message: what was wrong and with which values (a message lost or naming another key
    fails here), and the valid edges of each check accepted."""
    hidden, weight, labels = make_inputs(torch.float32)
    cases = [
        ((hidden[:, :-1], weight, labels), {}, r"hidden \(96, 31\) and head weight \(1000, 32\) do not match"),
        ((hidden, weight.unsqueeze(-1), labels), {}, r"hidden \(96, 32\) and head weight \(1000, 32, 1\) do not match"),
        (
            (hidden, weight, labels, 0.0),
            {},
            r"temperature must be finite and > 0 \(actor_rollout_ref\.rollout\.temperature\)",
        ),
        (
            (hidden, weight, labels, torch.ones(2)),
            {},
            r"temperature has 2 values for 96 tokens \(give a scalar or one per token\)",
        ),
        ((hidden, weight, labels), {"top_k": VOCAB + 1}, r"top_k=1001 must lie in \[0, vocabulary size 1000\]"),
        ((hidden, weight, labels), {"chunk_bytes": 0}, r"chunk_bytes must be positive, got 0"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=f"^{message}$"):
            vocab_pass(*args, **kwargs)
    # the edges: a top-k wider than the hidden size, a one-byte budget (one row, one column at a time), and a
    # one-value temperature tensor as every token's
    exact_h, exact_w, exact_y = exact_logit_inputs()
    assert vocab_pass(exact_h, exact_w, exact_y, top_k=HIDDEN + 1).top_ids.shape == (TOKENS, HIDDEN + 1)
    one_byte, default = vocab_pass(exact_h, exact_w, exact_y, chunk_bytes=1), vocab_pass(exact_h, exact_w, exact_y)
    assert torch.equal(one_byte.log_probs, default.log_probs) and torch.equal(one_byte.entropy, default.entropy)
    for t in (torch.tensor(0.7), torch.tensor([0.7])):
        assert torch.equal(
            vocab_pass(hidden, weight, labels, t).log_probs, vocab_pass(hidden, weight, labels, 0.7).log_probs
        )


def test_zero_tokens_give_empty_outputs_and_zero_gradients() -> None:
    weight = make_inputs(torch.float32)[1].requires_grad_(True)
    hidden = torch.zeros(0, HIDDEN, requires_grad=True)
    out = vocab_pass(hidden, weight, torch.zeros(0, dtype=torch.int64), top_k=2)
    assert out.log_probs.shape == (0,) and out.top_ids.shape == (0, 2)
    out.log_probs.sum().backward()
    assert hidden.grad.shape == (0, HIDDEN) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_a_temperature_tensor_of_any_float_dtype_is_read_in_float32() -> None:
    """A bf16 (or float64) per-token temperature is converted to float32 before its reciprocal: the results equal
    those of a float32 tensor holding the same values, bit for bit."""
    hidden, weight, labels = make_inputs(torch.float32)
    t_bf16 = torch.linspace(0.6, 1.4, TOKENS).to(torch.bfloat16)
    expected = vocab_pass(hidden, weight, labels, t_bf16.float())
    for t in (t_bf16, t_bf16.double()):
        got = vocab_pass(hidden, weight, labels, t)
        assert torch.equal(got.log_probs, expected.log_probs) and torch.equal(got.entropy, expected.entropy), t.dtype


def test_tf32_matmuls_sets_the_legacy_flag_where_fp32_precision_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``fp32_precision`` (older torch), ``allow_tf32`` is switched on inside the block and given back after
    it, also when the block raises; ``enabled=False`` touches nothing."""
    from types import SimpleNamespace

    from verl_ext.core.vocab_pass import tf32_matmuls

    legacy = SimpleNamespace(allow_tf32=False)
    monkeypatch.setattr(torch.backends.cuda, "matmul", legacy)
    with tf32_matmuls(True):
        assert legacy.allow_tf32 is True
    assert legacy.allow_tf32 is False
    with pytest.raises(RuntimeError, match="inside"), tf32_matmuls(True):
        raise RuntimeError("inside")
    assert legacy.allow_tf32 is False
    with tf32_matmuls(False):
        assert legacy.allow_tf32 is False
