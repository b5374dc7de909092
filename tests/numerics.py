"""Exactness checks for tests: tolerances that hold on any CPU, comparisons that fail on NaN and inf.

One rule (docs/design.md, "How a tolerance is chosen"): two computations of the same math in another fp
summation order agree element by element within ``tolerance(dtype) * max |reference|``. The scale is the
reference's largest magnitude (so the check means the same for logits of 0.3 and gradients of 1e-3), and
the factor is the dtype's rounding unit times the headroom that reordered sums of a few thousand terms
need on every kernel path (AVX-512, AVX2, torch's portable ``default`` kernels, MKL held to AVX2):

* fp32: 1e-5 (84 units of 2**-23): the worst case measured over the exactness tests on those paths was
  6.0e-7 (docs/benchmarks.md, "Kernel paths": 17 times inside), so a real error — a NaN, a gradient on the wrong
  expert row, a replica gradient dropped — is far outside it and a different CPU is not.
* fp64 1e-12, fp16 2e-3, bf16 1.6e-2: the same units (about 84, 2, 2 ulp of the largest value).

Over several optimizer steps a gradient is judged against the largest magnitude it had so far
(:class:`TrainingScale`): the rounding two independent trainings carry comes from updates of that size.

``rel_error`` is the figure (what a rank returns to the test process), ``assert_exact`` the assertion (what a
test in one process calls), ``assert_within`` the assertion on figures; all three use the same tolerance and
fail on a non-finite value: ``rel_error`` is ``inf`` when either side holds a NaN or an inf, and no check
takes a running ``max`` that starts at 0.0 (Python's ``max(0.0, nan)`` is 0.0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from ultraep.cli.demo_check import REL_TOL, rel_difference

#: fp32 is the demo verdict's tolerance (one number: the demo and the tests judge exactness alike)
TOLERANCE = {torch.float64: 1e-12, torch.float32: REL_TOL, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tolerance(dtype: torch.dtype = torch.float32) -> float:
    """The relative tolerance of ``dtype`` (a fraction of the reference's largest magnitude)."""
    if dtype not in TOLERANCE:
        raise ValueError(f"no exactness tolerance for dtype {dtype}; known: {', '.join(map(str, TOLERANCE))}")
    return TOLERANCE[dtype]


def rel_error(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    """``max |actual - expected| / max |expected|`` over all elements, in float64.

    ``scale``: a larger magnitude to judge against when the reference's own is not the one its rounding came
    from — a gradient after optimizer steps, whose rounding was carried in by updates of the size that gradient
    had earlier (:class:`TrainingScale`). ``inf`` when the shapes differ or either side holds a NaN or an inf;
    0.0 when both are all zero (an expert that got no token), ``inf`` when only ``expected`` is."""
    err = rel_difference(actual.detach().double().cpu().numpy(), expected.detach().double().cpu().numpy())
    if scale is None or not math.isfinite(err) or err == 0.0:
        return err
    own = float(expected.detach().double().abs().max()) if expected.numel() else 0.0
    if own == 0.0:  # an all-zero reference (no token) and a non-zero actual: wrong at any scale
        return err
    return err * own / max(own, scale)


class TrainingScale:
    """The scale of each named gradient over a training run: the largest magnitude the reference's gradient
    had at any step so far (docs/design.md, "How a tolerance is chosen").

    Two models trained on their own differ after the first optimizer step by rounding of the updates, which
    were the size of the gradients so far; a gradient that later shrinks by cancellation (a norm's weight near
    its optimum: 6e-4 at step 0, 2e-5 at step 3) then shows that rounding at up to 8.4e-6 of its *current* magnitude
    even between two unwrapped references that differ only in summation order. Judged against its running
    largest magnitude, the rounding is 3-7e-7 again, and a real error — 1e-3 to 1 of the current magnitude —
    stays far outside the tolerance. At the first step the scale is the reference's own magnitude."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def update(self, name: str, expected: torch.Tensor) -> float:
        """Record ``expected`` (the reference's gradient of ``name`` at this step); return its scale."""
        own = float(expected.detach().double().abs().max()) if expected.numel() else 0.0
        self._seen[name] = max(self._seen.get(name, 0.0), own) if math.isfinite(own) else own
        return self._seen[name]


def worst(errors: Iterable[float]) -> float:
    """The largest of ``errors``, NaN if any is NaN (never ``max(0.0, nan) == 0.0``).

    Raises ``ValueError`` for none: a caller that compared nothing must not read 0.0 as a pass."""
    out = None
    for e in errors:
        if math.isnan(e):
            return math.nan
        out = e if out is None else max(out, e)
    if out is None:
        raise ValueError("worst() of no errors: nothing was compared")
    return out


def assert_within(errors: float | Mapping[str, float] | Iterable[float], dtype: torch.dtype = torch.float32,
                  what: str = "") -> None:
    """Every figure of :func:`rel_error` is within ``tolerance(dtype)``; a NaN or inf fails, and so does an empty
    collection (nothing compared is not a pass)."""
    tol = tolerance(dtype)
    items = list(errors.items() if isinstance(errors, Mapping) else enumerate(
        [errors] if isinstance(errors, (int, float)) else list(errors)))
    assert items, f"{what + ': ' if what else ''}nothing was compared"
    bad = {k: v for k, v in items if not v <= tol}  # `not <=`: NaN fails
    assert not bad, f"{what + ': ' if what else ''}relative error above {tol:g} ({dtype}): {bad}"


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, what: str = "", dtype: torch.dtype | None = None) -> None:
    """``actual`` equals ``expected`` up to summation order: :func:`torch.testing.assert_close` with
    ``atol = tolerance(dtype) * max |expected|`` and ``rtol = 0``; fails on NaN and inf on either side."""
    dtype = dtype or expected.dtype
    a, b = actual.detach(), expected.detach()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    for side, t in (("actual", a), ("expected", b)):
        assert bool(torch.isfinite(t).all()), f"{what}: {side} holds NaN or inf"
    scale = float(b.double().abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a.double(), b.double(), rtol=0.0, atol=tolerance(dtype) * scale, equal_nan=False,
                               msg=lambda m: f"{what}: {m}" if what else m)


def master_grad_errors(rt, ref, rank: int) -> dict[str, float]:
    """Per balanced layer and parameter, :func:`rel_error` of this rank's master gradients (rows
    ``rank * M .. (rank + 1) * M``) against the unwrapped reference ``ref``'s gradient summed over ranks — what a
    balanced layer must reproduce. A missing gradient is a zero one (never a skipped check). Collective."""
    import torch.distributed as dist

    out = {}
    for layer in rt.layers:
        M = layer.topology.num_masters
        for n in layer.adapter.param_names:
            full = getattr(ref.get_submodule(layer.name), n)
            g = full.grad.clone() if full.grad is not None else torch.zeros_like(full)
            dist.all_reduce(g)
            mine = getattr(layer, n).grad
            want = g[rank * M:(rank + 1) * M]
            out[f"{layer.name}.{n}"] = rel_error(mine if mine is not None else torch.zeros_like(want), want)
    return out


def param_grad_errors(model, ref, skip=lambda name: False) -> dict[str, float]:
    """Per parameter of ``model`` not skipped, :func:`rel_error` of its gradient against ``ref``'s parameter of the
    same name (a missing gradient is a zero one)."""
    ref_params = dict(ref.named_parameters())
    out = {}
    for n, p in model.named_parameters():
        if skip(n):
            continue
        zero = torch.zeros_like(p)
        out[n] = rel_error(p.grad if p.grad is not None else zero,
                           ref_params[n].grad if ref_params[n].grad is not None else zero)
    return out
