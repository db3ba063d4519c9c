"""Which training steps an analysis measures, and the note that says so.

By default every step but the warm-up step 0. ``--step S`` takes one step, ``--steps A:B`` a
window (steps A to B - 1, either bound may be left out, as in a Python slice) and ``--sample N``
N steps spread evenly over what is left (both ends included), so a long run's analysis costs
what the sample holds: the loader reads only those steps' rows (``dump.load(steps=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass


class StepError(ValueError):
    """Steps asked for that the dump does not hold (or a choice that makes no sense)."""


def ranges(steps: list[int]) -> str:
    """``1-199`` for a contiguous list, ``1,5,9`` otherwise."""
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ",".join(str(s) for s in steps)


def parse_window(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` -> (A, B); ``"A:"`` / ``":B"`` leave a bound open. ``ValueError`` otherwise."""
    lo, sep, hi = str(text).partition(":")
    try:
        if not sep:
            raise ValueError
        a = int(lo) if lo.strip() else None
        b = int(hi) if hi.strip() else None
    except ValueError:
        raise ValueError(f"--steps {text!r}: give a window A:B (steps A to B-1, e.g. 100:200; "
                         f"100: or :200 leave a bound open)") from None
    if (a is not None and a < 0) or (b is not None and b < 0):
        raise ValueError(f"--steps {text!r}: steps count from 0; give bounds >= 0")
    if a is not None and b is not None and b <= a:
        raise ValueError(f"--steps {text!r}: the window is empty; B must be larger than A")
    return a, b


def even_sample(steps: list[int], n: int) -> list[int]:
    """``n`` of ``steps`` spread evenly, the first and the last included (all when n >= len)."""
    if n >= len(steps):
        return list(steps)
    if n == 1:
        return [steps[len(steps) // 2]]
    at = [round(i * (len(steps) - 1) / (n - 1)) for i in range(n)]
    return [steps[i] for i in at]


@dataclass(frozen=True)
class StepChoice:
    """What the user asked for: one ``step``, a ``window`` (A, B) and/or a ``sample`` size."""

    step: int | None = None
    window: tuple | None = None
    sample: int | None = None

    def __post_init__(self):
        if self.sample is not None and self.sample < 1:
            raise ValueError(f"--sample {self.sample}: sample at least 1 step")
        if self.step is not None and (self.window is not None or self.sample is not None):
            raise ValueError("--step takes one step; leave out --steps and --sample with it")

    def choose(self, available: list[int], path: str) -> tuple[list[int], list[str]]:
        """(steps to measure, notes saying which and why) out of the dump's ``available``."""
        if not available:
            raise StepError(f"{path}: no events inside a training step (step >= 0); nothing "
                             "to analyse")
        if self.step is not None:
            if self.step not in available:
                raise StepError(f"{path}: step {self.step} has no events; steps in the dump: "
                                 f"{ranges(available)}")
            return [self.step], [f"step {self.step} only"]
        steps, notes = list(available), []
        if self.window is not None:
            a, b = self.window
            steps = [s for s in steps if (a is None or s >= a) and (b is None or s < b)]
            if not steps:
                raise StepError(f"{path}: no steps in --steps {a if a is not None else ''}:"
                                 f"{b if b is not None else ''}; steps in the dump: "
                                 f"{ranges(available)}")
        if len(steps) > 1 and steps[0] == 0:
            steps, skipped = steps[1:], True
        else:
            skipped = False
        if self.sample is not None and self.sample < len(steps):
            chosen = even_sample(steps, self.sample)
            notes.append(f"steps {ranges(chosen)} measured: a sample of {len(chosen)} of the "
                         f"{len(steps)} steps {ranges(steps)}, spread evenly (--sample)")
            steps = chosen
        else:
            notes.append(f"steps {ranges(steps)} measured")
        if self.window is not None:
            notes[-1] += " (--steps window)"
        notes[-1] += "; step 0 skipped as warm-up" if skipped else (
            " (no warm-up step skipped)" if self.step is None and self.window is None else "")
        return steps, notes
