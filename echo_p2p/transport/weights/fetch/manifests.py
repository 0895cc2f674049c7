"""Which manifests a fetch may use: each one checked against the run's trusted trainers and the policy record.

Owned here: ``ManifestCheck`` (checks the bytes of a manifest against a trusted trainer's signature, the run
and the ``ManifestRef`` of the policy record that named it, counts each refusal by reason in the fetch stats
and remembers the refused digests, which are never fetched again) and ``get_manifests`` (asks the publisher,
then the providers that list them, for the manifests a chain needs, through the endpoint it is given).
Trust decisions themselves are ``trust.check_manifest``; decoding is ``echo_p2p.weights``.
"""

from __future__ import annotations

import asyncio
import logging

from echo_p2p.guard.trust import TrustedTrainers, check_manifest
from echo_p2p.net.records import ManifestRef, PolicyRecord
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.fetch.config import FetchStats
from echo_p2p.transport.weights.fetch.providers import ProviderBook
from echo_p2p.transport.weights.service import manifest_digest
from echo_p2p.weights.manifest import Manifest

logger = logging.getLogger(__name__)

#: Refused digests remembered at most (forgotten all at once beyond: a refused manifest is then checked again).
MAX_REFUSED = 1024


class ManifestCheck:
    """Checks manifests for one fetcher and remembers the refused ones (bounded, ``MAX_REFUSED``)."""

    def __init__(self, trusted: TrustedTrainers, run_id: str, stats: FetchStats):
        self.trusted = trusted
        self.run_id = run_id
        self.stats = stats
        self.refused: dict[str, str] = {}  # manifest digest -> reason (never fetched again)

    def check(self, raw: bytes, ref: ManifestRef, record: PolicyRecord, who: str) -> Manifest | None:
        """The manifest in ``raw`` if a trusted trainer signed it for this run and it is the one ``ref`` of
        ``record`` names; else None, the refusal counted and remembered."""
        digest = manifest_digest(raw)
        try:
            manifest = Manifest.from_bytes(raw)
        except ValueError:
            self._refuse(digest, "malformed_manifest", who)
            return None
        reason = check_manifest(manifest, self.trusted, self.run_id)
        if reason is None and (
            manifest.publisher != record.peer_id
            or manifest.stream_id != record.stream_id
            or manifest.version != ref.version
            or manifest.base_version != ref.base_version
            or manifest.num_chunks != ref.num_chunks
            or manifest.total_bytes != ref.total_bytes
        ):
            reason = "manifest_record_mismatch"
        if reason is not None:
            self._refuse(digest, reason, who)
            return None
        return manifest

    def _refuse(self, digest: str, reason: str, who: str) -> None:
        self.stats.rejected[reason] += 1
        if len(self.refused) > MAX_REFUSED:
            self.refused.clear()
        self.refused[digest] = reason
        logger.warning("refused manifest %s… from %s: %s", digest[:12], who[-8:], reason)


async def get_manifests(
    record: PolicyRecord,
    refs: list[ManifestRef],
    *,
    check: ManifestCheck,
    endpoint,
    directory,
    book: ProviderBook,
    request_timeout: float,
) -> list[Manifest | None]:
    """The planned manifests, checked; asked of the publisher, then of providers that list them. Each
    request has ``request_timeout``; a provider that fails or answers with other manifests is passed over."""
    stats = check.stats
    found: dict[str, Manifest] = {}
    wanted = {r.digest: r for r in refs}
    candidates = [(record.peer_id, record.maddrs)]
    read_providers = False
    position = 0
    while True:
        need = [d for d in wanted if d not in found and d not in check.refused]
        if not need:
            break
        if position == len(candidates):
            if read_providers:
                break
            read_providers = True  # the publisher did not give them all: ask providers that list them
            providers = await asyncio.get_running_loop().run_in_executor(
                None, directory.providers, record.version
            )
            candidates += [
                (e.record.peer_id, e.record.maddrs)
                for e in providers
                if e.record.peer_id != endpoint.peer_id and set(e.record.manifests) & set(need)
            ]
            continue
        peer_id, maddrs = candidates[position]
        position += 1
        if book.banned(peer_id):
            continue
        try:
            await endpoint.connect(peer_id, maddrs, request_timeout)
            response = await endpoint.get_manifests(
                peer_id,
                weights_pb2.ManifestsRequest(digests=[bytes.fromhex(d) for d in need]),
                request_timeout,
            )
        except Exception as exc:  # a dead or misbehaving peer: try the next one
            stats.failures["manifest_request"] += 1
            logger.warning("manifest request to %s failed: %r", peer_id[-8:], exc)
            continue
        for raw in response.manifests[: len(need)]:
            digest = manifest_digest(raw)
            if digest not in wanted:  # not what was asked for: that provider's fault
                stats.rejected["unexpected_manifest"] += 1
            elif digest not in found:
                manifest = check.check(raw, wanted[digest], record, peer_id)
                if manifest is not None:
                    found[digest] = manifest
    return [found.get(r.digest) for r in refs]
