"""Reading numbers that settings and arguments give."""

from __future__ import annotations

import math
from typing import SupportsFloat

__all__ = ["as_float"]


def as_float(value: SupportsFloat) -> float:
    """`float(value)`, or inf for an int past a float's range (for which `float()` raises
    OverflowError): a setting's check can then refuse it as it refuses inf."""
    try:
        return float(value)
    except OverflowError:
        return math.inf
