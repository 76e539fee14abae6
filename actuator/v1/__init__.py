"""tokenprobe.actuator.v1: the gRPC modules generated from actuator/proto.

``actuator_pb2`` (messages) and ``actuator_pb2_grpc`` (stubs and servicer
base) are committed; ``python -m tokenprobe.actuator._generate`` regenerates
them after a .proto edit (the tests check that they are current).
"""
