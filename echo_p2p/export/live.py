"""Export from a running swarm: the newest policy version of the run's trusted trainers, fetched through the
swarm exactly as an inference peer fetches it, written as a model directory.

Owned here: ``fetch_newest`` (join the run's DHT as a client, learn the run's trainers from the owner's
signed run record or a trusted-trainers file, fetch the newest version with ``WeightFetcher``: trusted,
signed manifests only, every chunk's digest checked, the chain of patches applied to its keyframe; leave)
and ``export_live`` (that version loaded into the run's model, written by ``model_dir``). The exporter
serves nothing and announces nothing (``serve=False``, a client-mode DHT node). Every wait ends by
``LiveExportConfig.timeout``: a run record that never comes, no trusted policy, a fetch that fails — each
raises ``ExportError`` saying what was found. The model is ``ExportConfig.model``, else the preset the run
record names. The default dtype is the one the version was published in (what inference peers hold).
Callers: ``export.__main__``, tests. Must not write to the DHT beyond what joining as a client does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from echo_p2p.export.config import ExportConfig, ExportError, ExportResult, LiveExportConfig
from echo_p2p.export.model_dir import prepare_out, write_model_dir
from echo_p2p.export.policy_files import skeleton_from_spec, spec_name

logger = logging.getLogger(__name__)

_TORCH_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclass
class FetchedPolicy:
    """A complete, verified policy version of a run and what is known about it."""

    version: int
    tensors: dict[str, Any]  # name -> tensor, in the stream's dtype (what inference peers hold)
    stream_id: str
    publisher: str | None  # peer id of the trainer whose record announced the stream
    run_record: Any  # net.run_record.RunRecord in force, or None (a trusted-trainers file)


def fetch_newest(target: Any, live: LiveExportConfig) -> FetchedPolicy:
    """Join ``target`` (a ``monitor.target.Target``: run id, network, ``RunTrust``), fetch the newest
    version its trusted trainers publish (at least ``live.min_version``), leave; ``ExportError`` past
    ``live.timeout``."""
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.node import NodeStartError, start_dht, stop_dht
    from echo_p2p.transport.weights.fetch.config import FetcherConfig
    from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher

    trust = target.trust
    if not trust.configured:
        raise ExportError("the run's trainers are unknown: pass --join or --trusted-trainers")
    deadline = time.monotonic() + live.timeout
    keys = SwarmKeys(target.run_id)
    identity = load_or_create_identity(target.network.identity_path)
    network = target.network.model_copy(
        update={"startup_timeout": min(target.network.startup_timeout, live.timeout)}
    )
    dht = fetcher = None
    try:
        try:
            dht = start_dht(network, identity, [keys], client_mode=True)
        except NodeStartError as exc:
            raise ExportError(str(exc)) from None
        directory = SwarmDirectory(dht, keys, identity, target.network.request_timeout)
        _learn_trainers(directory, trust, deadline, live.poll_period)
        fetcher = WeightFetcher(dht, identity, keys, trust, FetcherConfig(serve=False)).start()
        while True:
            # each fetch ends by the export's deadline (a session reads the fetcher's config when it starts)
            remaining = max(1.0, deadline - time.monotonic())
            fetcher.config = fetcher.config.model_copy(update={"fetch_timeout": remaining})
            fetcher.update()  # the newest trusted version, if newer than the one held
            weights = fetcher.weights
            if weights is not None and (live.min_version is None or weights.version >= live.min_version):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ExportError(_nothing_fetched(target, trust, fetcher, weights, live))
            time.sleep(min(live.poll_period, remaining))
            if trust.owner is not None:  # the owner may have signed a new record (other trainers)
                trust.update(e.record for e in directory.run_records())
                directory.follow_trust(trust)
        publisher = _publisher(directory, weights.stream_id)
        logger.info(
            "fetched version %d of run %s (stream %s)", weights.version, target.run_id, weights.stream_id
        )
        return FetchedPolicy(
            weights.version, dict(weights.tensors), weights.stream_id, publisher, trust.record
        )
    finally:
        if fetcher is not None:
            fetcher.shutdown()
        if dht is not None:
            stop_dht(dht)
        identity.cleanup()


def _publisher(directory, stream_id: str) -> str | None:
    """The peer id of the trainer that announces ``stream_id`` (for the export's record), if it still does."""
    try:
        return next((e.record.peer_id for e in directory.policies() if e.record.stream_id == stream_id), None)
    except Exception:  # provenance only: a failed DHT read does not fail the export
        return None


def _learn_trainers(directory, trust, deadline: float, period: float) -> None:
    """Wait (until ``deadline``) for the run owner's record when the run has an owner; tell the DHT node whom
    to take trainer records from, as an inference peer does."""
    if trust.owner is not None:
        while True:
            trust.update(e.record for e in directory.run_records())
            if trust.record is not None:
                break
            if time.monotonic() >= deadline:
                refused = ", ".join(f"{k} {v}" for k, v in sorted(trust.refused.items()))
                raise ExportError(
                    f"no valid run record of owner {trust.owner} found for run {trust.run_id}"
                    + (f" (refused: {refused})" if refused else "")
                    + ": check the join address"
                )
            time.sleep(min(period, max(0.0, deadline - time.monotonic())))
        logger.info("the run trusts %s", trust.describe())
    directory.follow_trust(trust)


def _nothing_fetched(target, trust, fetcher, weights, live: LiveExportConfig) -> str:
    stats = fetcher.stats
    failed = ", ".join(f"{k} {v}" for k, v in sorted(stats.fetches_failed.items()))
    refused = ", ".join(f"{k} {v}" for k, v in sorted(stats.rejected.items()))
    if weights is not None:
        what = f"the newest version fetched is {weights.version}, below --min-version {live.min_version}"
    else:
        try:
            published = fetcher.published_version()
        except Exception:  # a DHT read that failed: say what we know
            published = None
        what = (
            "no trusted trainer published a policy version"
            if published is None
            else f"trusted trainers publish version {published}, but it could not be fetched"
        )
    details = "; ".join(
        x for x in (failed and f"fetches failed: {failed}", refused and f"refused: {refused}") if x
    )
    return (
        f"no policy of run {target.run_id} within {live.timeout:.0f} s: {what} (trusting "
        f"{trust.describe()}){'; ' + details if details else ''}"
    )


def export_live(target: Any, config: ExportConfig, live: LiveExportConfig) -> ExportResult:
    """Fetch the newest trusted version of the run (``fetch_newest``) and write it as a model directory."""
    prepare_out(config.out, config.overwrite)  # fail before any work
    fetched = fetch_newest(target, live)
    spec = config.model or _spec_from_record(fetched.run_record)
    from echo_p2p.ml.models import ModelNotFoundError, load_weights_

    try:
        model, tokenizer = skeleton_from_spec(spec)
    except ModelNotFoundError as exc:
        raise ExportError(str(exc)) from None

    try:
        load_weights_(model, fetched.tensors, strict=True)
    except (KeyError, ValueError) as exc:
        raise ExportError(
            f"version {fetched.version} of run {target.run_id} does not fit model {spec_name(spec)}: {exc}"
        ) from None
    floats = {str(t.dtype) for t in fetched.tensors.values() if t.is_floating_point()}
    held = _TORCH_DTYPE_NAMES.get(floats.pop()) if len(floats) == 1 else None
    dtype = config.dtype or held or "float32"
    record = fetched.run_record
    sampling = None
    if record is not None and record.temperature is not None:
        sampling = {"temperature": record.temperature, "top_p": record.top_p, "top_k": record.top_k}
    info = {
        "source": "run",
        "run_id": target.run_id,
        "version": fetched.version,
        "stream_id": fetched.stream_id,
        "publisher": fetched.publisher,
        "published_dtype": held,
        "model": spec_name(spec),
    }
    out = write_model_dir(model, tokenizer, config.out, dtype, info, sampling, config.overwrite)
    logger.info("exported version %d of run %s to %s (%s)", fetched.version, target.run_id, out, dtype)
    source = f"run {target.run_id} (publisher {fetched.publisher or '?'})"
    return ExportResult(str(out), fetched.version, dtype, source)


def _spec_from_record(record) -> Any:
    from echo_p2p.ml.models import ModelSpec

    name = record.model if record is not None else None
    if name in ("tiny", "smollm2"):
        return ModelSpec(preset=name)
    said = f"the run record names model {name!r}" if name else "the run does not name its model"
    raise ExportError(f"{said}: pass it with --model tiny|smollm2, --model-path DIR or --gguf-file FILE")
