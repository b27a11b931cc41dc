"""What the subcommands of ``python -m attnzoo`` share: argument types and one-line usage errors.

A bad flag is a usage error: ``parser.error`` prints the usage line and one message to stderr and exits 2, before
any input is built or any backend runs.  The types below turn a malformed value into that error (argparse reports
an ``ArgumentTypeError`` as ``argument --flag: <message>``).
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Iterable

import torch


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest known name, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(kind: str, name: str, known: Iterable[str]) -> str:
    """The one-line message for a name that is not among ``known``: the closest match, then every known name."""
    known = list(known)
    return f"unknown {kind} {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}"


def pick_names(text: str, known: Iterable[str], kind: str) -> list[str]:
    """The names of the comma list ``text``, each checked against ``known`` (``ValueError`` naming the first
    unknown one, with a suggestion)."""
    known = list(known)
    picked = [name.strip() for name in text.split(",") if name.strip()]
    if not picked:
        raise ValueError(f"no {kind} named in {text!r}")
    for name in picked:
        if name not in known:
            raise ValueError(unknown_name(kind, name, known))
    return picked


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def finite_float(text: str) -> float:
    """A finite real number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite real number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """A comma list of integers >= 1 (``"64,128"``)."""
    values = [_int(item) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"must be a comma list of positive integers, got {text!r}")
    for value in values:
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be positive integers, got {value}")
    return values


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """A usage error for ``--device cuda`` on a machine where PyTorch sees no CUDA device."""
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
        parser.error(f"--device cuda: CUDA is not available here (torch {torch.__version__}, {build})")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
