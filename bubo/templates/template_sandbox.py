"""Limits on what an untrusted chat template may cost: render time, value sizes and output size.

Jinja2's sandbox already keeps a template away from Python internals (no `_`-attributes, no unsafe
callables, no mutation of lists and dicts). It does not bound what a template may compute:
`{{ 'x' * 10**10 }}`, `{{ 'x'.ljust(10**10) }}`, doubling a string with `~` in a loop, `10**10**10`,
nested loops that never end. This module adds those bounds:

- every operation that can make a large value from small ones (`*`, `**`, `+`, `%`, `~`, calls and
  filters given a large count or width, `join`, `replace`, format strings, filters and outputs that
  write a value out as text: `string`, `tojson` with a long indent or separators, `{{ a_list }}`) is
  checked before it runs, from the size its result will have (`text_size`), so no value larger than
  `max_chars` is ever built: no single C call runs long, and the deadline's interrupt lands at once;
- the rendered output stops at `max_chars`;
- the render runs on its own thread with a deadline: the hooks above check it cooperatively, and a
  loop that calls none of them is interrupted with an asynchronous exception at the deadline;
- deep recursion (recursive macros) ends in Python's RecursionError, reported like the rest.

A template that breaks a limit gets `RenderLimitError`.
"""

import ctypes
import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat, Impossible
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

__all__ = ["GuardedEnvironment", "RenderLimitError", "RenderLimits", "render_with_limits", "text_size"]

# A width or precision of seven digits or more in a format string ("%9999999s", "{:>9999999}").
_HUGE_FORMAT_WIDTH = re.compile(r"\d{7,}")
_NESTED_FORMAT_FIELD = re.compile(r"\{[^{}]*\{")
_DIGITS = re.compile(r"\d+")
# Filters whose integer arguments size their result (a width, an indent, a count of items).
_SIZING_FILTERS = frozenset(
    {"center", "indent", "wordwrap", "truncate", "batch", "slice", "format", "tojson"}
)
# The largest integer a template may compute, in bits (10**19728 or so): plenty for arithmetic on
# counts, far from the multi-second multiplications of 10**10**10.
_MAX_INT_BITS = 1 << 16


class RenderLimitError(ValueError):
    """The chat template broke a render limit."""


class _LimitExceeded(BaseException):
    """Raised inside the render; a BaseException so that no `except Exception` in Jinja's runtime
    (or a template's own error handling) can swallow it."""


@dataclass(frozen=True)
class RenderLimits:
    seconds: float = 2.0
    max_chars: int = 16 << 20  # of any one value and of the output; 4M tokens is past any context


