"""Every `fix:` hint is a step a user of the installed wheel can take. The wheel ships the
`m3patch` package only (with its `_shipped/` series and recipes): no `scripts/`, no `docs/`, so
a hint naming one of those paths gives a command that does not exist where the wheel runs."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from m3patch.eval.harness import LM_EVAL_PIN, setup_hint

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "m3patch"
CHECKOUT_PATH = re.compile(r"(?<![\w/.])(?:scripts|docs)/[\w./<>-]*")
HINT_NAME = re.compile(r"hint|^FIX_", re.IGNORECASE)

def _strings(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def hint_texts(source: str) -> Iterator[str]:
    """The text of every hint: `hint=` / `*_hint=` arguments, `*HINT*` / `FIX_*` constants and
    what functions named `*hint*` return (f-strings by their literal parts)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg and HINT_NAME.search(node.arg):
            yield from _strings(node.value)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(
                    isinstance(t, ast.Name) and HINT_NAME.search(t.id) for t in targets):
                yield from _strings(node.value)
        elif isinstance(node, ast.FunctionDef) and HINT_NAME.search(node.name):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return) and sub.value is not None:
                    yield from _strings(sub.value)


def checkout_paths(path: Path) -> list[str]:
    return sorted({m.group() for text in hint_texts(path.read_text(encoding="utf-8"))
                   for m in CHECKOUT_PATH.finditer(text)})


def offenders() -> dict[str, list[str]]:
    found = {path.relative_to(REPO).as_posix(): checkout_paths(path)
             for path in sorted(PACKAGE.rglob("*.py"))}
    return {rel: paths for rel, paths in found.items() if paths}


def test_no_hint_names_a_path_the_wheel_lacks() -> None:
    bad = offenders()
    assert bad == {}, "hints name checkout-only paths (scripts/, docs/): not in the wheel"


def test_the_scan_sees_hints_of_every_shape() -> None:
    code = ('X_HINT = "bash scripts/a.sh"\nFIX_Y = "see docs/y.md"\n'
            'raise E(m, hint=f"run scripts/b.sh {x}")\nf(spawn_hint="docs/c.md")\n'
            'def fix_hint(r):\n    return f"python scripts/d.py {r}"\n'
            'HELP = "scripts/not-a-hint.sh"\n')
    found = {m.group() for t in hint_texts(code) for m in CHECKOUT_PATH.finditer(t)}
    assert found == {"scripts/a.sh", "docs/y.md", "scripts/b.sh", "docs/c.md", "scripts/d.py"}


def test_the_lm_eval_hint_installs_what_the_setup_script_pins() -> None:
    script = (REPO / "scripts" / "setup" / "setup_lm_eval.sh").read_text(encoding="utf-8")
    pinned = re.search(r"LM_EVAL_VERSION='([^']+)'", script)
    assert pinned is not None and f"lm-eval[api]=={pinned.group(1)}" == LM_EVAL_PIN
    assert setup_hint("/opt/ev env/bin/python") == (
        "python3 -m venv '/opt/ev env' && '/opt/ev env'/bin/pip install 'lm-eval[api]==0.4.13'  "
        "(or set eval.python / $M3PATCH_LM_EVAL_PYTHON)")
