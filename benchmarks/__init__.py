"""Benchmarks: scripts that print figures measured side by side in one run."""
