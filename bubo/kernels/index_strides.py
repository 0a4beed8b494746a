"""A fast exact answer to the question inductor's C++ backend asks most while it generates a kernel: by
how much does this load's or store's index move when the vectorized loop variable moves by one?

Inductor answers it with `stride_at_vec_range` (torch/_inductor/sizevars.py): it replaces the
floor-divisions and remainders of the variable that are constant across a vector with free symbols,
then takes `sympy.simplify(index(var + 1) - index(var))`, simplifying the index first as well. Bubo's
matvecs expand 32 to 128 codes in one loop body, each a load with its own index, and a layer's graph
holds dozens of such loops: a cold compile of a small hybrid model spent ~44% of its time in
`sympy.simplify` and ~69% in sympy (py-spy; benchmarks/RESULTS.md, 2026-12-07).

The indices inductor builds are sums of terms, each a number times a variable, a symbol, or one
floor-division or remainder of a variable. For those the answer is read off the terms: `c * var`
moves by c, a term without the variable by 0, `FloorDiv(var, d)` and `ModularIndexing(var, d, m)` by 0
where d is a multiple of the vector length (constant across a vector, which is what inductor's own
substitution says), and `ModularIndexing(var, 1, m)` by 1 where m is. Anything else (a product of
variables, a division of a sum, a divisor the vector doesn't divide, no vector length) goes to
inductor's own analysis. The answers are the same numbers, so the generated code is the same
(tests/kernels/test_index_strides.py compiles kernels both ways and compares their source).
"""

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

__all__ = ["fast_index_strides"]


def _term_stride(term: sympy.Expr, var: sympy.Symbol, vec_length: int) -> sympy.Expr | None:
    """How much `term` (one term of a sum) moves as `var` moves by one within a vector, or None where
    the term isn't of the forms the module docstring lists."""
    if not term.has(var):
        return sympy.S.Zero
    coefficient, factor = term.as_coeff_Mul()
    if factor == var:
        return coefficient
    if isinstance(factor, FloorDiv | ModularIndexing) and factor.args[0] == var:
        divisor = factor.args[1]
        if divisor.is_Integer and divisor % vec_length == 0:
            return sympy.S.Zero
        if isinstance(factor, ModularIndexing) and divisor == 1:
            modulus = factor.args[2]
            if modulus.is_Integer and modulus % vec_length == 0:
                return coefficient
    return None


@functools.cache
def _linear_stride(index: sympy.Expr, var: sympy.Symbol, vec_length: int) -> sympy.Expr | None:
    """`index`'s stride in `var` read off its terms, or None (see the module docstring)."""
    total = sympy.S.Zero
    for term in sympy.Add.make_args(index):
        stride = _term_stride(term, var, vec_length)
        if stride is None:
            return None
        total += stride
    return total


def _with_fast_path(original: Callable[..., Any]) -> Callable[..., Any]:
    def stride_at_vec_range(index: sympy.Expr, var: sympy.Symbol, vec_length: int | None = None) -> Any:
        if vec_length and isinstance(index, sympy.Expr):
            stride = _linear_stride(index, var, vec_length)
            if stride is not None:
                return stride
        return original(index, var, vec_length)

    return stride_at_vec_range


_lock = threading.Lock()
_users = 0
_original: Callable[..., Any] | None = None


@contextmanager
def fast_index_strides() -> Iterator[None]:
    """Inductor's C++ code generation, while inside, asks `stride_at_vec_range` here first. Compiles on
    several threads at once share one installation, removed when the last one leaves. Where this
    torch's inductor has no such function, nothing changes."""
    global _users, _original
    from torch._inductor.codegen import cpp

    with _lock:
        if _users == 0:
            _original = getattr(cpp, "stride_at_vec_range", None)
            if _original is not None:
                cpp.stride_at_vec_range = _with_fast_path(_original)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _original is not None:
                cpp.stride_at_vec_range = _original
