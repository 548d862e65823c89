"""Reading zeropp.torch's settings from the environment, with one error for
every malformed value."""

from __future__ import annotations

import os

from .. import _zeropp


def count(var: str, unit: str) -> int | None:
    """The whole number of ``unit`` (at least 1) that ``var`` holds, or None
    when it is unset or empty; a ``ZeroppError`` naming the variable when it
    holds anything else."""
    v = os.environ.get(var)
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        raise _zeropp.ZeroppError(f"{var}={v!r} is not a number of {unit}") from None
    if n < 1:
        raise _zeropp.ZeroppError(f"{var}={v!r}: needs at least 1 ({unit})")
    return n
