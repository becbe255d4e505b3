"""Experiment settings: a flat dict of defaults and typed ``key=value`` overrides.

An experiment's settings are resolved in layers, later layers winning key by key:
``SETTINGS`` (the defaults), then ``QUICK`` when ``--quick`` is given, then each
``--set key=value``. The result is checked against ``MINIMUM`` (the smallest valid value
of a numeric setting), so ``epochs=0`` or ``batch_size=-1`` is an error naming the setting.
"""
from __future__ import annotations

import ast
import difflib
from typing import Any, Iterable, Mapping, Optional


class SettingsError(ValueError):
    """A setting that is unknown, of the wrong type or out of range; the message names it."""


def _valid_keys(defaults: Mapping[str, Any]) -> str:
    return "valid keys: " + ", ".join(f"{k}={defaults[k]!r}" for k in sorted(defaults))


def _parse_value(key: str, text: str, default: Any) -> Any:
    if default is None:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    kind = type(default)
    wrong = f"setting {key!r} is {kind.__name__} (default {default!r}), got {text!r}"
    if kind is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{wrong}; use --set {key}=true or --set {key}=false")
    if kind in (int, float):
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            value = None
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (kind is int and not isinstance(value, int))):
            raise SettingsError(
                f"{wrong}; pass a{'n' if kind is int else ''} {kind.__name__}, e.g. --set {key}={default!r}"
            )
        return kind(value)
    if kind is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SettingsError(f"{wrong}, which is not a Python literal; pass one, e.g. --set {key}={default!r}") from None
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return kind(value)
    if not isinstance(value, kind):
        raise SettingsError(f"{wrong}; pass a {kind.__name__}, e.g. --set {key}={default!r}")
    return value


def parse_overrides(defaults: Mapping[str, Any], pairs: Iterable[str]) -> dict:
    """Only the settings that ``key=value`` strings set, each parsed to the default's type.

    Unknown keys and wrong types raise :class:`SettingsError`; an unknown key's message
    suggests close names and lists the valid keys.
    """
    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise SettingsError(f"--set takes key=value, got {pair!r}; {_valid_keys(defaults)}")
        key, text = pair.split("=", 1)
        key = key.strip()
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SettingsError(f"unknown setting {key!r}{hint}; {_valid_keys(defaults)}")
        out[key] = _parse_value(key, text, defaults[key])
    return out


def check_minimum(settings: Mapping[str, Any], minimum: Mapping[str, Any]) -> None:
    """Raise :class:`SettingsError` naming the first setting below its ``minimum`` value."""
    for key, low in minimum.items():
        value = settings[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < low:
            raise SettingsError(f"setting {key!r} must be >= {low!r}, got {value!r}; "
                                f"pass --set {key}=N with N >= {low!r}")


def resolve(defaults: Mapping[str, Any], pairs: Iterable[str] = (), *, quick: Optional[Mapping[str, Any]] = None,
            minimum: Optional[Mapping[str, Any]] = None) -> dict:
    """Defaults, then ``quick`` (when given), then the ``key=value`` overrides; checked.

    An explicit override wins over ``quick``: ``--quick --set epochs=5`` trains 5 epochs.
    """
    for name, table in (("QUICK", quick), ("MINIMUM", minimum)):
        unknown = sorted(set(table or ()) - set(defaults))
        if unknown:
            raise SettingsError(f"{name} names {', '.join(map(repr, unknown))}, not in SETTINGS; "
                                f"add them to SETTINGS or remove them from {name}")
    explicit = parse_overrides(defaults, pairs)
    settings = {**defaults, **(quick or {}), **explicit}
    check_minimum(settings, minimum or {})
    return settings
