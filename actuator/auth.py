"""Authentication for every actuator call: mutual TLS or a bearer token.

The server wraps every method it serves (the actuator API, Envoy's rate limit
service, health and reflection) so a call that presents neither an allowed
client certificate nor a known bearer token ends with UNAUTHENTICATED before
any handler runs. Tokens go in the ``authorization: Bearer <token>`` metadata
(Envoy sets it with the gRPC service's ``initial_metadata``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

import grpc

MIN_TOKEN_LENGTH = 16


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate and, for mutual TLS, the CA its clients' certificates come from."""

    certificate_chain: bytes
    private_key: bytes
    # With a client CA, only clients holding a certificate it signed can
    # connect (mutual TLS); without one, TLS protects the bearer tokens.
    client_ca: bytes | None = None
    # Identities (the certificate's subject alternative names, else its common
    # name) allowed in on their certificate alone; empty allows every
    # certificate the client CA signed.
    allowed_identities: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ServerAuth:
    bearer_tokens: frozenset[str] = frozenset()
    tls: ServerTls | None = None

    def __post_init__(self) -> None:
        if not self.bearer_tokens and (self.tls is None or self.tls.client_ca is None):
            raise ValueError("the actuator needs bearer tokens or mutual TLS: it serves no unauthenticated calls")
        if any(len(token) < MIN_TOKEN_LENGTH for token in self.bearer_tokens):
            raise ValueError(f"bearer tokens must be at least {MIN_TOKEN_LENGTH} characters")

    @property
    def mutual_tls(self) -> bool:
        return self.tls is not None and self.tls.client_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the listening port, or None for plaintext (bearer tokens on loopback)."""
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls.private_key, self.tls.certificate_chain)],
            root_certificates=self.tls.client_ca,
            require_client_auth=self.mutual_tls,
        )

    def interceptor(self) -> grpc.ServerInterceptor:
        return _AuthInterceptor(self)

    def authenticate(self, context: grpc.ServicerContext) -> None:
        """Return if the caller is allowed; otherwise end the call with UNAUTHENTICATED."""
        if self.mutual_tls and self._certificate_allowed(context):
            return
        token = _bearer_token(context.invocation_metadata())
        # Compare against every token, in constant time, so timing reveals nothing.
        if token is not None and sum(hmac.compare_digest(token, known) for known in self.bearer_tokens):
            return
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "authenticate with an allowed client certificate or 'authorization: Bearer <token>'")

    def _certificate_allowed(self, context: grpc.ServicerContext) -> bool:
        identities = context.peer_identities()
        if not identities:
            return False
        allowed = self.tls.allowed_identities  # type: ignore[union-attr]
        if not allowed:
            return True
        return any(identity.decode("utf-8", "replace") in allowed for identity in identities)


def _bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


class _AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, auth: ServerAuth):
        self._auth = auth

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return None
        return _authenticated(handler, self._auth.authenticate)


def _authenticated(handler: grpc.RpcMethodHandler,
                   authenticate: Callable[[grpc.ServicerContext], None]) -> grpc.RpcMethodHandler:
    """The same handler, calling `authenticate` before the method's own code."""
    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        inner_unary = handler.unary_unary

        def unary_unary(request, context):
            authenticate(context)
            return inner_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **serializers)
    if handler.unary_stream:
        inner_unary_stream = handler.unary_stream

        def unary_stream(request, context):
            authenticate(context)
            yield from inner_unary_stream(request, context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, **serializers)
    if handler.stream_unary:
        inner_stream_unary = handler.stream_unary

        def stream_unary(requests, context):
            authenticate(context)
            return inner_stream_unary(requests, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **serializers)
    inner_stream_stream = handler.stream_stream

    def stream_stream(requests, context):
        authenticate(context)
        yield from inner_stream_stream(requests, context)
    return grpc.stream_stream_rpc_method_handler(stream_stream, **serializers)


@dataclass(frozen=True)
class ClientAuth:
    """How a client (controller, gateway, test) proves who it is."""

    bearer_token: str | None = None
    # TLS: the CA that signed the server's certificate; with a client
    # certificate and key, the connection is mutual TLS.
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    def channel(self, target: str, options: tuple = ()) -> grpc.Channel:
        if self.root_certificates is None:
            return grpc.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )
        return grpc.secure_channel(target, credentials, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Per-call metadata rather than call credentials: those demand TLS,
        # and a loopback deployment may run plaintext.
        if self.bearer_token is None:
            return ()
        return (("authorization", f"Bearer {self.bearer_token}"),)
