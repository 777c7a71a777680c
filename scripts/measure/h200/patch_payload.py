"""Read a file that a series patch ADDS straight out of the .patch text (stdlib only).

The GPU scripts run on a machine with torch and triton but no vLLM, no unidiff and no network:
they take the kernel module a patch adds from the patch itself, so what they measure is exactly
the text the series ships.
"""

from __future__ import annotations


def new_file_from_patch(patch_text: str, path: str) -> str:
    """Body of the new-file diff for `path` (`--- /dev/null` / `+++ b/<path>`)."""
    lines = patch_text.splitlines(keepends=True)
    try:
        start = lines.index(f"+++ b/{path}\n")
    except ValueError:
        raise SystemExit(f"{path} is not in the patch") from None
    if lines[start - 1].rstrip("\n") != "--- /dev/null":
        raise SystemExit(f"{path} is not a new file in the patch")
    body = []
    for line in lines[start + 1:]:
        if line.startswith("@@"):
            continue
        if not line.startswith("+"):
            break
        body.append(line[1:])
    return "".join(body)
