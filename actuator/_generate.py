"""Generate the gRPC Python modules from actuator/proto with grpc_tools.protoc.

The generated ``*_pb2.py`` files are not kept in the repository: the .proto is
the source of truth. ``tokenprobe.actuator.v1`` calls ``ensure_generated`` when
it is first imported, so an editable install, a normal ``pip install .`` and a
plain checkout all get modules that match the .proto and the installed
protobuf/grpcio-tools versions. A stamp file holds a digest of those inputs;
the modules are regenerated only when it changes.

Run ``python -m tokenprobe.actuator._generate`` to generate them ahead of time
(e.g. in a container build, where the package directory becomes read-only).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent / "proto"
# Paths relative to PROTO_ROOT; they are also the import paths protoc writes
# into the generated code (tokenprobe/actuator/v1/... -> tokenprobe.actuator.v1).
PROTO_FILES = ("tokenprobe/actuator/v1/actuator.proto",)
GENERATED_PACKAGE = "tokenprobe/actuator/v1"
STAMP_NAME = ".generated-from"


class GenerationError(RuntimeError):
    """protoc could not turn the .proto files into Python modules."""


def inputs_digest() -> str:
    """Digest of everything the generated code depends on."""
    digest = hashlib.sha256()
    for relative in PROTO_FILES:
        digest.update(relative.encode())
        digest.update((PROTO_ROOT / relative).read_bytes())
    for distribution in ("grpcio-tools", "protobuf"):
        digest.update(f"{distribution}=={metadata.version(distribution)}".encode())
    return digest.hexdigest()


def is_current(directory: Path, digest: str) -> bool:
    stamp = directory / STAMP_NAME
    return stamp.is_file() and stamp.read_text().strip() == digest


def generate(directory: Path, digest: str) -> None:
    """Run protoc and move its output into `directory`, then write the stamp.

    Each file is written to a temporary name and renamed into place, so a
    process importing concurrently never reads a half-written module.
    """
    from grpc_tools import protoc  # imported here: only generation needs it

    well_known_protos = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="tokenprobe-protoc-") as scratch:
        arguments = [
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={well_known_protos}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *PROTO_FILES,
        ]
        status = protoc.main(arguments)
        if status != 0:
            raise GenerationError(
                f"protoc exited with status {status} compiling {', '.join(PROTO_FILES)} "
                f"under {PROTO_ROOT} (its message is on stderr above)"
            )
        directory.mkdir(parents=True, exist_ok=True)
        for produced in sorted((Path(scratch) / GENERATED_PACKAGE).iterdir()):
            _replace_atomically(directory / produced.name, produced.read_bytes())
    _replace_atomically(directory / STAMP_NAME, f"{digest}\n".encode())


def _replace_atomically(path: Path, content: bytes) -> None:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(descriptor, 0o644)  # mkstemp makes 0600; other users import these too
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(content)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _cache_directory(digest: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenprobe" / "actuator-v1" / digest[:16]


def ensure_generated(package_path: list[str]) -> list[str]:
    """Make the generated modules importable from the package whose __path__ is given.

    They are written next to the package's __init__.py when that directory is
    writable; otherwise (a read-only install) into a per-user cache directory
    that is appended to the returned __path__.
    """
    digest = inputs_digest()
    package_directory = Path(package_path[0])
    if is_current(package_directory, digest):
        return package_path
    if os.access(package_directory, os.W_OK):
        generate(package_directory, digest)
        return package_path
    cache = _cache_directory(digest)
    if not is_current(cache, digest):
        generate(cache, digest)
    return [*package_path, str(cache)]


if __name__ == "__main__":
    target = Path(__file__).resolve().parent / "v1"
    generate(target, inputs_digest())
    print(f"generated {', '.join(PROTO_FILES)} into {target}", file=sys.stderr)
