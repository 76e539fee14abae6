"""The committed gRPC modules are what protoc makes from the .proto today, and import from the tree."""

from __future__ import annotations

from tokenprobe.actuator import _generate


def test_committed_modules_match_the_proto():
    assert _generate.stale_files() == []


def test_a_changed_proto_makes_the_committed_modules_stale(tmp_path, monkeypatch):
    for name, content in _generate.generated_modules().items():
        (tmp_path / name).write_bytes(content)
    assert _generate.stale_files(tmp_path) == []
    (tmp_path / "actuator_pb2.py").write_text("stale = True\n")
    assert _generate.stale_files(tmp_path) == ["actuator_pb2.py"]


def test_generated_modules_import_each_other_relatively():
    grpc_module = _generate.generated_modules()["actuator_pb2_grpc.py"].decode()
    assert "class ActuatorStub" in grpc_module
    assert "from . import actuator_pb2 as" in grpc_module and "from tokenprobe." not in grpc_module
