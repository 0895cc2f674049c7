"""``EncodingConfig``: how a trainer encodes the policy versions it publishes.

Kept apart from the codec so that configs can be parsed and validated without importing torch
(the CLIs validate everything before anything heavy starts). Re-exported by ``echo_p2p.weights.codec``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from echo_p2p.weights.manifest import ALLOWED_BLOCKSIZES, DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, Encoding


class EncodingConfig(BaseModel):
    """How a trainer encodes the policy versions it publishes."""

    model_config = ConfigDict(extra="forbid")

    encoding: Encoding = Field(
        default="int8-delta",
        description="fp32 / bf16 / int8: one full snapshot per version; int8-delta: 8-bit deltas + keyframes",
    )
    chunk_size: int = Field(
        default=DEFAULT_CHUNK_SIZE,
        gt=0,
        le=MAX_CHUNK_SIZE,
        description="Chunk size in bytes (the last is shorter)",
    )
    keyframe_interval: int = Field(
        default=10,
        ge=1,
        description="int8-delta: also publish an exact fp32 snapshot when version crosses a multiple of this",
    )
    blocksize: int = Field(default=4096, description="Elements per absmax block of the 8-bit encodings")
    error_feedback: bool = Field(
        default=True,
        description="int8-delta: delta against the receivers' reconstruction (True) or the previous true "
        "weights (False, drifts; for comparison only)",
    )

    @field_validator("blocksize")
    @classmethod
    def _check_blocksize(cls, v: int) -> int:
        if v not in ALLOWED_BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {ALLOWED_BLOCKSIZES}")
        return v
