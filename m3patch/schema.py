"""Strict schema helpers: breadcrumbs to the bad key, unknown keys are errors with a suggestion.

Shape borrowed from cfgv/pre-commit (`==> At key: ...`) and cibuildwheel ("Perhaps you meant").
Loaders call these on raw YAML and return frozen dataclasses; raw dicts never leave a loader.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from m3patch.errors import UsageError

T = TypeVar("T")


class SchemaError(UsageError):
    """A config value is invalid; `trail` is the path from the file to the bad key."""

    def __init__(self, message: str, trail: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.trail = trail

    def with_context(self, ctx: str) -> SchemaError:
        return SchemaError(self.message, (ctx, *self.trail))

    def __str__(self) -> str:
        lines = [f"==> {ctx}" for ctx in self.trail]
        lines.append(f"=====> {self.message}")
        return "\n".join(lines)

    def one_line(self) -> str:
        where = " > ".join(self.trail)
        return f"{where}: {self.message}" if where else self.message


@contextmanager
def context(ctx: str) -> Iterator[None]:
    """Prefix any SchemaError raised inside with one breadcrumb line."""
    try:
        yield
    except SchemaError as exc:
        raise exc.with_context(ctx) from None


@contextmanager
def at_key(key: str | int) -> Iterator[None]:
    label = f"At index {key}" if isinstance(key, int) else f"At key: {key}"
    with context(label):
        yield


# A namespace every name shares says nothing about which name was meant: `VLLM_ATTENTION_BACKND`
# is nearer `VLLM_PATTERN_MATCH_DEBUG` than anything else when the common `VLLM_` is scored.
_NAMESPACES = ("VLLM_", "M3PATCH_", "--")


def closest(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice nearest `name` (the first of `nearest`); None if none is near enough."""
    found = nearest(name, choices, cutoff)
    return found[0] if found else None


def nearest(name: str, choices: Iterable[str], cutoff: float = 0.6) -> list[str]:
    """Every choice equally near `name`, scored without a namespace prefix they share: the
    candidates difflib finds close (or one edit away), ranked by edits, a swap of two neighbours
    counting as one (`MAH` is one edit from `MHA`, two from `MLA`); [] if none is near."""
    prefix = next((p for p in _NAMESPACES if name.startswith(p)), "")
    cores: dict[str, str] = {}
    for choice in choices:
        cores.setdefault(choice.removeprefix(prefix), choice)
    core = name.removeprefix(prefix)
    close = difflib.get_close_matches(core, list(cores), n=max(1, len(cores)), cutoff=cutoff)
    close += [c for c in cores if c not in close and len(core) > 3 and _one_edit(core, c)]
    if not close:
        return []
    ranked = [(edits(core, c), c) for c in close]
    best = min(score for score, _ in ranked)
    return [cores[c] for score, c in ranked if score == best]


