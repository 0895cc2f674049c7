"""``EncodingConfig``: how a trainer encodes the policy versions it publishes.

Kept apart from the codec so that configs can be parsed and validated without importing torch
(the CLIs validate everything before anything heavy starts). Re-exported by ``echo_p2p.weights.codec``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from echo_p2p.weights.manifest import ALLOWED_BLOCKSIZES, DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE

#: What a publisher's stream is made of (a manifest's own encoding is one of `manifest.Encoding`).
StreamEncoding = Literal["fp32", "bf16", "fp16", "int8", "int8-delta", "patch", "auto"]


class EncodingConfig(BaseModel):
    """How a trainer encodes the policy versions it publishes."""

    model_config = ConfigDict(extra="forbid")

    encoding: StreamEncoding = Field(
        default="auto",
        description="fp32 / bf16 / fp16 / int8: one full snapshot per version; int8-delta: 8-bit deltas with "
        "error feedback + fp32 keyframes; patch: receivers hold the weights cast to `serving_dtype` exactly, "
        "each version a lossless patch of the values whose bits changed (or a keyframe when smaller); auto: "
        "like patch, but a version may also be an int8 delta when that is smaller",
    )
    serving_dtype: Literal["bf16", "fp16"] = Field(
        default="bf16",
        description="patch / auto: the 16-bit dtype receivers hold (bf16: fp32's range, 8 significant bits; "
        "fp16: 11 significant bits, 8x closer to the trainer's fp32 policy, values beyond +-65504 refused)",
    )
    start_on_serving_grid: bool = Field(
        default=True,
        description="bf16 / fp16 / patch / auto: a fresh run first rounds the trainer's fp32 weights to the "
        "dtype receivers hold, so that version 0 is exact and no value starts on a rounding midpoint (a "
        "checkpoint stored at higher precision than the serving dtype can have many: the first update would "
        "then break all those ties in the direction of the update, a sign step of half a bf16 unit)",
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
        description="Delta streams: also publish a snapshot of the receivers' exact weights (fp32 for "
        "int8-delta, `serving_dtype` otherwise) when the version crosses a multiple of this",
    )
    blocksize: int = Field(default=4096, description="Elements per absmax block of the 8-bit encodings")
    error_feedback: bool = Field(
        default=True,
        description="int8-delta: delta against the receivers' reconstruction (True) or the previous true "
        "weights (False, drifts; for comparison only)",
    )

    @property
    def lossless(self) -> bool:
        """Whether receivers hold exactly the weights the trainer's loss sees (fp32, or rounded to the 16-bit
        dtype they hold); False where 8-bit encodings (int8, int8-delta, auto's int8 deltas) approximate them."""
        return self.encoding in ("fp32", "bf16", "fp16", "patch")

    @property
    def receiver_dtype(self) -> str | None:
        """The 16-bit dtype receivers hold ('bf16' / 'fp16'), or None when they hold fp32 (fp32, int8,
        int8-delta)."""
        if self.encoding in ("bf16", "fp16"):
            return self.encoding
        if self.encoding in ("patch", "auto"):
            return self.serving_dtype
        return None

    @field_validator("blocksize")
    @classmethod
    def _check_blocksize(cls, v: int) -> int:
        if v not in ALLOWED_BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {ALLOWED_BLOCKSIZES}")
        return v
