"""Safe YAML loading that rejects duplicate keys (a silent last-wins is a wrong benchmark)."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from m3patch.errors import UsageError
from m3patch.fsio import read_state

YAML_MAX_BYTES = 16 << 20  # a recipe or manifest is a few KiB; a file past this is not one

_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


YAML_MAX_NODES = 1 << 20  # values a file may expand to, aliases counted at every use


class UniqueKeyLoader(_BaseLoader):  # type: ignore[misc,valid-type]
    """SafeLoader whose mappings refuse a key given twice, and whose documents are refused when
    their aliases expand past YAML_MAX_NODES values (a billion-laughs file of 1 KiB builds
    nothing big itself, but every reader that walks it, json.dumps of a vllm-args value, does)."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return self.construct_document(node)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose values, aliases expanded, pass YAML_MAX_NODES, or an alias that
    contains itself (no reader can walk it to an end). Iterative: a node's size once."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[yaml.Node] = [root]
    while stack:
        node = stack[-1]
        if id(node) in sizes:
            stack.pop()
            continue
        todo = [c for c in _children(node) if id(c) not in sizes]
        if id(node) in open_nodes and not todo:
            stack.pop()
            open_nodes.discard(id(node))
            size = 1 + sum(sizes[id(c)] for c in _children(node))
            sizes[id(node)] = min(size, YAML_MAX_NODES + 1)  # no astronomically large ints
            continue
        if any(id(c) in open_nodes for c in todo):
            raise yaml.constructor.ConstructorError(
                None, None, "an alias contains itself (a recursive value)", node.start_mark)
        open_nodes.add(id(node))
        stack.extend(todo)
    if sizes[id(root)] > YAML_MAX_NODES:
        msg = (f"its aliases expand to more than {YAML_MAX_NODES} YAML nodes (a recipe or "
               "manifest holds a few hundred); write the values out or use fewer aliases")
        raise yaml.constructor.ConstructorError(None, None, msg, None)


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, Hashable):  # `? [a, b]`: SafeLoader's own error would be a crash
            msg = f"a key must be a plain value, got a {type(key).__name__} (a `? ...` key)"
            raise yaml.constructor.ConstructorError(None, None, msg, key_node.start_mark)
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
    except (ValueError, OverflowError) as exc:  # a value Python cannot build: 13th month, 5000 digits
        msg = f"{source}: invalid YAML: {str(exc).split(';')[0]}"
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
