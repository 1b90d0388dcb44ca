"""The ratio interval [l, u] of a per-token budget D(w_t) <= delta (D convex in log w, D(1) = 0): Lambert-W
closed forms for KL3 (ATR-GRPO Theorem 4.2) and IS-KL3, exponentials for KL1 and KL2, per-token bounds for TRGPPO
(numeric) and DCPO. Scalars are float64, per-token quantities torch tensors (the table: docs/losses.md).
"""

from __future__ import annotations

import math

import torch

_INV_E = math.exp(-1.0)


def lambert_w(z: float, branch: int = 0) -> float:
    """Real Lambert W, w * e^w = z, on branch 0 (w >= -1, z >= -1/e) or -1 (w <= -1, -1/e <= z < 0): Halley's
    iteration from the branch-point series or the asymptotic start, to machine precision."""
    if branch not in (0, -1):
        raise ValueError(f"lambert_w: branch must be 0 or -1, got {branch}")
    if math.isnan(z) or z < -_INV_E - 1e-15:
        raise ValueError(f"lambert_w: z={z!r} is below the branch point -1/e")
    if branch == -1 and z >= 0.0:
        raise ValueError(f"lambert_w: branch -1 needs -1/e <= z < 0, got z={z!r}")
    z = max(z, -_INV_E)
    if z == -_INV_E:
        return -1.0
    # Initial guess.
    if z < -0.25:
        p = math.sqrt(max(2.0 * (math.e * z + 1.0), 0.0))
        p = p if branch == 0 else -p
        w = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p**3
    elif branch == 0:
        w = math.log1p(z) if z < 3.0 else math.log(z) - math.log(math.log(z))
    else:
        lz = math.log(-z)
        w = lz - math.log(-lz)
    for _ in range(64):
        ew = math.exp(w)
        f = w * ew - z
        wp1 = w + 1.0
        if wp1 == 0.0:
            break
        step = f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        w -= step
        if abs(step) <= 1e-15 * (1.0 + abs(w)):
            break
    return w


def kl3_ratio_bounds(delta: float) -> tuple[float, float]:
    """Ratio interval of KL3_t = w - 1 - log w <= delta (ATR-GRPO, Theorem 4.2)."""
    _check_delta(delta)
    z = -math.exp(-1.0 - delta)
    return -lambert_w(z, 0), -lambert_w(z, -1)


def kl1_ratio_bounds(delta: float) -> tuple[float, float]:
    """Ratio interval of |k1| = |log w| <= delta."""
    _check_delta(delta)
    return math.exp(-delta), math.exp(delta)


def kl2_ratio_bounds(delta: float) -> tuple[float, float]:
    """Ratio interval of k2 = (log w)^2 / 2 <= delta."""
    _check_delta(delta)
    r = math.sqrt(2.0 * delta)
    return math.exp(-r), math.exp(r)


def is_kl3_ratio_bounds(delta: float) -> tuple[float, float]:
    """Ratio interval of w * k3(1/w) = w log w - w + 1 <= delta: w = e^{1 + W(z)}, z = (delta - 1) / e (with
    y = log(w / e), y e^y = z), branch 0 the upper end, -1 the lower; 0 for delta >= 1 (the estimator tends to 1
    as w -> 0)."""
    _check_delta(delta)
    z = (delta - 1.0) / math.e
    upper = math.exp(1.0 + lambert_w(z, 0))
    lower = math.exp(1.0 + lambert_w(z, -1)) if delta < 1.0 else 0.0
    return lower, upper


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, int | float) and math.isfinite(delta) and delta > 0):
        raise ValueError(f"policy_loss.delta must be a finite number > 0, got {delta!r}")


# --------------------------------------------------------------------------------------
# Per-token quantities (torch). All take detached tensors.
# --------------------------------------------------------------------------------------


def kl3(log_ratio: torch.Tensor) -> torch.Tensor:
    """KL3_t = w - 1 - log w, evaluated as expm1(x) - x to keep precision near w = 1."""
    return torch.expm1(log_ratio) - log_ratio


def bernoulli_kl(old_log_prob: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) || Bern(q w)) = -q log w + (1-q) log((1-q) / (1-q w)), q = pi_old(token), in log space so that
    q -> 0 and q -> 1 stay finite; +inf where q w >= 1 (outside every trust region)."""
    kl, feasible = _bernoulli_kl_where_feasible(old_log_prob, log_ratio)
    return torch.where(feasible, kl, torch.full_like(kl, math.inf))


def bernoulli_kl_within(old_log_prob: torch.Tensor, log_ratio: torch.Tensor, delta: float) -> torch.Tensor:
    """``bernoulli_kl(old_log_prob, log_ratio) <= delta`` (bool) without materialising the +inf of
    infeasible tokens: the same KL values, so the same decisions, for two passes less."""
    kl, feasible = _bernoulli_kl_where_feasible(old_log_prob, log_ratio)
    return (kl <= delta) & feasible


def _bernoulli_kl_where_feasible(
    old_log_prob: torch.Tensor, log_ratio: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Bernoulli KL's value (meaningful where q w < 1) and that feasibility mask."""
    q = torch.exp(old_log_prob)
    one_minus_q = -torch.expm1(old_log_prob)
    new_log_prob = old_log_prob + log_ratio
    feasible = new_log_prob < 0
    one_minus_qw = -torch.expm1(torch.clamp(new_log_prob, max=-1e-30))
    kl = -q * log_ratio + torch.xlogy(one_minus_q, one_minus_q) - torch.xlogy(one_minus_q, one_minus_qw)
    return kl, feasible