@dataclass
class _Budget:
    limits: RenderLimits
    deadline: float

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"the chat template ran longer than {self.limits.seconds:g} s")

    def check_size(self, n: int, what: str) -> None:
        if n > self.limits.max_chars:
            raise _LimitExceeded(
                f"the chat template made {what} of {n} items, over the limit of {self.limits.max_chars}"
            )

    def check_count(self, value: Any, what: str) -> None:
        """An int given as a count, width or repeat: at most max_chars."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.limits.max_chars:
            raise _LimitExceeded(
                f"the chat template passed {value} to {what}, over the limit of {self.limits.max_chars}"
            )

    def check_text(self, value: Any, what: str, **layout: int) -> None:
        """`value` written out as text (text_size) is at most max_chars."""
        self.check_size(text_size(value, self.limits.max_chars, **layout), what)

    def check_format(self, fmt: Any, what: str) -> None:
        if isinstance(fmt, str) and _HUGE_FORMAT_WIDTH.search(fmt):
            raise _LimitExceeded(f"the chat template used a format width of a million or more in {what}")


_current = threading.local()


def _budget() -> _Budget:
    budget: _Budget | None = getattr(_current, "budget", None)
    if budget is None:
        # Outside a render, Jinja is folding constants at compile time: leave it to the render.
        raise Impossible()
    return budget


def _sized(value: Any) -> bool:
    return isinstance(value, str | list | tuple)


def _product_bits(left: Any, right: Any) -> int:
    return abs(left).bit_length() + abs(right).bit_length()


# Characters that str() inside a container, repr and JSON write as escapes of up to six characters.
_ESCAPED = re.compile(r"[\x00-\x1f\x7f-\x9f\\'\"]")
_CONTAINERS = (dict, list, tuple, set, frozenset, type({}.keys()), type({}.values()))


def text_size(value: Any, limit: int, *, indent: int = 0, separator: int = 2) -> int:
    """An upper bound on the length of `value` written out as text (str, repr, JSON, a format's
    field), found without writing it: a walk that stops once past `limit`. Each item of a container
    adds `separator` characters and, for indented JSON, a newline and `indent` per level of depth."""
    total = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending and total <= limit:
        item, depth = pending.pop()
        if isinstance(item, str):
            total += len(item) + 2 + 5 * len(_ESCAPED.findall(item)) if depth else len(item)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() * 3 // 10 + 2
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, _CONTAINERS):
            pairs = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            total += 2
            for key, member in pairs:
                total += separator + 2 + (1 + indent * (depth + 1) if indent else 0)
                if key is not None:
                    pending.append((key, depth + 1))
                pending.append((member, depth + 1))
                if total > limit:
                    break
        elif isinstance(item, Namespace):
            pending.append((item._Namespace__attrs, depth))  # what its repr writes out
        else:
            total += 64  # a macro, a loop, an undefined value: a short repr
    return total


class _GuardedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to a checked join (plain Jinja joins unchecked)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.guarded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _guard_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    # Filters marked pass_context / pass_eval_context / pass_environment get that object first.
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.check_time()
        operands = args[skip:]
        if name in _SIZING_FILTERS:
            # The arguments after the filtered value: widths, lengths, counts, indents.
            for value in (*operands[1:], *kwargs.values()):
                budget.check_count(value, f"the {name} filter")
        if name == "join" and operands:
            if not isinstance(operands[0], list | tuple | str):
                # A generator (map, select): its items are counted before they are joined.
                args = (*args[:skip], list(operands[0]), *operands[1:])
                operands = args[skip:]
            _check_join(budget, operands[0], operands[1] if len(operands) > 1 else kwargs.get("d", ""))
        elif name == "replace" and len(operands) >= 3:
            _check_replace(budget, operands[0], operands[1], operands[2])
        elif name == "format" and operands:
            budget.check_format(operands[0], "the format filter")
            _check_percent(budget, operands[0], kwargs or tuple(operands[1:]), "the format filter")
        elif operands:
            _check_growth(budget, name, operands[0], operands[1:], kwargs)
        result = fn(*args, **kwargs)
        if _sized(result):
            budget.check_size(len(result), f"a value (the {name} filter)")
        return result

    return guarded


def _check_growth(
    budget: _Budget, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Before a filter that writes its value out as text, the size that text will have."""
    what = f"a value (the {name} filter)"
    limit = budget.limits.max_chars
    if name in ("string", "pprint"):
        budget.check_text(value, what, indent=1 if name == "pprint" else 0)
    elif name in ("e", "escape", "forceescape", "xmlattr", "urlencode"):
        # An escape is at most 5 characters for one (&amp;), 12 for a percent-encoded one.
        budget.check_size(text_size(value, limit) * (12 if name == "urlencode" else 5), what)
    elif name == "indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        budget.check_size(len(value) + (value.count("\n") + 1) * max(width, 0), what)
    elif name == "tojson":
        ensure_ascii = kwargs.get("ensure_ascii", args[0] if args else False)
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
        separators = kwargs.get("separators", args[2] if len(args) > 2 else None)
        size = text_size(
            value,
            limit,
            indent=len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0,
            separator=2 if separators is None else text_size(separators, limit),
        )
        # ensure_ascii writes a character past ASCII as a six-character escape.
        budget.check_size(size * (6 if ensure_ascii else 1), what)


def _check_join(budget: _Budget, items: Any, separator: Any) -> None:
    if isinstance(items, list | tuple):
        sep = len(separator) if isinstance(separator, str) else 0
        total = sep * max(len(items) - 1, 0)
        for item in items:
            total += len(item) if isinstance(item, str) else text_size(item, budget.limits.max_chars)
            budget.check_size(total, "a joined string")


def _check_percent(budget: _Budget, fmt: Any, args: Any, what: str) -> None:
    """`fmt % args`: its text, the widths it names, and each argument written out (one a format can
    name more than once, a mapping's value or a lone argument, once per field)."""
    if not isinstance(fmt, str):
        return
    limit = budget.limits.max_chars
    fields = fmt.count("%")
    size = len(fmt) + sum(int(digits) for digits in _DIGITS.findall(fmt))
    if isinstance(args, tuple):
        for arg in args:
            size += text_size(arg, limit)
            budget.check_size(size, what)
    elif isinstance(args, dict):
        size += fields * max((text_size(v, limit) for v in args.values()), default=0)
    else:
        size += fields * text_size(args, limit)
    budget.check_size(size, what)


def _check_str_format(
    budget: _Budget, fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any], what: str
) -> None:
    """`fmt.format(...)`: any field may name any argument, so each field counts as the largest."""
    limit = budget.limits.max_chars
    largest = max((text_size(v, limit) for v in (*args, *kwargs.values())), default=0)
    size = len(fmt) + sum(int(digits) for digits in _DIGITS.findall(fmt)) + fmt.count("{") * largest
    budget.check_size(size, what)


