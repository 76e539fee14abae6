"""Generate the gRPC Python modules in ``actuator/v1`` from ``actuator/proto`` (a development step).

The generated ``actuator_pb2*.py`` files are committed, as opentelemetry-proto
does, so nothing is generated at import or install time and grpcio-tools is
not a run-time dependency. After editing the .proto, regenerate them::

    .venv/bin/python -m tokenprobe.actuator._generate          # rewrite actuator/v1
    .venv/bin/python -m tokenprobe.actuator._generate --check  # exit 1 if they are stale

The test suite runs the check, so a .proto edit without regenerating fails CI.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent / "proto"
# Relative to PROTO_ROOT; protoc mirrors this path in its output folder.
PROTO_FILES = ("tokenprobe/actuator/v1/actuator.proto",)
GENERATED_PACKAGE = "tokenprobe/actuator/v1"
OUTPUT_DIRECTORY = Path(__file__).resolve().parent / "v1"
# protoc writes absolute imports between generated modules; relative ones keep
# the package importable (and its imports readable) from the file tree alone.
_ABSOLUTE_SIBLING_IMPORT = re.compile(r"^from tokenprobe\.actuator\.v1 import ", re.MULTILINE)


class GenerationError(RuntimeError):
    """protoc could not turn the .proto files into Python modules."""


def generated_modules() -> dict[str, bytes]:
    """File name -> content of every module protoc makes from PROTO_FILES."""
    from grpc_tools import protoc  # a development dependency (the `test` extra)

    well_known_protos = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="tokenprobe-protoc-") as scratch:
        status = protoc.main([
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={well_known_protos}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *PROTO_FILES,
        ])
        if status != 0:
            raise GenerationError(f"protoc exited with status {status} compiling {', '.join(PROTO_FILES)} "
                                  f"under {PROTO_ROOT} (its message is on stderr above)")
        return {produced.name: _ABSOLUTE_SIBLING_IMPORT.sub("from . import ", produced.read_text()).encode()
                for produced in sorted((Path(scratch) / GENERATED_PACKAGE).iterdir())}


def stale_files(directory: Path = OUTPUT_DIRECTORY) -> list[str]:
    """The generated files that are missing from ``directory`` or differ from what protoc makes now."""
    return [name for name, content in generated_modules().items()
            if not (directory / name).is_file() or (directory / name).read_bytes() != content]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenprobe.actuator._generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that actuator/v1 is current")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"{OUTPUT_DIRECTORY / name} is stale: run python -m tokenprobe.actuator._generate", file=sys.stderr)
        return 1 if stale else 0
    for name, content in generated_modules().items():
        (OUTPUT_DIRECTORY / name).write_bytes(content)
    print(f"generated {', '.join(PROTO_FILES)} into {OUTPUT_DIRECTORY}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
