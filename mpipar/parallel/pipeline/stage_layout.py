"""Uneven pipeline stages from a layout string, in Megatron-LM's form (no MPI here).

``E`` is the embedding unit, ``t`` one transformer block, ``L`` the loss side (final LayerNorm and
LM head), ``|`` the cut between two stages (model chunks, in model order), ``X*N`` repeats ``X``
(a symbol or a parenthesised group) N times; commas and spaces are cosmetic. For example, with 6
blocks over 4 chunks and a heavy last stage::

    Et|t|t|ttttL          the same as   E,t|(t|)*2,t*4L

The string must name every unit once, in order: ``E`` first, ``n_layer`` ``t``'s, ``L`` last, and
exactly ``pp * virtual_stages - 1`` cuts, none of them leaving a stage empty.
"""

from __future__ import annotations

SYMBOLS = "EtL"


class LayoutError(ValueError):
    """A layout string that cannot be used; the message says what is wrong and where."""


class _Parser:
    def __init__(self, text: str):
        self.text, self.i = text, 0

    def error(self, what: str) -> LayoutError:
        return LayoutError(f"layout {self.text!r}, column {self.i + 1}: {what}")

    def peek(self) -> str:
        while self.i < len(self.text) and self.text[self.i] in " ,":
            self.i += 1
        return self.text[self.i] if self.i < len(self.text) else ""

    def sequence(self, closing: str = "") -> str:
        out = []
        while True:
            ch = self.peek()
            if ch == closing:
                return "".join(out)
            if ch == "":
                raise self.error(f"missing {closing!r}")
            out.append(self.item())

    def item(self) -> str:
        ch = self.peek()
        if ch == "(":
            self.i += 1
            body = self.sequence(")")
            self.i += 1
        elif ch in SYMBOLS or ch == "|":
            body = ch
            self.i += 1
        elif ch == ")":
            raise self.error("')' without a matching '('")
        else:
            raise self.error(f"unknown symbol {ch!r}; use E (embedding), t (block), L (loss and "
                             "head), | (stage cut), *N (repeat), parentheses, commas")
        if self.peek() == "*":
            self.i += 1
            start = self.i
            while self.i < len(self.text) and self.text[self.i].isdigit():
                self.i += 1
            if start == self.i:
                raise self.error("'*' needs a repeat count, e.g. t*4")
            body *= int(self.text[start:self.i])
        return body


def expand(text: str) -> str:
    """The layout with repetitions and cosmetics expanded: only E, t, L and |."""
    if not text.strip():
        raise LayoutError("empty layout string: write e.g. 'Et*3|t*3L'")
    return _Parser(text).sequence()


def layout_bounds(text: str, n_layer: int, n_chunks: int) -> dict[int, tuple[int, int]]:
    """{chunk: (first unit, end unit)} of a GPT with ``n_layer`` blocks (units: embedding,
    blocks, head) cut as ``text`` says into ``n_chunks`` chunks."""
    flat = expand(text)
    stages = flat.split("|")
    where = f"layout {text!r}"
    if len(stages) != n_chunks:
        raise LayoutError(f"{where} has {len(stages)} stages but the run has pp * virtual_stages "
                          f"= {n_chunks} model chunks: use {n_chunks - 1} '|' cuts")
    for k, st in enumerate(stages):
        if not st:
            raise LayoutError(f"{where}: stage {k} is empty; every stage needs at least one unit")
    if flat.count("E") != 1 or not flat.startswith("E"):
        raise LayoutError(f"{where}: the embedding E must appear once, as the first unit")
    if flat.count("L") != 1 or not flat.endswith("L"):
        raise LayoutError(f"{where}: the loss/head L must appear once, as the last unit")
    blocks = flat.count("t")
    if blocks != n_layer:
        raise LayoutError(f"{where} places {blocks} blocks (t) but the model has n_layer = "
                          f"{n_layer}")
    bounds, lo = {}, 0
    for k, st in enumerate(stages):
        bounds[k] = (lo, lo + len(st))
        lo += len(st)
    return bounds


def layout_string(symbols: list[str], bounds: dict[int, tuple[int, int]]) -> str:
    """Megatron's layout string of a cut (``symbols``: each unit's E / t / L), runs written
    t*N: the inverse of ``layout_bounds``."""
    stages = []
    for _, (lo, hi) in sorted(bounds.items()):
        text, i = "", lo
        while i < hi:
            j = i
            while j < hi and symbols[j] == symbols[i]:
                j += 1
            text += symbols[i] if j - i == 1 else f"{symbols[i]}*{j - i}"
            i = j
        stages.append(text)
    return "|".join(stages)
