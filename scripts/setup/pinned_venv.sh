# Sourced by the setup scripts of the client tools that live in their own venv (AIPerf, vllm-router):
#   pinned_venv NAME VENV PACKAGE VERSION BINARY CHECK_ARG WHEN
# creates VENV (with $PYTHON, default python3) unless it has a python, then installs PACKAGE==VERSION
# unless exactly that version and BINARY are already there, and runs `BINARY CHECK_ARG` as proof.
# Idempotent: a venv with the pinned version is left as it is. WHEN says how long the install takes.
pinned_venv() {
    local name="$1" venv="$2" package="$3" version="$4" binary="$5" check="$6" when="$7" installed
    log() { printf '%s: %s\n' "$name" "$*" >&2; }
    if [[ ! -x "$venv/bin/python" ]]; then
        log "creating venv at $venv"
        mkdir -p "$(dirname "$venv")"
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    installed="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$package'))" 2>/dev/null || true)"
    if [[ "$installed" == "$version" && -x "$venv/bin/$binary" ]]; then
        log "$package $installed already in $venv"
        return 0
    fi
    log "installing $package==$version into $venv ($when)"
    if ! "$venv/bin/pip" install -q "$package==$version" >"$venv/pip-install.log" 2>&1; then
        cat "$venv/pip-install.log" >&2
        log "installing $package failed"
        return 1
    fi
    "$venv/bin/$binary" "$check" >/dev/null || { log "$binary does not run"; return 1; }
    log "$package $version ready: $venv/bin/$binary"
}
