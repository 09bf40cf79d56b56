"""Spec-Bench-style benchmark: runner, questions, report and plots."""
