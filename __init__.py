"""tokenprobe: eBPF observability for LLM inference serving.

The repository's root is the package: its top-level rooms (cli/, dashboard/,
actuator/, analytics/, store/, agent/, bpf/, contract/, refserver/) are the
sub-packages ``tokenprobe.cli``, ``tokenprobe.store``, … and import each other
relatively (``from ..store import open_store``), so the tree alone shows who
imports whom.
"""

__version__ = "0.1.0"
