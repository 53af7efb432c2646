"""What every section of the run spec shares: :class:`ConfigError` and the validators of ``__post_init__``.

Each validator raises a :class:`ConfigError` naming the field; :mod:`locomm.config.spec` prefixes the
section (``outer.group_size: ...``).
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """An invalid run spec value; the message names the field."""


def check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        check(v > 0, n, f"must be > 0, got {v!r}")


def fraction(obj: Any, *names: str, closed_low: bool = True, closed_high: bool = True) -> None:
    for n in names:
        v = getattr(obj, n)
        lo_ok = v >= 0 if closed_low else v > 0
        hi_ok = v <= 1 if closed_high else v < 1
        check(
            lo_ok and hi_ok, n, f"must be in {'[' if closed_low else '('}0, 1{']' if closed_high else ')'}, got {v!r}"
        )


def choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    check(v in choices, name, f"must be one of {', '.join(choices)}; got {v!r}")
