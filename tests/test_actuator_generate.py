"""The gRPC modules are generated from the .proto, regenerated when stale, and found in read-only installs."""

from __future__ import annotations

import subprocess

import pytest

from tokenprobe.actuator import _generate


def generated_files(directory) -> set[str]:
    return {path.name for path in directory.iterdir()}


def test_generates_modules_and_stamp_then_leaves_them_alone(tmp_path):
    assert _generate.ensure_generated([str(tmp_path)]) == [str(tmp_path)]
    assert generated_files(tmp_path) == {"actuator_pb2.py", "actuator_pb2.pyi", "actuator_pb2_grpc.py",
                                         _generate.STAMP_NAME}
    grpc_module = (tmp_path / "actuator_pb2_grpc.py").read_text()
    compile(grpc_module, "actuator_pb2_grpc.py", "exec")
    assert "class ActuatorStub" in grpc_module and "from tokenprobe.actuator.v1 import actuator_pb2" in grpc_module
    assert _generate.is_current(tmp_path, _generate.inputs_digest())
    written = (tmp_path / "actuator_pb2.py").stat().st_mtime_ns
    _generate.ensure_generated([str(tmp_path)])
    assert (tmp_path / "actuator_pb2.py").stat().st_mtime_ns == written


def test_stale_stamp_regenerates(tmp_path):
    _generate.ensure_generated([str(tmp_path)])
    (tmp_path / _generate.STAMP_NAME).write_text("from an older .proto\n")
    (tmp_path / "actuator_pb2.py").write_text("stale = True\n")
    _generate.ensure_generated([str(tmp_path)])
    assert "stale" not in (tmp_path / "actuator_pb2.py").read_text()
    assert _generate.is_current(tmp_path, _generate.inputs_digest())


def test_read_only_package_generates_into_the_user_cache(tmp_path, monkeypatch):
    package = tmp_path / "package"
    package.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # Immutable, so that even root cannot write (mode bits do not stop root).
    if subprocess.run(["chattr", "+i", str(package)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        path = _generate.ensure_generated([str(package)])
    finally:
        subprocess.run(["chattr", "-i", str(package)], check=True)
    assert path[0] == str(package) and len(path) == 2
    assert path[1].startswith(str(tmp_path / "cache" / "tokenprobe"))
    assert generated_files(package) == set()
    assert "actuator_pb2_grpc.py" in {p.name for p in (tmp_path / "cache").rglob("*.py")}