def _one_edit(a: str, b: str) -> bool:
    """Whether `b` is `a` with one character changed, added, dropped, or two neighbours swapped."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    start = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
    if len(a) == len(b):
        return a[start + 1:] == b[start + 1:] or (
            a[start:start + 2] == b[start:start + 2][::-1] and a[start + 2:] == b[start + 2:])
    longer, shorter = (a, b) if len(a) > len(b) else (b, a)
    return longer[start + 1:] == shorter[start:]


def edits(a: str, b: str) -> int:
    """Edit distance, an adjacent swap counting as one edit (optimal string alignment)."""
    before: list[int] = []
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        above, row = row, [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            row[j] = min(above[j] + 1, row[j - 1] + 1, above[j - 1] + (x != y))
            if i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                row[j] = min(row[j], before[j - 2] + 1)
        before = above
    return row[-1]


def suggest(name: str, choices: Iterable[str]) -> str:
    """' Perhaps you meant 'x'?' (or 'x' or 'y', when they are equally near) or ''."""
    found = nearest(name, choices)
    if not found:
        return ""
    quoted = [repr(f) for f in found]
    listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f" Perhaps you meant {listed}?"


def check_keys(
    data: Mapping[str, Any], *, required: Iterable[str] = (), optional: Iterable[str] = ()
) -> None:
    """Reject unknown keys (with a suggestion) and report the first missing required key."""
    required = tuple(required)
    allowed = (*required, *optional)
    for key in data:
        if not isinstance(key, str):  # YAML allows int/bool keys even where str is declared
            msg = f"keys must be strings, got {key!r}"  # type: ignore[unreachable]
            raise SchemaError(msg)
        if key not in allowed:
            msg = f"unknown key {key!r}.{suggest(key, allowed)}"
            raise SchemaError(msg)
    for key in required:
        if key not in data:
            msg = f"missing required key {key!r}"
            raise SchemaError(msg)


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def expect_mapping(value: object, what: str = "a mapping") -> dict[str, Any]:
    if not isinstance(value, dict):
        msg = f"expected {what}, got {type_name(value)}"
        raise SchemaError(msg)
    return value


def expect_str_keys(value: object, what: str = "a mapping") -> dict[str, Any]:
    """A mapping whose every key is a string: YAML reads `1:`, `true:` and `null:` as an int, a
    bool and None, which a name, a flag or an env variable cannot be."""
    data = expect_mapping(value, what)
    for key in data:
        if not isinstance(key, str):  # what the annotation says is not what YAML gives
            shown = f"{short_repr(key)} ({type_name(key)})"  # type: ignore[unreachable]
            msg = f"keys must be strings, got {shown}; quote it"
            raise SchemaError(msg)
    return data


def expect_list(value: object, *, non_empty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        msg = f"expected a list, got {type_name(value)}"
        raise SchemaError(msg)
    if non_empty and not value:
        msg = "expected a non-empty list"
        raise SchemaError(msg)
    return value


def expect_str(value: object, *, non_empty: bool = True) -> str:
    if not isinstance(value, str):
        msg = f"expected a string, got {type_name(value)}"
        raise SchemaError(msg)
    if non_empty and not value.strip():
        msg = "expected a non-empty string"
        raise SchemaError(msg)
    return value


def expect_bool(value: object) -> bool:
    if not isinstance(value, bool):
        msg = f"expected true or false, got {type_name(value)}"
        raise SchemaError(msg)
    return value


def expect_int(value: object, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"expected an integer, got {type_name(value)}"
        raise SchemaError(msg)
    if minimum is not None and value < minimum:
        msg = f"expected an integer >= {minimum}, got {value}"
        raise SchemaError(msg)
    return value


def short_repr(value: object, limit: int = 40) -> str:
    """`repr(value)` cut to `limit` characters: a value read back may be a 400-digit integer."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def finite_number(value: object) -> float | None:
    """`value` as a float when it is a finite int or float (never a bool), else None. Files read
    back hold what JSON and YAML can say: NaN, infinities, and integers of any size
    (`math.isfinite(10**400)` raises OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def expect_number(value: object, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"expected a number, got {type_name(value)}"
        raise SchemaError(msg)
    number = finite_number(value)
    if number is None:  # a NaN deadline never ends a wait; a NaN ratio passes every comparison
        msg = f"expected a finite number, got {short_repr(value)}"
        raise SchemaError(msg)
    if minimum is not None and number < minimum:
        msg = f"expected a number >= {minimum}, got {value}"
        raise SchemaError(msg)
    return number


def finite_text(value: str | int | float) -> str:
    """The value as a command line's text, never one that reads as NaN or infinity: argparse's
    and most clients' float() take "nan" and "inf" (any case, signed, padded), and a NaN passes
    every bound it meets, so `.nan` and `'nan'` are refused alike."""
    text = str(value)
    try:
        number = float(text)
    except (ValueError, OverflowError):
        return text
    if not math.isfinite(number):
        msg = f"expected a finite number, got {short_repr(text.strip())} (read as {number})"
        raise SchemaError(msg)
    return text


def expect_flag_value(value: object) -> str | int | float | bool:
    """A value another tool reads as KEY=VALUE (lm-eval's --gen_kwargs, AIPerf's
    --extra-inputs): a string, a finite number or true/false."""
    if not isinstance(value, (str, int, float, bool)):
        msg = f"expected a string, number or true/false, got {type_name(value)}"
        raise SchemaError(msg)
    if not isinstance(value, bool):
        finite_text(value)
    return value


def expect_choice(value: object, choices: Iterable[str]) -> str:
    text = expect_str(value)
    choices = tuple(choices)
    if text not in choices:
        msg = f"expected one of {', '.join(choices)}, got {text!r}.{suggest(text, choices)}"
        raise SchemaError(msg)
    return text


def str_list(value: object, *, non_empty: bool = False) -> tuple[str, ...]:
    items = expect_list(value, non_empty=non_empty)
    out: list[str] = []
    for index, item in enumerate(items):
        with at_key(index):
            out.append(expect_str(item))
    return tuple(out)


def in_file(path: object) -> Any:
    """Context manager naming the file as the first breadcrumb."""
    return context(f"File {path}")
