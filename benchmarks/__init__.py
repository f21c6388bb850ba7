"""Benchmarks, profiles and tuning sweeps, each run from the repository root as
`python -m benchmarks.NAME` (README.md beside this file lists them)."""
