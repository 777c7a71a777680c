"""Where a recipe's model, draft and tokenizer live on disk, whether they are there, how to fetch.

`serve` runs vLLM offline (HF_HUB_OFFLINE=1), so everything it loads must already be a local
folder or a complete entry of the Hugging Face hub cache:

    <cache>/models--ORG--NAME/refs/main             the commit `main` pointed at when fetched
    <cache>/models--ORG--NAME/snapshots/<commit>/   config.json, weights, tokenizer files

The cache is `--download-dir` from the recipe's vllm-args, else $HF_HUB_CACHE, else
$HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (huggingface_hub's
own order), read from the environment the launch will have. Checking is pure reading; `fetch`
is the one effect and imports huggingface_hub (the optional `models` extra) only when it runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from m3patch.errors import ModelMissing, UsageError
from m3patch.fsio import read_json
from m3patch.recipe.loader import Recipe

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")  # ORG/NAME, or a legacy NAME
DEFAULT_REF = "main"
# vLLM reads the weights through the index; a snapshot without every shard it names is a download
# that stopped half-way, and vLLM would fail after the series was applied.
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
INDEX_LIMIT = 64 << 20  # a real index is a few MB; anything larger is not one
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ModelNeed:
    """One thing vLLM (or the bench client) loads: what the recipe names and at which commit."""

    role: str              # model | draft | tokenizer
    key: str               # the recipe key that names it (for messages)
    source: str            # an absolute local folder or a hub id ORG/NAME
    revision: str | None   # the pinned commit; None: the commit `main` names
    needs_config: bool     # a model folder must have config.json; a tokenizer folder need not

    @property
    def is_local(self) -> bool:
        return Path(self.source).is_absolute()


@dataclass(frozen=True)
class Presence:
    need: ModelNeed
    folder: Path | None    # the folder vLLM will read; None when it is not there
    problem: str | None    # why not (None when present)

    @property
    def present(self) -> bool:
        return self.problem is None


def needs_of(recipe: Recipe) -> tuple[ModelNeed, ...]:
    """Model, draft and tokenizer; a tokenizer from the model's own repo follows its pin (vLLM's
    tokenizer_revision defaults to the model revision) and is not listed twice."""
    model = recipe.model
    out = [ModelNeed("model", "model.source", model.source, model.revision, True)]
    if model.draft is not None:
        out.append(ModelNeed("draft", "model.draft", model.draft, None, True))
    if model.tokenizer != model.source:
        out.append(ModelNeed("tokenizer", "model.tokenizer", model.tokenizer, None, False))
    return tuple(out)


def launch_env(recipe: Recipe) -> dict[str, str]:
    """The environment vLLM will see for the cache variables: the shell's, then the recipe's."""
    return {**os.environ, **dict(recipe.env)}


def hub_cache(recipe: Recipe, env: Mapping[str, str]) -> Path:
    args = recipe.vllm_args
    if "--download-dir" in args[:-1]:  # vLLM passes it to huggingface_hub as cache_dir
        return Path(args[args.index("--download-dir") + 1]).expanduser()
    return env_hub_cache(env)


def env_hub_cache(env: Mapping[str, str]) -> Path:
    """huggingface_hub's own order: HF_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME, ~/.cache."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path("~/.cache").expanduser()) / "huggingface" / "hub"


def repo_folder(cache: Path, hub_id: str) -> Path:
    return cache / ("models--" + hub_id.replace("/", "--"))


def locate(need: ModelNeed, cache: Path) -> Presence:
    """Is `need` on disk, and where; reads only (every file read is checked like hostile input)."""
    if need.is_local:
        folder = Path(need.source)
        marker = folder / "config.json" if need.needs_config else folder
        if not marker.exists():
            what = "has no config.json" if folder.is_dir() else "does not exist"
            return Presence(need, None, f"local folder {folder} {what}")
        return Presence(need, folder, None)
    if not _HUB_ID.match(need.source):
        return Presence(need, None, f"{need.source!r} is neither a local path (/, ~, ./) nor a hub id ORG/NAME")
    repo = repo_folder(cache, need.source)
    commit, problem = _commit(repo, need.revision)
    if commit is None:
        return Presence(need, None, problem)
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        return Presence(need, None, f"{_at(need)}: no snapshot folder {snapshot}")
    if need.needs_config and not (snapshot / "config.json").is_file():
        return Presence(need, None, f"{_at(need)}: {snapshot} has no config.json")
    missing = _missing_shards(snapshot, need.needs_config)
    if missing:
        return Presence(need, None, f"{_at(need)}: {snapshot} lacks {len(missing)} weight file(s) "
                                    f"(first: {missing[0]}): an unfinished download")
    return Presence(need, snapshot, None)


def _at(need: ModelNeed) -> str:
    return f"{need.source} at {need.revision or DEFAULT_REF}"


def _commit(repo: Path, revision: str | None) -> tuple[str | None, str]:
    """The snapshot commit to read: the pin itself, or the commit refs/main records."""
    if revision is not None:
        if (repo / "snapshots" / revision).is_dir():
            return revision, ""
        have = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
        cached = f"the cache has {', '.join(have)}" if have else "nothing of it is cached"
        return None, f"{repo.name}: the pinned revision {revision} is not cached ({cached})"
    ref = repo / "refs" / DEFAULT_REF
    try:
        with ref.open("rb") as handle:  # a commit is 40 bytes; never read a huge file whole
            text = handle.read(128).decode("ascii", errors="replace").strip()
    except FileNotFoundError:
        return None, f"not in the Hugging Face cache (no {ref})"
    except OSError as exc:
        return None, f"cannot read {ref}: {exc.strerror}"
    if not _COMMIT.match(text):
        return None, f"{ref} does not hold a commit hash (got {text[:60]!r}): a broken cache entry"
    return text, ""


