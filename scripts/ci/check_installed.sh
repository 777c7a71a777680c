#!/usr/bin/env bash
# CI: the installed tool works as a user in a pinned image gets it, far from any checkout.
#
#   1. copy the checkout's source files (what a fresh clone holds) and build the wheel from them;
#   2. install the wheel into a fresh venv (dependencies from PyPI);
#   3. from an empty folder outside the checkout, with an empty HOME and no M3PATCH_* variables,
#      run: locate, series list, apply --verify (no --series: the shipped series for the located
#      vLLM), status, apply again (already applied), revert (the tree is byte-identical to the
#      pristine one again, but for m3patch's tree lock) on a copy of the real vLLM 0.33.0 tree; `recipe show NAME`,
#      `serve NAME --dry-run`; `changelog check` on a scratch git repository.
# Every check runs; the script lists each as ok/FAILED and exits 1 if any failed.
#
# Needs: python3 with venv, git, and the pristine 0.33.0 tree (downloaded once from PyPI into
# ~/.cache/m3patch by the test suite, or by this script through the installed m3patch).
#   KEEP=1  keep the scratch folder for a look afterwards
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/m3patch-installed.XXXXXX")"
[[ "${KEEP:-0}" == 1 ]] || trap 'rm -rf "$WORK"' EXIT
FAILED=()
start=$(date +%s)

say() { printf '\n== %s\n' "$*"; }
die() { echo "check_installed: $*" >&2; exit 1; }

# check NAME EXPECTED_RC PATTERN -- CMD...: run CMD (away from the checkout, as a new user), keep
# its output, and pass when the exit code is EXPECTED_RC and the output has PATTERN (grep -E).
check() {
    local name="$1" want="$2" pattern="$3"; shift 4
    local log="$WORK/logs/$name.log" rc
    (cd "$AWAY" && env -i PATH="$VENV/bin:/usr/bin:/bin" HOME="$HOME_EMPTY" LANG=C.UTF-8 \
        COLUMNS=200 "$@") >"$log" 2>&1
    rc=$?
    if [[ "$rc" == "$want" ]] && grep -Eq -- "$pattern" "$log"; then
        echo "ok      $name (exit $rc)"
    else
        echo "FAILED  $name: exit $rc (want $want), output must match /$pattern/:"
        sed 's/^/        | /' "$log" | tail -25
        FAILED+=("$name")
    fi
}

say "build the wheel from the checkout's source files"
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/logs" "$WORK/away" "$WORK/home"
(cd "$REPO" && git ls-files -co --exclude-standard -z | grep -zv '^results/' \
    | xargs -0 tar cf - 2>/dev/null) | tar xf - -C "$WORK/src" || die "copying the sources failed"
"$PY" -m venv "$WORK/venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
VENV="$WORK/venv"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src" >"$WORK/logs/build.log" 2>&1 \
    || { cat "$WORK/logs/build.log"; die "building the wheel failed"; }
WHEEL="$(ls "$WORK"/dist/m3patch-*.whl)"
echo "built $(basename "$WHEEL")"

say "install it into a fresh venv"
"$VENV/bin/python" -m pip install -q "$WHEEL" >"$WORK/logs/install.log" 2>&1 \
    || { cat "$WORK/logs/install.log"; die "installing the wheel failed"; }
