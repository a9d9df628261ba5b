"""argparse `type=` callables for numeric and list CLI options, so a bad value is an
argparse usage error naming it (exit code 2), never a traceback deep inside a run."""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence


def positive_int(text: str) -> int:
    """An integer ≥ 1 ("3").

    Raises:
        argparse.ArgumentTypeError: not an integer, or < 1 (the message quotes `text`).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0 ("0", "1.5").

    Raises:
        argparse.ArgumentTypeError: not a number, NaN/infinite, or < 0 (the message quotes
            `text`).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 ("0.5").

    Raises:
        argparse.ArgumentTypeError: not a number, NaN/infinite, or ≤ 0 (the message quotes
            `text`).
    """
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def listen_port(text: str) -> int:
    """A TCP port to listen on, 0..65535, 0 meaning any free port ("8000").

    Raises:
        argparse.ArgumentTypeError: anything else (the message quotes `text`).
    """
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 = any free port), got "
                                         f"{text!r}")
    return int(text)


def names_from(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """A `type=` callable reading "b, a" as a list of `known` names, in `known` order
    (duplicates dropped); `what` is the singular noun its errors use ("router").

    The callable raises argparse.ArgumentTypeError for an unknown name or an empty list (the
    message lists the known names).
    """
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or text!r}; known: "
                                             f"{', '.join(known)}")
        return [n for n in known if n in names]
    return parse


def json_object(text: str, source: str) -> dict:
    """`text` parsed as a JSON object; `source` names where it came from in errors
    (e.g. "--config" or a file path).

    Raises:
        ValueError: invalid JSON, or valid JSON that is not an object (names `source`).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                         f"{exc.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{source}: must be a JSON object, got {type(value).__name__}")
    return value
