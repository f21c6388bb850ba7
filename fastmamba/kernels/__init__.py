"""Triton kernels, each beside its launcher and its pure-PyTorch `_ref` twin.

The `_ref` twins are the CPU engine and the test oracle; they import without Triton.
"""