def trgppo_ratio_bounds(
    old_log_prob: torch.Tensor, delta: float, iterations: int = 40
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token roots l < 1 < u of KL(Bern(q) || Bern(q w)) = delta (TRGPPO), by bisection on x = log w (convex,
    0 at x = 0): u in (0, -log q) since q w < 1, l in (-60, 0); forty halvings give ~1e-10 relative accuracy."""
    a = old_log_prob.detach().double()
    hi_lo = torch.zeros_like(a)
    hi_hi = -a  # q w = 1 at x = -log q
    lo_lo = torch.full_like(a, -60.0)
    lo_hi = torch.zeros_like(a)
    for _ in range(iterations):
        mid = 0.5 * (hi_lo + hi_hi)
        above = bernoulli_kl(a, mid) > delta
        hi_hi = torch.where(above, mid, hi_hi)
        hi_lo = torch.where(above, hi_lo, mid)
        mid = 0.5 * (lo_lo + lo_hi)
        above = bernoulli_kl(a, mid) > delta
        lo_lo = torch.where(above, mid, lo_lo)
        lo_hi = torch.where(above, lo_hi, mid)
    dtype = old_log_prob.dtype if old_log_prob.is_floating_point() else torch.float32
    return torch.exp(0.5 * (lo_lo + lo_hi)).to(dtype), torch.exp(0.5 * (hi_lo + hi_hi)).to(dtype)


_TRGPPO_TABLES: dict[float, torch.Tensor] = {}
TRGPPO_TABLE_RANGE = (-25.0, 0.0)
TRGPPO_TABLE_POINTS = 32769


def trgppo_bound_table(delta: float) -> torch.Tensor:
    """``(2, TRGPPO_TABLE_POINTS)`` float64 log l and log u of TRGPPO on an even grid of log q, solved once per
    delta and clamped to +-20, where verl clamps log-ratios (below q = e^-25 both bounds lie beyond)."""
    if delta not in _TRGPPO_TABLES:
        grid = torch.linspace(*TRGPPO_TABLE_RANGE, TRGPPO_TABLE_POINTS, dtype=torch.float64)
        grid[-1] = -1e-12  # q = 1 exactly has the degenerate upper root 1
        lower, upper = trgppo_ratio_bounds(grid, delta, iterations=60)
        _TRGPPO_TABLES[delta] = torch.stack([lower.log(), upper.log()]).clamp(-20.0, 20.0)
    return _TRGPPO_TABLES[delta]


def trgppo_ratio_bounds_interpolated(old_log_prob: torch.Tensor, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRGPPO bounds interpolated from :func:`trgppo_bound_table` in log space, for the metrics only. Error in
    log-bound: < 1e-3 within e^{+-15}, < 1e-2 next to the e^{+-20} clamp (tested)."""
    table = trgppo_bound_table(float(delta)).to(old_log_prob.device)
    lo, hi = TRGPPO_TABLE_RANGE
    step = (hi - lo) / (TRGPPO_TABLE_POINTS - 1)
    position = (old_log_prob.double().clamp(lo, hi) - lo) / step
    left = position.floor().clamp(max=TRGPPO_TABLE_POINTS - 2).long()
    frac = position - left
    logs = table[:, left] * (1 - frac) + table[:, left + 1] * frac
    dtype = old_log_prob.dtype if old_log_prob.is_floating_point() else torch.float32
    return logs[0].exp().to(dtype), logs[1].exp().to(dtype)


def dcpo_ratio_bounds(
    old_log_prob: torch.Tensor, eps_low: float, eps_high: float, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DCPO's bounds from q = pi_old(token): [1/2 + 1/2 sqrt(max(0, 1 - 4 eps_low / q)),
    min(1/2 + 1/2 sqrt(1 + 4 eps_high / q), cap)]; rare tokens get wide bounds."""
    inv_q = torch.exp(-old_log_prob)  # +inf for q underflow is fine: clamps below handle it
    lower = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * eps_low * inv_q, min=0.0))
    upper = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high * inv_q), max=cap)
    return lower, upper
