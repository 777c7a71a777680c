"""Build hook: the shipped series and recipes travel inside the package as `m3patch/_shipped/`.

The top-level `patches/` and `recipes/` folders stay the only source in the repository; a wheel
(build_py) and an sdist (its release tree) get fresh copies at build time, so an installed
m3patch finds them from any working directory (m3patch/shipped.py). Nothing generated is
committed. An editable install needs no copy: shipped.py reads the checkout's own folders.
Everything else about the project lives in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
SHIPPED_KINDS = ("patches", "recipes")
BUNDLE = Path("m3patch") / "_shipped"  # keep in step with m3patch/shipped.py: BUNDLED


def copy_shipped(dest: Path) -> None:
    """Replace dest/<kind> with a copy of the top-level <kind> folder, for each shipped kind."""
    for kind in SHIPPED_KINDS:
        source = HERE / kind
        if not source.is_dir():
            msg = f"setup.py: {source} is missing; the shipped {kind} are built from it"
            raise SystemExit(msg)
        target = dest / kind
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))


class BuildPyWithShipped(build_py):
    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            copy_shipped(Path(self.build_lib) / BUNDLE)


class SdistWithShipped(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        copy_shipped(Path(base_dir) / BUNDLE)


setup(cmdclass={"build_py": BuildPyWithShipped, "sdist": SdistWithShipped})
