"""The tests' one tolerance rule, and the comparison that applies it.

Two kinds of numerical test:

- **Exactness** (distributed vs one process, tiled vs untiled, offloaded vs not, head chunks, layouts): both
  sides run in float64 (:data:`EXACT_DTYPE`; the CPU flash kernel and its backward take it) and must agree to
  :data:`EXACT_TOL` = 1e-9, on any CPU and thread count. float64 rounding, summed over a whole training step of
  the tiny models, stays near 1e-14 (measured: 1e-15 to 1e-14); a bug shows at 1e-3 or more; and a single fp32
  rounding anywhere on the path (6e-8) fails it too, so a silent downcast cannot hide.
- **Rounding** (a kernel or a run in fp32/bf16 against float64, or two orders of one fp32 sum): the tolerance
  is :func:`rounding_tolerance`, ``C * (eps(dtype) + eps(fp32) * sqrt(n))`` with ``n`` the length of the
  longest reduction behind a compared value (the keys of a softmax, the tokens summed into a weight gradient)
  and ``C = 4``. Why: a value in ``dtype`` is rounded to it at least once (``eps(dtype)``, relative); the
  reductions accumulate in fp32 (fp32 kernels, and bf16 kernels too), and the rounding errors of ``n``
  additions have random signs, so the difference between two summation orders (vector width, threads, the
  sharded layout: what changes between CPUs) grows like ``sqrt(n) * eps``, not like the worst case ``n * eps``.
  ``C = 4`` is the margin over the measured worst case (fp32 attention over 32 keys: 3.6e-7 against the
  rule's 3.2e-6; bf16: 7.2e-3 against 3.1e-2).

``eps`` is the machine epsilon (``torch.finfo(dtype).eps``: fp32 1.2e-7, bf16 7.8e-3). No test uses a tolerance
looser than its rule. :func:`assert_close_scaled` compares every element with
``|a - b| <= tol * (|b| + max|b|)``: relative to the element and to the largest finite magnitude of the
reference, because an fp32 gradient entry of 150 can move by 5e-5 with the summation order while an entry of
1e-3 that is wrong by 1e-5 must fail. Infinite entries (an lse of ``-inf`` for a row with no key) must match
exactly, NaN never passes. Its failure message is ``assert_close``'s own report, after the caller's context.
"""

from __future__ import annotations

import math

import torch

EXACT_DTYPE = torch.float64
EXACT_TOL = 1e-9
"""rtol (and atol / max|expected|) of every float64 exactness comparison (module docstring)."""

MARGIN = 4.0
"""``C`` of :func:`rounding_tolerance`."""


def rounding_tolerance(dtype: torch.dtype, n: int) -> float:
    """The rule for ``dtype`` values behind a reduction of ``n`` terms: ``C * (eps(dtype) + eps(fp32) * sqrt(n))``.

    float64 gets :data:`EXACT_TOL` (its rule's value, ~1e-14, leaves no room for the float64 roundings of a
    whole model; 1e-9 still fails any fp32 rounding)."""
    if dtype == torch.float64:
        return EXACT_TOL
    assert dtype in (torch.float32, torch.bfloat16, torch.float16), f"no rounding rule for {dtype}"
    assert n >= 1, f"reduction length {n}"
    return MARGIN * (torch.finfo(dtype).eps + torch.finfo(torch.float32).eps * math.sqrt(n))


def reference_scale(expected: torch.Tensor) -> float:
    """The largest finite magnitude in ``expected`` (0 for an empty or all-infinite tensor)."""
    finite = expected.detach()[torch.isfinite(expected)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, msg: str | None = None
) -> None:
    """``torch.testing.assert_close`` with ``rtol = tol`` and ``atol = tol * max|expected|`` (finite entries).

    Dtypes must match (cast the reference first when comparing against float64). ``msg``: context put before
    ``assert_close``'s own report (which names the mismatching elements and the largest differences).
    """
    atol = tol * reference_scale(expected)
    prefix = "" if msg is None else f"{msg}: "
    torch.testing.assert_close(actual, expected, rtol=tol, atol=atol, msg=lambda report: f"{prefix}{report}")


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """:func:`assert_close_scaled` at :data:`EXACT_TOL`, both sides float64."""
    assert actual.dtype == expected.dtype == EXACT_DTYPE, (
        f"{msg or ''} exactness runs in float64: {actual.dtype}"
    )
    assert_close_scaled(actual, expected, EXACT_TOL, msg)
