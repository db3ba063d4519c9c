"""Message sizes as ``mpipar commbench`` reads and prints them: ``8``, ``4K``, ``64M``, ``1G``."""

from __future__ import annotations

import re

DEFAULT_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M,64M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"8"``, ``"4K"``, ``"64M"``, ``"1G"`` (binary units; optional trailing ``B``/``iB``)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"bad message size {text!r}: use a positive number with K, M or G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def format_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
