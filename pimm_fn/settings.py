"""Experiment settings: a flat dict of defaults and typed ``key=value`` overrides."""
from __future__ import annotations

import ast
import difflib
from typing import Any, Iterable, Mapping


class SettingsError(ValueError):
    """A ``--set`` override that names an unknown key or has the wrong type."""


def _parse_value(key: str, text: str, default: Any) -> Any:
    if default is None:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    kind = type(default)
    if kind is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"setting {key!r} is a bool; got {text!r} (use true/false)")
    if kind in (int, float):
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise SettingsError(f"setting {key!r} is {kind.__name__} (default {default!r}); got {text!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise SettingsError(f"setting {key!r} is {kind.__name__} (default {default!r}); got {text!r}")
        return kind(value)
    if kind is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SettingsError(f"setting {key!r} is {kind.__name__} (default {default!r}); got {text!r}, which is not a Python literal") from None
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return kind(value)
    if not isinstance(value, kind):
        raise SettingsError(f"setting {key!r} is {kind.__name__} (default {default!r}); got {text!r}")
    return value


def apply_overrides(defaults: Mapping[str, Any], pairs: Iterable[str]) -> dict:
    """``defaults`` updated by ``key=value`` strings, each parsed to the default's type.

    Unknown keys and wrong types raise :class:`SettingsError` listing the valid keys.
    """
    settings = dict(defaults)
    for pair in pairs:
        if "=" not in pair:
            raise SettingsError(f"--set takes key=value, got {pair!r}; valid keys: {', '.join(sorted(defaults))}")
        key, text = pair.split("=", 1)
        key = key.strip()
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SettingsError(
                f"unknown setting {key!r}{hint}; valid keys: "
                + ", ".join(f"{k}={defaults[k]!r}" for k in sorted(defaults))
            )
        settings[key] = _parse_value(key, text, defaults[key])
    return settings
