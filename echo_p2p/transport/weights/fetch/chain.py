"""Which manifests a receiver fetches to reach a policy version: ``plan_chain`` and ``PlanError``.

Deltas apply only on exactly the (stream, version) they were made from, so the chain is the deltas from the
version held when they lead to the target, else the newest keyframe at or below it and the deltas after it.
Pure function of a ``PolicyRecord``; used by ``fetcher``.
"""

from __future__ import annotations

from echo_p2p.net.records import ManifestRef, PolicyRecord


class PlanError(Exception):
    """No chain of manifests in the record leads to its newest version."""


def plan_chain(record: PolicyRecord, held: tuple[str, int] | None) -> list[ManifestRef]:
    """Manifests to fetch, in apply order, to go from ``held`` = (stream_id, version) to ``record.version``.

    Deltas apply only on exactly (stream_id, base_version): from a held version of the same stream the chain
    is its deltas; otherwise the newest keyframe at or below the target and the deltas after it. Empty when
    ``held`` is already at or past the target on that stream. Raises ``PlanError`` when no chain exists.
    """
    target = record.version
    if held is not None and held[0] == record.stream_id and held[1] >= target:
        return []
    deltas = {r.base_version: r for r in record.manifests if r.base_version is not None}

    def follow(version: int) -> list[ManifestRef] | None:
        chain: list[ManifestRef] = []
        while version != target:
            ref = deltas.get(version)
            if ref is None or ref.version <= version or ref.version > target:
                return None
            chain.append(ref)
            version = ref.version
        return chain

    if held is not None and held[0] == record.stream_id:
        chain = follow(held[1])
        if chain is not None:
            return chain
    keyframes = sorted(
        (r for r in record.manifests if r.base_version is None and r.version <= target),
        key=lambda r: -r.version,
    )
    for keyframe in keyframes:
        chain = follow(keyframe.version)
        if chain is not None:
            return [keyframe, *chain]
    raise PlanError(f"record of {record.peer_id[-8:]} lists no chain to version {target}")
