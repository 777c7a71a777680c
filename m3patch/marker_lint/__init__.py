"""Marker lint: prove every required and forbidden marker can be printed by a vLLM tree plus
its series (`sources` reads the tree's texts, `printable` matches, `lint` judges, `cache`
keeps one tree's texts between runs)."""
