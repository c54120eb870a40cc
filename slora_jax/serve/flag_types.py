"""Flag values: argparse types that parse one flag's text or exit 2 naming what was expected."""

from __future__ import annotations

import argparse
import math

from .config import check_header_name

__all__ = ["header_name", "non_negative_int", "positive_int", "positive_seconds", "vtc_weights"]


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, got {text!r}")
    return value


def vtc_weights(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        weights = tuple(float(x) for x in parts)
    except ValueError:
        weights = ()
    if len(weights) != 2:
        raise argparse.ArgumentTypeError(f"expected IN,OUT (two numbers, e.g. 1,2), got {text!r}")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise argparse.ArgumentTypeError(f"weights must be finite and >= 0, not both 0, got {text!r}")
    return weights


def _int(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)


def header_name(text: str) -> str:
    try:
        return check_header_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