SITE="$(cd "$WORK/away" && "$VENV/bin/python" -c 'import m3patch, pathlib; print(pathlib.Path(m3patch.__file__).parent)')"
[[ "$SITE" == "$VENV"/* ]] || die "m3patch imports from $SITE, not from the fresh venv"
echo "m3patch installed at $SITE"

say "a copy of the real vLLM 0.33.0 tree"
PRISTINE="$(cd "$WORK/away" && "$VENV/bin/python" -c 'from m3patch.patching.pristine import pristine_tree; print(pristine_tree("0.33.0"))')" \
    || die "could not get the pristine vLLM 0.33.0 tree"
TREE="$WORK/site-packages"
cp -a "$PRISTINE" "$TREE"
echo "$PRISTINE -> $TREE"

AWAY="$WORK/away"
HOME_EMPTY="$WORK/home"
BUNDLE="$SITE/_shipped"
say "the installed tool, from $AWAY (HOME=$HOME_EMPTY)"
check version 0 '^m3patch [0-9]' -- m3patch --version
check locate 0 'version +0\.33\.0' -- m3patch locate --vllm-root "$TREE"
check series-list 0 "vllm-0\.33\.0 .*<- fits the located vLLM" -- m3patch series list --vllm-root "$TREE"
check apply-verify 0 'applied' -- m3patch apply --verify --vllm-root "$TREE"
check status 0 'applied' -- m3patch status --vllm-root "$TREE"
check apply-again 0 'already applied' -- m3patch apply --verify --vllm-root "$TREE"
check revert 0 'revert' -- m3patch revert --vllm-root "$TREE"
# vllm/.m3patch/ holds the tree lock (an empty file, kept by design); nothing else may remain.
if diff -r -x .m3patch "$PRISTINE" "$TREE" >"$WORK/logs/diff.log" 2>&1 \
    && [[ "$(ls -A "$TREE/vllm/.m3patch" 2>/dev/null)" == "lock" ]]; then
    echo "ok      reverted tree is byte-identical to the pristine one (vllm/.m3patch holds only the lock)"
else
    echo "FAILED  reverted tree differs from the pristine one:"; head -20 "$WORK/logs/diff.log"
    FAILED+=("revert-identical")
fi
check recipe-show 0 "# series $BUNDLE/patches/vllm-0\.33\.0 " -- m3patch recipe show mi300x_tp8
check serve-dry-run 0 "# series $BUNDLE/patches/vllm-0\.32\.0 .*" -- m3patch serve cpu_tiny_moe --dry-run
check unknown-recipe 2 "Perhaps you meant 'mi300x_tp8'" -- m3patch recipe show mi300x_tp9

say "changelog check on a scratch git repository"
SCRATCH="$WORK/scratch"
mkdir -p "$SCRATCH/recipes"
export GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 GIT_AUTHOR_NAME=ci GIT_COMMITTER_NAME=ci \
    GIT_AUTHOR_EMAIL=ci@example.invalid GIT_COMMITTER_EMAIL=ci@example.invalid
entry() { printf -- '- config-keys:\n    - cpu_tiny_moe\n  description:\n    - "%s"\n  pr-link: %s\n' "$1" "$2"; }
(
    cd "$SCRATCH" && git init -q -b main && echo "name: cpu_tiny_moe" >recipes/cpu_tiny_moe.yaml \
    && entry "baseline" "https://github.com/acme/proj/pull/1" >perf-changelog.yaml \
    && git add -A && git commit -qm base \
    && { echo; entry "a faster MoE" "https://github.com/acme/proj/pull/2"; } >>perf-changelog.yaml
) || die "could not make the scratch repository"
check changelog-check 0 '' -- m3patch changelog check --file "$SCRATCH/perf-changelog.yaml" \
    --base HEAD --pr 2 --repo acme/proj
sed -i 's/baseline/rewritten history/' "$SCRATCH/perf-changelog.yaml"
check changelog-rejects-edit 16 'baseline|rewritten|changed|edit|modif' -- m3patch changelog check \
    --file "$SCRATCH/perf-changelog.yaml" --base HEAD --pr 2 --repo acme/proj

if [[ -n "$(ls -A "$AWAY")" ]]; then
    echo "FAILED  the commands wrote into the working folder: $(ls -A "$AWAY")"; FAILED+=("cwd-untouched")
else
    echo "ok      nothing written into the working folder"
fi

echo
echo "check_installed: $(( $(date +%s) - start )) s"
if (( ${#FAILED[@]} )); then
    echo "check_installed: FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "check_installed: all checks passed"
