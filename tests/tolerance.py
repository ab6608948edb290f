"""Tolerances scaled to the size of what is compared.

An fp32 sum over thousands of terms changes in its last bits with the summation order (thread count, blocking,
the sharded layout): a gradient entry of 150 can differ by 5e-5 between two exact computations, a relative error
of 3e-7. A bare ``atol=1e-5`` fails on such an entry while passing on an entry of 1e-3 that is wrong by 1e-5.
``assert_close_scaled`` therefore compares every element with ``|a - b| <= tol * (|b| + max|b|)``: relative to
the element and to the largest finite magnitude of the reference tensor. Infinite entries (an lse of ``-inf``
for a row with no key) must match exactly, NaN never passes.
"""

from __future__ import annotations

import torch


def reference_scale(expected: torch.Tensor) -> float:
    """The largest finite magnitude in ``expected`` (0 for an empty or all-infinite tensor)."""
    finite = expected[torch.isfinite(expected)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float, msg: str | None = None) -> None:
    """``torch.testing.assert_close`` with ``rtol = tol`` and ``atol = tol * max|expected|`` (finite entries).

    Dtypes must match (cast the reference first when comparing against float64).
    """
    atol = tol * reference_scale(expected)
    if msg is None:
        torch.testing.assert_close(actual, expected, rtol=tol, atol=atol)
    else:
        torch.testing.assert_close(actual, expected, rtol=tol, atol=atol, msg=lambda m: f"{msg}: {m}")
