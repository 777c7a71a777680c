"""The texts a vLLM tree can print, read from its Python sources with `ast` (vLLM is never
imported): every string literal, f-string and format string, interpolations as wildcards.

A template is a tuple of pieces: a `str` is literal text, `None` is a value wildcard (a `%s`,
an f-string field, a `{}` of `.format`, the non-string side of a `+`) that stands for one value
without whitespace (a backend name, a path, a number); `ANY` is free text (the log prefix). Log calls
(`logger.info(...)`, `..._once`) carry vLLM's line prefix `... [file.py:LINE] ` in front, so a
marker that copies the prefix from a log is matched too. Class names are texts as well:
tracebacks and `%s` of a class print them (`EngineDeadError`), followed by one value at most
(`EngineDeadError:`), never by free text.

Each text records the platforms it is confined to when it sits in the body of an
`if current_platform.is_rocm():`-style branch or in a platform's own file; this is a heuristic
(only the enclosing `if` tests and file paths are read, not data flow), used for warnings only.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

Piece = str | int | None
Template = tuple[Piece, ...]
ANY = 1  # the log-line prefix's free parts (process name, level, time, file): any text

LOG_METHODS = frozenset({
    "debug", "info", "warning", "warn", "error", "exception", "critical", "log",
    "debug_once", "info_once", "warning_once", "error_once"})
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?[diouxXeEfFgGcrsa%]")
_BRACES = re.compile(r"\{\{|\}\}|\{[^{}]*\}")

ROCM = ("rocm-gfx942", "rocm-gfx950")
# platform predicates of vLLM (current_platform.is_*(), rocm's on_* helpers) -> our vocabulary;
# a platform outside it (xpu, tpu) maps to () = "none of ours"
_PREDICATES: dict[str, tuple[str, ...]] = {
    "is_rocm": ROCM, "is_cuda": ("cuda",), "is_cuda_alike": ("cuda", *ROCM), "is_cpu": ("cpu",),
    "is_xpu": (), "is_tpu": (), "on_gfx942": ("rocm-gfx942",), "on_gfx950": ("rocm-gfx950",),
    "on_gfx9": ROCM, "on_mi3xx": ROCM, "on_cdna": ROCM,
}
_PATH_PLATFORMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm/platforms/rocm.py", ROCM), ("vllm/platforms/cuda.py", ("cuda",)),
    ("vllm/platforms/cpu.py", ("cpu",)), ("vllm/platforms/xpu.py", ()),
    ("/amd/", ROCM), ("/nvidia/", ("cuda",)), ("/rocm/", ROCM), ("/xpu/", ()), ("/tpu/", ()),
)


@dataclass(frozen=True)
class Source:
    """One text the tree can print: where it is, its template, and where it can run."""

    path: str  # relative to the tree root, vllm/...
    line: int
    template: Template
    log: bool  # a logger call (the template starts with the log-line prefix)
    platforms: tuple[str, ...] | None  # None: any platform; else only these (maybe none of ours)

    def shown(self) -> str:
        """The template as a reader sees it: wildcards as '…'."""
        return "".join(p if isinstance(p, str) else "…" for p in self.template)


def _percent_pieces(text: str) -> list[Piece]:
    out: list[Piece] = []
    last = 0
    for m in _PERCENT.finditer(text):
        out.append(text[last:m.start()])
        out.append("%" if m.group() == "%%" else None)
        last = m.end()
    out.append(text[last:])
    return out


def _brace_pieces(text: str) -> list[Piece]:
    out: list[Piece] = []
    last = 0
    for m in _BRACES.finditer(text):
        out.append(text[last:m.start()])
        out.append(m.group()[0] if m.group() in ("{{", "}}") else None)
        last = m.end()
    out.append(text[last:])
    return out


def normalise(pieces: list[Piece]) -> Template:
    """Join adjacent literals, drop empty ones, collapse runs of wildcards."""
    out: list[Piece] = []
    for piece in pieces:
        if piece == "":
            continue
        if not isinstance(piece, str) and out and out[-1] == piece:
            continue
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] = out[-1] + piece
            continue
        out.append(piece)
    return tuple(out)


def _pieces(node: ast.expr, *, braces: bool = False) -> list[Piece] | None:
    """The template of a string expression, or None when `node` is no string expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
        return _brace_pieces(text) if braces else _percent_pieces(text)
    if isinstance(node, ast.JoinedStr):
        out: list[Piece] = []
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.extend(_percent_pieces(value.value))
            else:
                out.append(None)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pieces(node.left), _pieces(node.right)
        if left is None and right is None:
            return None
        return [*(left or [None]), *(right or [None])]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "format" and isinstance(node.func.value, ast.Constant) \
            and isinstance(node.func.value.value, str):
        return _pieces(node.func.value, braces=True)
    return None


def _log_prefix(line: int) -> list[Piece]:
    """vLLM's `(APIServer pid=1) INFO 12-01 10:00:00 [fileinfo:LINE] ` before the message."""
    return [ANY, "[", ANY, f":{line}] "]


def _test_platforms(test: ast.expr) -> tuple[str, ...] | None:
    """The platforms an `if` test confines its body to, when it is a plain platform predicate
    (`current_platform.is_rocm()`, `on_gfx942()`, `not ...` is not narrowed)."""
    if isinstance(test, ast.Call):
        func = test.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(
            func, ast.Name) else None
        if name in _PREDICATES:
            return _PREDICATES[name]
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        for value in test.values:
            found = _test_platforms(value)
            if found is not None:
                return found
    return None


def path_platforms(path: str) -> tuple[str, ...] | None:
    for fragment, platforms in _PATH_PLATFORMS:
        if fragment in path:
            return platforms
    return None


def _narrow(outer: tuple[str, ...] | None, inner: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if outer is None:
        return inner
    if inner is None:
        return outer
    return tuple(p for p in outer if p in inner)


class _Collector(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.platforms: tuple[str, ...] | None = path_platforms(path)
        self.found: list[Source] = []

    def _add(self, node: ast.expr, pieces: list[Piece], *, log: bool) -> None:
        template = normalise(pieces)
        if any(isinstance(p, str) for p in template):
            self.found.append(Source(self.path, node.lineno, template, log, self.platforms))

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        saved = self.platforms
        self.platforms = _narrow(saved, _test_platforms(node.test))
        for stmt in node.body:
            self.visit(stmt)
        self.platforms = saved
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant):  # a docstring or a bare string: never printed
            return
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.found.append(Source(self.path, node.lineno, (ANY, node.name, None), False,
                                 self.platforms))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in LOG_METHODS and node.args:
            message = node.args[1] if func.attr == "log" and len(node.args) > 1 else node.args[0]
            pieces = _pieces(message)
            if pieces is not None:
                self._add(node, [*_log_prefix(node.lineno), *pieces], log=True)
                self._add(node, pieces, log=False)
                for arg in node.args:
                    if arg is not message:
                        self.visit(arg)
                for keyword in node.keywords:
                    self.visit(keyword.value)
                return
        pieces = _pieces(node)
        if pieces is not None:
            self._add(node, pieces, log=False)
            return
        self.generic_visit(node)

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Call):
            pieces = _pieces(node)
            if pieces is not None:
                self._add(node, pieces, log=False)
                return
        super().generic_visit(node)


def file_sources(path: str, data: bytes) -> list[Source]:
    """Every text one .py file can print; a file that does not parse gives none (py_compile
    gates are elsewhere)."""
    try:
        tree = ast.parse(data, filename=path)
    except (SyntaxError, ValueError):
        return []
    collector = _Collector(path)
    collector.visit(tree)
    return collector.found
