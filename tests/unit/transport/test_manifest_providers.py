"""When the publisher does not give a version's manifests, the fetcher asks the providers that list them, read
from the directory slot of that version (the sharded directory's ``providers(version)``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from echo_p2p.guard.trust import TrustedTrainers
from echo_p2p.net.records import ManifestRef, PolicyRecord, ProviderRecord
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.fetch.config import FetchStats
from echo_p2p.transport.weights.fetch.manifests import ManifestCheck, get_manifests
from echo_p2p.transport.weights.fetch.providers import ProviderBook

DIGEST = "ab" * 32


class Directory:
    def __init__(self):
        self.asked: list[int] = []

    def providers(self, version: int):
        self.asked.append(version)
        listing = ProviderRecord(peer_id="QmProvider", versions=[version], manifests=[DIGEST])
        other = ProviderRecord(peer_id="QmOther", versions=[version], manifests=["cd" * 32])
        return [SimpleNamespace(record=listing), SimpleNamespace(record=other)]


class Endpoint:
    peer_id = "QmMe"

    def __init__(self):
        self.requests: list[str] = []

    async def connect(self, peer_id, maddrs, timeout):
        pass

    async def get_manifests(self, peer_id, request, timeout):
        self.requests.append(peer_id)
        if peer_id == "QmPublisher":
            raise ConnectionError("the publisher is gone")
        return weights_pb2.ManifestsResponse()  # answers with nothing: the manifest stays missing


def test_the_providers_of_the_version_are_asked_when_the_publisher_fails():
    record = PolicyRecord(peer_id="QmPublisher", stream_id="s", version=7)
    ref = ManifestRef(version=7, digest=DIGEST, encoding="bf16", total_bytes=1024, num_chunks=1)
    directory, endpoint = Directory(), Endpoint()
    stats = FetchStats()
    found = asyncio.run(
        get_manifests(
            record,
            [ref],
            check=ManifestCheck(TrustedTrainers.from_keys([]), "r", stats),
            endpoint=endpoint,
            directory=directory,
            book=ProviderBook(60.0, 3, 600.0),
            request_timeout=1.0,
        )
    )
    assert found == [None]  # nobody gave it
    assert directory.asked == [7]  # the slot of the record's version
    assert endpoint.requests == [
        "QmPublisher",
        "QmProvider",
    ]  # the one that lists the manifest, not the other
    assert stats.failures["manifest_request"] == 1