def _check_replace(budget: _Budget, text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        hits = text.count(old) if old else len(text) + 1
        budget.check_size(len(text) + hits * max(len(new) - len(old), 0), "a replaced string")


def _checked_output(value: Any) -> Any:
    """Each `{{ value }}` before it is written out as text (a list's text can be far larger than it)."""
    if not isinstance(value, str):
        budget = _budget()
        budget.check_text(value, "an output value")
    return value


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the size and time checks of this module."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("finalize", _checked_output)
        super().__init__(*args, **kwargs)
        self.filters = {name: _guard_filter(name, fn) for name, fn in self.filters.items()}

    def add_filter(self, name: str, fn: Callable[..., Any]) -> None:
        self.filters[name] = _guard_filter(name, fn)

    def guarded_concat(self, parts: tuple[Any, ...]) -> str:
        budget = _budget()
        budget.check_time()
        budget.check_size(sum(text_size(part, budget.limits.max_chars) for part in parts), "a string (~)")
        return "".join(str(part) for part in parts)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.check_time()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            if ints and _product_bits(left, right) > _MAX_INT_BITS:
                raise _LimitExceeded("the chat template multiplied integers too large to compute")
            for seq, count in ((left, right), (right, left)):
                if _sized(seq) and isinstance(count, int):
                    budget.check_size(len(seq) * max(count, 0), "a repeated value (*)")
        elif operator == "**":
            if ints and right > 0 and abs(left) > 1 and abs(left).bit_length() * right > _MAX_INT_BITS:
                raise _LimitExceeded("the chat template raised an integer to a power too large to compute")
        elif operator == "+":
            if _sized(left) and _sized(right):
                budget.check_size(len(left) + len(right), "a value (+)")
        elif operator == "%" and isinstance(left, str):
            budget.check_format(left, "a % format")
            if "*" in left:  # "%*d" takes its width from the arguments
                for value in right if isinstance(right, tuple) else (right,):
                    budget.check_count(value, "a % format")
            _check_percent(budget, left, right, "a string (% format)")
        return super().call_binop(context, operator, left, right)

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.check_time()
        name = getattr(obj, "__name__", "")
        # str.format comes wrapped by the sandbox; the string it formats is the wrapped method's owner.
        owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        formats = name in ("format", "format_map")
        # A string's or list's methods take counts and widths (ljust, center, zfill, expandtabs); a format
        # string takes them from its arguments only through a nested field ("{:{}}").
        if _sized(owner) and (not formats or _NESTED_FORMAT_FIELD.search(owner)):
            for value in (*args, *kwargs.values()):
                budget.check_count(value, f"{name}()")
        if isinstance(owner, str):
            if formats:
                budget.check_format(owner, f"str.{name}")
                mapping = args[0] if name == "format_map" and args and isinstance(args[0], dict) else {}
                positional = args if name == "format" else ()
                _check_str_format(budget, owner, positional, {**kwargs, **mapping}, f"str.{name}")
            elif name == "join" and args:
                _check_join(budget, list(args[0]) if isinstance(args[0], tuple) else args[0], owner)
            elif name == "replace" and len(args) >= 2:
                _check_replace(budget, owner, args[0], args[1])
        result = super().call(context, obj, *args, **kwargs)
        if _sized(result):
            budget.check_size(len(result), f"a value ({name or 'a call'})")
        return result


def _interrupt(thread: threading.Thread) -> None:
    """Raise _LimitExceeded in `thread` at its next bytecode (a loop that calls none of the hooks)."""
    assert thread.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_LimitExceeded))


def render_with_limits(chunks: Callable[[], Iterator[str]], limits: RenderLimits) -> str:
    """Join the chunks a template's `generate` yields, on a thread of its own, within `limits`.

    Raises RenderLimitError for a broken limit or a sandbox violation; any other error of the
    template propagates as raised.
    """
    outcome: list[Any] = []

    def work() -> None:
        budget = _Budget(limits, time.monotonic() + limits.seconds)
        _current.budget = budget
        try:
            parts: list[str] = []
            total = 0
            for chunk in chunks():
                total += len(chunk)
                budget.check_size(total, "an output")
                parts.append(chunk)
            outcome.append("".join(parts))
        except _LimitExceeded as error:
            # Without arguments it is the deadline's interrupt.
            message = (
                error.args[0] if error.args else f"the chat template ran longer than {limits.seconds:g} s"
            )
            outcome.append(RenderLimitError(message))
        except RecursionError:
            outcome.append(RenderLimitError("the chat template recursed too deeply"))
        except MemoryError:
            outcome.append(RenderLimitError("the chat template ran out of memory"))
        except BaseException as error:  # handed to the caller's thread, which raises it
            outcome.append(error)
        finally:
            _current.budget = None

    thread = threading.Thread(target=work, name="bubo-template", daemon=True)
    thread.start()
    thread.join(limits.seconds)
    if thread.is_alive():
        _interrupt(thread)
        thread.join(limits.seconds)
    if not outcome:
        # Stuck inside one C call past the deadline (the checks above make that short); it is left
        # to finish on its daemon thread.
        raise RenderLimitError(f"the chat template ran longer than {limits.seconds:g} s")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result