def _missing_shards(snapshot: Path, weights: bool) -> list[str]:
    """Weight files the snapshot's index names that are not there (or the index's own fault);
    with no index, a model snapshot needs at least one weight file (config.json alone is the
    first file a download writes)."""
    for name in WEIGHT_INDEXES:
        index = snapshot / name
        if not index.is_file():
            continue
        if index.stat().st_size > INDEX_LIMIT:
            return [f"{name} (over {INDEX_LIMIT >> 20} MiB: not an index)"]
        try:
            data = read_json(index, error=ModelMissing, hint="", expect=dict, links=True)
        except ModelMissing as exc:
            return [f"{name} ({exc.message})"]
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            return [f"{name} (no weight_map)"]
        files = sorted({str(f) for f in weight_map.values()})
        return [f for f in files if not _inside(f) or not (snapshot / f).is_file()]
    if weights and not any(p.is_file() for p in snapshot.iterdir() if p.suffix in WEIGHT_SUFFIXES):
        return [f"any {' / '.join('*' + x for x in WEIGHT_SUFFIXES)}"]
    return []


def _inside(relpath: str) -> bool:
    """A shard name from the index stays inside the snapshot (no absolute path, no `..`)."""
    return not Path(relpath).is_absolute() and ".." not in Path(relpath).parts


def check(recipe: Recipe, env: Mapping[str, str] | None = None) -> tuple[Presence, ...]:
    env = launch_env(recipe) if env is None else env
    cache = hub_cache(recipe, env)
    return tuple(locate(need, cache) for need in needs_of(recipe))


def fetch_command(recipe: Recipe) -> str:
    return f"m3patch model fetch {recipe.path}"


def require_present(recipe: Recipe, env: Mapping[str, str] | None = None) -> tuple[Presence, ...]:
    """Raise ModelMissing (one message for every missing part) unless all of them are on disk."""
    found = check(recipe, env)
    missing = [p for p in found if not p.present]
    if missing:
        raise ModelMissing(missing_message(recipe, missing), hint=fix_hint(recipe, missing))
    return found


def missing_message(recipe: Recipe, missing: list[Presence]) -> str:
    parts = ", ".join(p.need.role for p in missing)
    lines = [f"{recipe.path}: not on disk: {parts} (vLLM runs offline; nothing was applied)"]
    lines += [f"{p.need.role} {p.need.source} ({p.need.key}): {p.problem}" for p in missing]
    return "\n".join(lines)


def fix_hint(recipe: Recipe, missing: list[Presence]) -> str:
    if all(p.need.is_local for p in missing):
        folder = missing[0].need.source
        key = missing[0].need.key
        return (f"put the model folder (with its config.json) at {folder}, or point {key} at "
                f"one; a hub id there is fetched by `{fetch_command(recipe)}`")
    return fetch_command(recipe)


# ---------------------------------------------------------------- fetch (the one effect)

Downloader = Callable[..., str]


def hub_downloader() -> Downloader:
    """huggingface_hub's snapshot_download, imported here: the CLI stays light without it."""
    # The user asked to download: an image-wide HF_HUB_OFFLINE=1 must not turn that into a no-op.
    # huggingface_hub reads it once, when first imported (which is here).
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.pop(name, None)
    try:
        # deferred: huggingface_hub: optional extra, only `model fetch` needs it
        from huggingface_hub import snapshot_download
    except ImportError:
        msg = "fetching models needs huggingface_hub, which is not installed"
        raise UsageError(msg, hint="pip install 'm3patch[models]'  (or: pip install huggingface_hub)") from None
    return snapshot_download  # type: ignore[no-any-return]


def fetch(recipe: Recipe, env: Mapping[str, str] | None = None,
          download: Downloader | None = None) -> tuple[Presence, ...]:
    """Download every hub part that is not on disk yet, into the cache the launch reads.

    `download` defaults to huggingface_hub's snapshot_download, imported only when something is
    missing (so a recipe that is complete needs no huggingface_hub at all).
    """
    env = launch_env(recipe) if env is None else env
    cache = hub_cache(recipe, env)
    for presence in check(recipe, env):
        need = presence.need
        if presence.present or need.is_local:
            continue  # a missing local folder cannot be downloaded: require_present says so
        download = download or hub_downloader()
        try:
            download(repo_id=need.source, revision=need.revision, cache_dir=str(cache),
                     token=env.get("HF_TOKEN") or None)
        except Exception as exc:  # the hub's errors: auth, network, unknown repo or revision
            msg = (f"{recipe.path}: cannot fetch {need.role} {need.source} at "
                   f"{need.revision or DEFAULT_REF} into {cache}: {type(exc).__name__}: {exc}")
            hint = (f"check the network (HTTPS_PROXY), the id and revision on huggingface.co, and "
                    f"HF_TOKEN=hf_... for a gated model; then: {fetch_command(recipe)}")
            raise ModelMissing(msg, hint=hint) from None
    return require_present(recipe, env)
