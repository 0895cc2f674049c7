"""Weight encoding: policy versions as signed manifests plus verified chunks (pure ML, no networking).

Owned here: the package's public API. `manifest` (schema, chunk verification; no torch) is imported
eagerly; the torch codec (`codec`, `model_io`, `quant`) only on first use of one of its names, so that networking
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
        VersionAssembler,
        WeightEncoder,
        merge_changes,
    )
    from echo_p2p.weights.model_io import PolicyWeights, load_into_model, named_tensors

_LAZY = {  # name -> the torch module that defines it, imported on first use
    "EncodedVersion": "codec",
    "EncodingConfig": "codec",
    "VersionAssembler": "codec",
    "WeightEncoder": "codec",
    "merge_changes": "codec",
    "PolicyWeights": "model_io",
    "load_into_model": "model_io",
    "named_tensors": "model_io",
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
        return getattr(importlib.import_module(f"echo_p2p.weights.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
