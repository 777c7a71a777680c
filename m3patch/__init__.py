"""m3patch: patch-and-launch toolkit for pinned vLLM images."""

__version__ = "0.1.0"
