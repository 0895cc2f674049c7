"""Weight encoding: policy versions as signed manifests plus verified chunks (pure ML, no networking).

Owned here: the package's public API. `manifest` (schema, chunk verification; no torch) is imported
eagerly; the torch codec (`codec`, `quant`) only on first use of one of its names, so that networking
code can import the manifest without torch. Must not import hivemind.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from echo_p2p.weights.manifest import (
    BaseVersionError,
    ChunkDigestError,
    ChunkError,
    ChunkIndexError,
    ChunkInfo,
    ChunkSizeError,
    ChunkStore,
    Encoding,
    IncompleteVersionError,
    Manifest,
    NonFiniteError,
    ParamInfo,
    ParamMismatchError,
    WeightsError,
)

if TYPE_CHECKING:
    from echo_p2p.weights.codec import (
        EncodedVersion,
        EncodingConfig,
        PolicyWeights,
        VersionAssembler,
        WeightEncoder,
        load_into_model,
        merge_changes,
        named_tensors,
    )

_LAZY = {
    "EncodedVersion",
    "EncodingConfig",
    "PolicyWeights",
    "VersionAssembler",
    "WeightEncoder",
    "load_into_model",
    "merge_changes",
    "named_tensors",
}

__all__ = [
    "BaseVersionError",
    "ChunkDigestError",
    "ChunkError",
    "ChunkIndexError",
    "ChunkInfo",
    "ChunkSizeError",
    "ChunkStore",
    "EncodedVersion",
    "Encoding",
    "EncodingConfig",
    "IncompleteVersionError",
    "Manifest",
    "NonFiniteError",
    "ParamInfo",
    "ParamMismatchError",
    "PolicyWeights",
    "VersionAssembler",
    "WeightEncoder",
    "WeightsError",
    "load_into_model",
    "merge_changes",
    "named_tensors",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("echo_p2p.weights.codec"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
