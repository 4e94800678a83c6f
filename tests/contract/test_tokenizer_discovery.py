"""Tokenizer replicas found without a fixed list, as the compose stack scales them.

- SO_REUSEPORT (`reuse_port`, MESHSERVE_REUSE_PORT): replicas sharing one host's network
  listen on one port and the kernel spreads new connections over them; without it a
  second replica on a taken port fails to start.
- DNS round robin: the gateway names every replica with one DNS name
  (`dns:///tokenizer:50051` in compose). Here a real DNS server on loopback answers one
  name with two addresses, 127.0.0.1 and 127.0.0.2, each a real Tokenizer service; the
  gateway's own clients (MeshClients) reach both through that one name.
- Re-resolution: tokenizers that end client connections after `max_connection_age_s` make
  a gateway resolve the name again, so a replica added later gets calls.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from dnslib import QTYPE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from meshserve.proto.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from meshserve.services.gateway.links.clients import MeshClients
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.service import SERVICE_NAME, TokenizerServicer
from meshserve.shared.errors import UnavailableError
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.redis_server import find_free_port
from meshserve.shared.telemetry import Telemetry

NAME = "tokenizer.mesh.test"
REPLICA_IPS = ("127.0.0.1", "127.0.0.2")
TOKENIZE = "/meshserve.v1.Tokenizer/Tokenize"


class CallCounter(grpc.aio.ServerInterceptor):
    """Counts the calls one server receives, by method."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    async def intercept_service(self, continuation: Any,
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        self.calls[handler_call_details.method] += 1
        return await continuation(handler_call_details)


class Replicas:
    """Tokenizer servers started on given addresses, each counting its Tokenize calls."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self.servers: list[GrpcServer] = []
        self.counters: list[CallCounter] = []

    async def start(self, address: str, *, reuse_port: bool,
                    max_connection_age_s: float | None = None) -> GrpcServer:
        telemetry = Telemetry("tokenizer")
        counter = CallCounter()
        server = GrpcServer(address, service_names=[SERVICE_NAME], telemetry=telemetry,
                            grace_s=1, reuse_port=reuse_port, interceptors=[counter],
                            max_connection_age_s=max_connection_age_s)
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(
            TokenizerServicer(self.served, telemetry=telemetry), server.server)
        self.servers.append(server)
        await server.start()
        await server.set_serving()
        self.counters.append(counter)
        return server

    def tokenize_calls(self) -> list[int]:
        return [counter.calls[TOKENIZE] for counter in self.counters]

    async def stop(self) -> None:
        for server in self.servers:
            await server.server.stop(0)


@pytest.fixture
async def replicas(served: ServedModel) -> AsyncIterator[Replicas]:
    started = Replicas(served)
    yield started
    await started.stop()


class Zone(BaseResolver):  # type: ignore[misc]
    """Answers NAME with one A record per address in `addresses` (which a test may change);
    every other question with nothing."""

    def __init__(self) -> None:
        self.addresses = list(REPLICA_IPS)

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        question = request.q
        if str(question.qname).rstrip(".") == NAME and QTYPE[question.qtype] == "A":
            for ip in list(self.addresses):
                reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(ip), ttl=1))
        return reply


@pytest.fixture
def zone() -> Zone:
    return Zone()


@pytest.fixture
def dns_port(zone: Zone) -> Iterator[int]:
    """A DNS server on 127.0.0.1 (UDP) answering from `zone`; its port."""
    server = DNSServer(zone, port=0, address="127.0.0.1",
                       logger=DNSLogger(log="-request,-reply,-truncated,-error,-data",
                                        prefix=False))
    server.start_thread()
    yield server.server.server_address[1]
    server.stop()


class QuickResolve(GrpcClient):
    """The gateway's channel settings, resolving again at most every 0.1 s (gRPC's own
    floor is 30 s) so that the test need not wait that long."""

    def channel_options(self) -> list[tuple[str, Any]]:
        return [*super().channel_options(), ("grpc.dns_min_time_between_resolutions_ms", 100)]


async def test_replicas_share_a_port_only_with_reuse_port(replicas: Replicas) -> None:
    port = find_free_port()
    await replicas.start(f"127.0.0.1:{port}", reuse_port=True)
    await replicas.start(f"127.0.0.1:{port}", reuse_port=True)
    with pytest.raises(UnavailableError, match="cannot listen"):
        await replicas.start(f"127.0.0.1:{port}", reuse_port=False)


async def test_the_kernel_spreads_connections_over_replicas_on_one_port(
        replicas: Replicas) -> None:
    port = find_free_port()
    for _ in range(2):
        await replicas.start(f"127.0.0.1:{port}", reuse_port=True)
    # Each channel is its own connection (no shared subchannel pool), and the kernel
    # hashes each connection to one listener: with 24 connections, all 24 landing on one
    # replica has probability 2**-23.
    for _ in range(24):
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            reply = await tokenizer_pb2_grpc.TokenizerStub(ch).Tokenize(
                tokenizer_pb2.TokenizeRequest(text="hello"), timeout=10)
            assert list(reply.token_ids)
    calls = replicas.tokenize_calls()
    assert sum(calls) == 24
    assert all(n > 0 for n in calls), f"one replica got every connection: {calls}"


async def test_the_gateway_reaches_every_replica_through_one_dns_name(
        replicas: Replicas, dns_port: int) -> None:
    port = find_free_port()
    for ip in REPLICA_IPS:
        await replicas.start(f"{ip}:{port}", reuse_port=False)
    target = f"dns://127.0.0.1:{dns_port}/{NAME}:{port}"
    clients = MeshClients([target], "127.0.0.1:1")
    # Round robin balances over READY connections: wait until the channel is connected
    # to the name's addresses before counting.
    channel = clients._tokenizer_channels[0]
    await channel.channel_ready()
    for _ in range(20):
        reply = await clients.call_tokenizer(
            lambda stub: stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hello"), timeout=10))
        assert list(reply.token_ids)
    calls = replicas.tokenize_calls()
    assert sum(calls) == 20
    assert all(n > 0 for n in calls), f"a replica behind {NAME} got no call: {calls}"
    await clients.close()


async def test_a_replica_added_later_gets_calls_once_connections_age(
        replicas: Replicas, zone: Zone, dns_port: int) -> None:
    port = find_free_port()
    for ip in REPLICA_IPS:
        await replicas.start(f"{ip}:{port}", reuse_port=False, max_connection_age_s=0.3)
    zone.addresses = [REPLICA_IPS[0]]  # the second replica is not in DNS yet
    clients = MeshClients([f"dns://127.0.0.1:{dns_port}/{NAME}:{port}"], "127.0.0.1:1",
                          client=QuickResolve())

    async def tokenize() -> None:
        reply = await clients.call_tokenizer(
            lambda stub: stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hello"), timeout=10))
        assert list(reply.token_ids)

    for _ in range(5):
        await tokenize()
    assert replicas.tokenize_calls() == [5, 0]
    zone.addresses = list(REPLICA_IPS)  # `--scale tokenizer=2`: the name lists both
    # Each connection ends after 0.3 s and the next call resolves the name again; calls go
    # on until the new replica has had one, for at most 30 s (100 connection lifetimes).
    deadline = asyncio.get_running_loop().time() + 30
    while not replicas.tokenize_calls()[1] and asyncio.get_running_loop().time() < deadline:
        await tokenize()
    assert replicas.tokenize_calls()[1] > 0, "the added replica never got a call"
    await clients.close()
