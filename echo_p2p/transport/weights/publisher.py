"""Trainer side of the weights transport: encode, sign, serve and announce each policy version.

Owned here: ``PublisherConfig`` and ``WeightPublisher``, which turns the trainer's tensors into signed
manifests + chunks with ``echo_p2p.weights.WeightEncoder``, keeps the chunk stores of its current chain
(the newest keyframe and every manifest of a version at or after it; older ones are dropped), serves them
through the process's ``WeightsEndpoint`` and announces a ``PolicyRecord`` on the DHT (re-announced on a
heartbeat before it expires). ``publish_in_background`` snapshots the tensors and encodes in a worker
thread so that the training loop does not wait for the encoder. Callers: the trainer peer, benchmarks,
tests. Must not touch model modules (it takes ``(name, tensor)`` pairs) nor decide trust.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.logs import VERSION_LINE_PERIOD, RateLimitedLog
from echo_p2p.net.directory import SwarmDirectory
from echo_p2p.net.identity import Identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.reachability import Reachability
from echo_p2p.net.records import MAX_RECORD_TTL, ManifestRef, PolicyRecord
from echo_p2p.transport.weights.service import ServedVersion, ServiceLimits, WeightsEndpoint
from echo_p2p.weights.codec import WeightEncoder
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.manifest import Manifest

logger = logging.getLogger(__name__)


class PublisherConfig(BaseModel):
    """How a trainer publishes policy versions."""

    model_config = ConfigDict(extra="forbid")

    encoding: EncodingConfig = Field(default_factory=EncodingConfig, description="Weight encoding")
    record_ttl: float = Field(
        default=60.0, gt=0, le=MAX_RECORD_TTL, description="Lifetime (s) of the PolicyRecord on the DHT"
    )
    heartbeat_period: float = Field(
        default=20.0, gt=0, description="Seconds between re-announcements of the PolicyRecord"
    )
    request_timeout: float = Field(default=10.0, gt=0, description="Deadline (s) of one DHT write")
    limits: ServiceLimits = Field(default_factory=ServiceLimits, description="Serving limits")


class WeightPublisher:
    """Publishes one trainer's policy versions; ``start`` before ``publish``, ``shutdown`` at the end."""

    def __init__(
        self,
        dht,
        identity: Identity,
        keys: SwarmKeys,
        config: PublisherConfig | None = None,
        endpoint: WeightsEndpoint | None = None,
        reach: Reachability | None = None,
    ):
        self.dht = dht
        self.identity = identity
        self.keys = keys
        self.config = config or PublisherConfig()
        self._own_endpoint = endpoint is None
        self.endpoint = endpoint or WeightsEndpoint(dht, keys, self.config.limits)
        self.directory = SwarmDirectory(dht, keys, identity, self.config.request_timeout)
        self.encoder = WeightEncoder(
            self.config.encoding,
            run_id=keys.run_id,
            publisher=identity.peer_id,
            publisher_key=identity.public_key_bytes(),
        )
        self.record: PolicyRecord | None = None
        self.published_versions = 0
        self._published_log = RateLimitedLog(
            logger, VERSION_LINE_PERIOD, "{n} versions published in {seconds:.0f} s"
        )
        self.last_encode_seconds: float | None = None
        self.announce_failures = 0
        self._chain: list[ServedVersion] = []
        self._lock = threading.Lock()
        self._announce_lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.reach = reach  # this node's announced addresses (set in start() when None)

    @property
    def library(self):
        return self.endpoint.library

    @property
    def servicer(self):
        return self.endpoint.servicer

    @property
    def stream_id(self) -> str:
        """The encoder stream the next version goes out on (``RolloutGroup.weights_stream`` of its samples)."""
        return self.encoder.stream_id

    def start(self) -> WeightPublisher:
        self.endpoint.start()
        if self.reach is None:
            self.reach = Reachability(self.dht)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="policy-announcer", daemon=True)
        self._heartbeat.start()
        return self

    # ---- publishing -----------------------------------------------------------------------------------
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> list[Manifest]:
        """Encode, sign, serve and announce ``version``; returns its signed manifests (delta, keyframe).

        The tensors must not change during the call (``publish_in_background`` snapshots them first).
        Raises what ``WeightEncoder.encode`` raises (non-finite weights, changed shapes, old version).
        """
        with self._lock:
            t0 = time.perf_counter()
            encoded = self.encoder.encode(named_tensors, version)
            self.last_encode_seconds = time.perf_counter() - t0
            entries = []
            for item in encoded:
                manifest = self._sign(item.manifest)
                entries.append(ServedVersion.of(manifest, item.store))
            self._update_chain(entries)
            self.published_versions += 1
            record = self._make_record()
            self.record = record
        self._announce_current()
        self._published_log.info(
            "published",
            "published version %d (%s) in %.2f s: %s",
            version,
            ", ".join(f"{e.manifest.encoding} {e.manifest.total_bytes / 2**20:.1f} MiB" for e in entries),
            self.last_encode_seconds,
            f"chain of {len(self._chain)} manifests from keyframe {record.keyframe_version}",
        )
        return [e.manifest for e in entries]

    def publish_in_background(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> concurrent.futures.Future[list[Manifest]]:
        """Snapshot the tensors now (one copy), then encode and publish in a worker thread, in call order."""
        snapshot = [(name, t.detach().to("cpu", copy=True)) for name, t in named_tensors]
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="publisher")
        return self._worker.submit(self.publish, snapshot, version)

    def _sign(self, manifest: Manifest) -> Manifest:
        return manifest.sign(self.identity.private_key.sign)

    def _update_chain(self, new: list[ServedVersion]) -> None:
        """Keep the newest keyframe and every manifest of a version >= its version; serve exactly those."""
        chain = self._chain + new
        keyframes = [e.manifest.version for e in chain if e.manifest.is_keyframe]
        start = max(keyframes) if keyframes else 0
        self._chain = [e for e in chain if e.manifest.version >= start]
        for entry in new:
            self.library.add(entry)
        self.library.retain(e.digest for e in self._chain)

    def _make_record(self) -> PolicyRecord:
        refs = [
            ManifestRef(
                version=e.manifest.version,
                base_version=e.manifest.base_version,
                digest=e.digest,
                encoding=e.manifest.encoding,
                total_bytes=e.manifest.total_bytes,
                num_chunks=e.manifest.num_chunks,
            )
            for e in self._chain
        ][-64:]
        keyframes = [e.manifest.version for e in self._chain if e.manifest.is_keyframe]
        return PolicyRecord(
            peer_id=self.identity.peer_id,
            stream_id=self.encoder.stream_id,
            version=max(e.manifest.version for e in self._chain),
            keyframe_version=max(keyframes) if keyframes else None,
            manifests=refs,
            maddrs=self.reach.current()[0] if self.reach is not None else [],
            updated_at=time.time(),
        )

    def _announce_current(self) -> bool:
        """Store the newest record; serialized, so an older record never lands after a newer one."""
        with self._announce_lock:
            record = self.record
            if record is None:
                return False
            record = record.model_copy(update={"updated_at": time.time()})
            ok = self.directory.announce_policy(record, self.config.record_ttl)
        if not ok:
            self.announce_failures += 1
            logger.warning("policy record of version %d was not stored by any DHT node", record.version)
        return ok

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_period):
            try:
                self._announce_current()
            except Exception:
                logger.exception("re-announcing the policy record failed; will retry")

    # ---- figures and life cycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Figures for the metrics line: versions, encode time, bytes served, chain size."""
        record = self.record
        return {
            "published_version": record.version if record else None,
            "published_versions": self.published_versions,
            "encode_seconds": self.last_encode_seconds,
            "chain_manifests": len(self._chain),
            "chain_bytes": sum(e.manifest.total_bytes for e in self._chain),
            "announce_failures": self.announce_failures,
            **self.servicer.stats.as_dict(),
        }

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop announcing and serving (idempotent). A publish still running in the worker is awaited."""
        self._stop.set()
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
            self._worker = None
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.config.request_timeout + 1)
            self._heartbeat = None
        if self._own_endpoint:
            self.endpoint.shutdown(timeout)
