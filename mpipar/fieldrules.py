"""Declarations of what a config field may hold, and the one generic check that applies them.

Each config field declares its rule once (``mpipar.config_checks.RULES``): a type and a range,
or a set of choices. ``check(where, value)`` refuses anything else with one line naming the key,
the value and what is valid. A leaf module (standard library only), like ``mpipar.config``.

The rules are data, so tests can read them: ``bad_values()`` lists values each rule must refuse
(zero, negative, NaN, inf, wrong type, fractional for an integer: only those outside the rule).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


class RuleError(ValueError):
    """A value outside its field's declared rule (``mpipar.config_checks`` turns it into
    ConfigError)."""


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _fmt(x) -> str:
    return "inf" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


# candidates every numeric rule is tried against (each rule keeps only those it must refuse)
_NUMERIC_PROBES = (0, -1, -0.5, 0.5, 1.5, float("nan"), float("inf"), float("-inf"), "abc",
                   True, [1])


@dataclass(frozen=True)
class Num:
    """An integer (``integer=True``) or a finite real number in ``[lo, hi]`` (``lo_open``: ``lo``
    itself excluded; ``hi=None``: no upper bound). ``off``: one more value allowed outside the
    range, meaning "disabled" (e.g. 0 for an interval)."""

    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    off: float | None = None

    def describe(self) -> str:
        what = "an integer" if self.integer else "a finite number"
        text = f"{what} in {self.interval()}"
        if self.off is not None:
            text += f", or {_fmt(self.off)} to disable"
        return text

    def interval(self) -> str:
        lo = "(-inf" if self.lo is None else ("(" if self.lo_open else "[") + _fmt(self.lo)
        hi = "inf)" if self.hi is None else _fmt(self.hi) + (")" if self.hi_open else "]")
        return f"{lo}, {hi}"

    def ok(self, v) -> bool:
        if not (_is_int(v) if self.integer else _is_real(v)):
            return False
        if self.off is not None and v == self.off:
            return True
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return not (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))

    def bad_values(self) -> list:
        probes = list(_NUMERIC_PROBES)
        if self.lo is not None:
            probes += [self.lo - 1, self.lo - 0.5] if self.integer else [self.lo - 1e-9]
        if self.hi is not None:
            probes += [self.hi + 1] if self.integer else [self.hi + 1e-9]
        return [v for v in probes if not self.ok(v)]

    def good_values(self) -> list:
        lo = self.lo if self.lo is not None else -1
        first = lo + (1 if self.lo_open and self.integer else 1e-6 if self.lo_open else 0)
        vals = [first] + ([] if self.off is None else [self.off])
        if self.hi is not None and not self.hi_open:
            vals.append(self.hi)
        return [int(v) if self.integer else float(v) for v in vals]


def Int(lo=None, hi=None, off=None) -> Num:  # noqa: N802 (reads as a type in the tables)
    return Num(True, lo, hi, off=off)


def Real(lo=None, hi=None, lo_open=False, hi_open=False, off=None) -> Num:  # noqa: N802
    return Num(False, lo, hi, lo_open, hi_open, off)


@dataclass(frozen=True)
class Choice:
    """One of the listed strings."""

    options: tuple

    def describe(self) -> str:
        return "one of " + ", ".join(repr(o) for o in self.options)

    def ok(self, v) -> bool:
        return isinstance(v, str) and v in self.options

    def bad_values(self) -> list:
        return ["", "no-such-" + self.options[0], 0, True, float("nan")]

    def good_values(self) -> list:
        return list(self.options)


@dataclass(frozen=True)
class Flag:
    """true or false."""

    def describe(self) -> str:
        return "true or false"

    def ok(self, v) -> bool:
        return isinstance(v, bool)

    def bad_values(self) -> list:
        return ["maybe", 2, -1, 0.5, float("nan")]

    def good_values(self) -> list:
        return [True, False]


@dataclass(frozen=True)
class Recompute:
    """parallel.recompute: false (none), true (full) or "selective" (the attention core)."""

    def describe(self) -> str:
        return "none / false, full / true, or selective"

    def ok(self, v) -> bool:
        return isinstance(v, bool) or v == "selective"

    def bad_values(self) -> list:
        return ["maybe", "partial", 2, -1, 0.5, float("nan")]

    def good_values(self) -> list:
        return [True, False, "selective"]


@dataclass(frozen=True)
class Text:
    """A string (``nonempty``: not empty); paths and names."""

    nonempty: bool = False

    def describe(self) -> str:
        return "a non-empty string" if self.nonempty else "a string"

    def ok(self, v) -> bool:
        return isinstance(v, str) and (bool(v.strip()) or not self.nonempty)

    def bad_values(self) -> list:
        return [1, 1.5, True, [1]] + (["", "  "] if self.nonempty else [])

    def good_values(self) -> list:
        return ["x"]


@dataclass(frozen=True)
class IntList:
    """A list of integers, each in ``[lo, hi]``, with at least ``min_len`` entries."""

    lo: int | None = None
    hi: int | None = None
    min_len: int = 0

    def describe(self) -> str:
        each = Int(self.lo, self.hi).interval()
        size = f"at least {self.min_len} " if self.min_len else ""
        return f"a list of {size}integers, each in {each}"

    def ok(self, v) -> bool:
        item = Int(self.lo, self.hi)
        return (isinstance(v, list) and len(v) >= self.min_len
                and all(item.ok(x) for x in v))

    def bad_values(self) -> list:
        n = max(self.min_len, 1)
        fill = self.lo if self.lo is not None else 1
        bad = ["abc", 3, [fill] * (n - 1) + [1.5], [fill] * (n - 1) + [float("nan")],
               [fill] * (n - 1) + [True], [fill] * (n - 1) + ["x"]]
        if self.lo is not None:
            bad.append([fill] * (n - 1) + [self.lo - 1])
        if self.min_len:
            bad.append([fill] * (self.min_len - 1))
        return bad

    def good_values(self) -> list:
        return [[self.lo if self.lo is not None else 1] * max(self.min_len, 1)]


def check(where: str, value, rule) -> None:
    """Raise ``RuleError``: ``train.lr = -0.001: must be a finite number in (0, inf)``."""
    if not rule.ok(value):
        raise RuleError(f"{where} = {value!r}: must be {rule.describe()}")
