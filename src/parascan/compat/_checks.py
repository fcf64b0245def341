"""Argument checks that several drop-ins share (parascan._core holds the library's
own): each states a convention of the originals once, so that the drop-ins that
follow it check it, and word its errors, alike."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import TypeGuard

import torch
from torch import Tensor

from parascan._core import describe, tensor_hint

__all__ = ["check_same_3d", "errors_as", "is_integer_tensor"]


@contextlib.contextmanager
def errors_as(fn: str, checker: str, names: Mapping[str, str] | None = None) -> Iterator[None]:
    """Inside, the bad-input errors of ``checker``, the parascan function a drop-in
    calls (their messages start with its name: ``parascan.ssd_scan: ...``), are raised
    again, the same exception, under the drop-in's name ``fn``, the function its user
    called, with ``checker`` named at the end; ``names`` maps the checker's argument
    names (whole words) to what the user passed (``log_gates`` -> ``log_coeffs``).
    Other errors (a user's combine function's, an internal one) pass as they are."""
    try:
        yield
    except (TypeError, ValueError, IndexError, RuntimeError) as error:
        message = error.args[0] if len(error.args) == 1 else None
        prefix = f"{checker}: "
        if isinstance(message, str) and message.startswith(prefix):
            rest = message[len(prefix) :]
            if names:
                pattern = r"\b(" + "|".join(map(re.escape, names)) + r")\b"
                rest = re.sub(pattern, lambda m: names[m.group(1)], rest)
            # a drop-in calling a drop-in: the function that checked it is named already
            named = rest.endswith(" checked it)")
            error.args = (f"{fn}: {rest}" + ("" if named else f" ({checker} checked it)"),)
        raise


def check_same_3d(
    fn: str, first: tuple[str, Tensor], second: tuple[str, Tensor], dims: str
) -> None:
    """Two operands that are 3-dim tensors of one shape, ``dims`` naming it (e.g.
    ``"(B, T, D)"``): the inputs of the elementwise recurrences, which their originals
    take only so."""
    for name, t in (first, second):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(
                f"{fn}: expected {name} of shape {dims}, but got {describe(t)}{tensor_hint(t)}"
            )
    (a_name, a), (b_name, b) = first, second
    if a.shape != b.shape:
        raise ValueError(
            f"{fn}: expected {a_name} and {b_name} of one shape {dims}, but got {a_name} "
            f"{tuple(a.shape)} and {b_name} {tuple(b.shape)}"
        )


def is_integer_tensor(value: object) -> TypeGuard[Tensor]:
    """Whether ``value`` is a tensor of an integer dtype (not bool): sequence ids and
    state indices, which a float or bool tensor would stand for silently."""
    return (
        isinstance(value, Tensor)
        and not value.dtype.is_floating_point
        and not value.is_complex()
        and value.dtype != torch.bool
    )
