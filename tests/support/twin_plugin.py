"""pytest plugin (`-p tests.support.twin_plugin`): every HttpConnectionAssembler the
tests make, including the tracker's, is a TwinAssembler. tests/test_fast_path.py
runs the assembler and dialect test modules under it."""

from __future__ import annotations

from tokenprobe.agent.capture.wire import assembler

from .steady_kernel import KernelBatching
from .twin_assembler import TwinAssembler

# Loaded before the test modules are collected: their imports see the twin.
assembler.HttpConnectionAssembler = TwinAssembler


def pytest_terminal_summary(terminalreporter) -> None:
    # Proof for the caller that the tests ran on twins.
    terminalreporter.write_line(f"twin assemblers compared: {TwinAssembler.made}; "
                                f"writes batched: {KernelBatching.batched}")
