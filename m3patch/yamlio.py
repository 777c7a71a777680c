"""Safe YAML loading that rejects duplicate keys (a silent last-wins is a wrong benchmark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from m3patch.errors import UsageError
from m3patch.fsio import read_state

YAML_MAX_BYTES = 16 << 20  # a recipe or manifest is a few KiB; a file past this is not one

_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UniqueKeyLoader(_BaseLoader):  # type: ignore[misc,valid-type]
    """SafeLoader whose mappings refuse a key given twice."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            line = key_node.start_mark.line + 1
            msg = f"duplicate key {key!r} at line {line} (first at line {seen[key]})"
            raise yaml.constructor.ConstructorError(None, None, msg, key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node)


UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def load_yaml_text(text: str, *, source: str) -> Any:
    """Parse YAML text; any syntax or duplicate-key problem is a UsageError naming the source."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # UniqueKeyLoader is a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        msg = f"{where}: invalid YAML: {problem}"
        raise UsageError(msg) from None


def load_yaml_file(path: Path) -> Any:
    """Read and parse a YAML file as UTF-8: a regular file (a link to one is followed: users
    link recipes), bounded, so a FIFO or /dev/zero in a recipe's place is refused, never read
    until memory runs out."""
    try:
        text = read_state(path, limit=YAML_MAX_BYTES, links=True).decode("utf-8")
    except FileNotFoundError:
        msg = f"{path}: file not found"
        raise UsageError(msg) from None
    except OSError as exc:
        msg = f"{path}: cannot read: {exc.strerror or exc}"
        raise UsageError(msg, hint=f"{path} must be a plain YAML file") from None
    except UnicodeDecodeError as exc:
        msg = f"{path}: cannot read: {exc}"
        raise UsageError(msg) from None
    return load_yaml_text(text, source=str(path))
