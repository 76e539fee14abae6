"""tokenprobe.actuator.v1: the gRPC modules generated from actuator/proto.

``actuator_pb2`` (messages) and ``actuator_pb2_grpc`` (stubs and servicer
base) are produced by protoc the first time this package is imported, and
again whenever the .proto or the protobuf/grpcio-tools versions change.
"""

from tokenprobe.actuator._generate import ensure_generated

__path__ = ensure_generated(__path__)
