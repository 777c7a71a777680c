"""The run pipeline (recipe -> apply-verify -> serve -> sweep -> results) and its step results."""
