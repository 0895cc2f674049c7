"""Settings and errors of an export (``python -m echo_p2p.export``), validated before anything heavy starts.

Owned here: ``ExportConfig`` (where to write, in which dtype, which model describes the weights),
``LiveExportConfig`` (the deadlines of an export from a running swarm), ``ExportResult``, the dtype names and how a policy's
serving precision maps to them, ``ExportError`` (a failure the CLI prints as one line, exit code 1).
Callers: ``export.__main__``, ``export.checkpoint``, ``export.live``, ``echo_p2p.local``. No torch, no hivemind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.ml.models import ModelSpec
from echo_p2p.paths import UserPath

#: Dtypes an export can be written in (the names of ``torch.float32`` ... and of ``--dtype``).
ExportDtype = Literal["float32", "bfloat16", "float16"]

#: The dtype of an export when neither ``--dtype`` nor the source says what inference peers hold.
FALLBACK_DTYPE: ExportDtype = "bfloat16"

#: The file an export writes next to the model: where the weights came from (source, version, dtype).
EXPORT_INFO_FILE = "echo_p2p_export.json"


class ExportError(RuntimeError):
    """An export that could not be done: the message says why, in words a user can act on."""


def serving_dtype_name(precision: str | None) -> ExportDtype:
    """The export dtype of what inference peers hold: 'bf16' / 'fp16' (``EncodingConfig.receiver_dtype``)
    or None (receivers hold fp32: fp32, int8 and int8-delta streams)."""
    return {"bf16": "bfloat16", "fp16": "float16", None: "float32"}[precision]


class ExportConfig(BaseModel):
    """What an export writes."""

    model_config = ConfigDict(extra="forbid")

    out: UserPath = Field(
        description="The model directory to write (created; its parent must exist or is created)."
    )
    dtype: ExportDtype | None = Field(
        default=None,
        description="Dtype of the exported weights. None: the dtype the run's inference peers hold (the "
        "serving dtype: bfloat16 by default, so the export is exactly the policy the trainer's loss sees and "
        "the samplers run); bfloat16 when the source does not say (a checkpoint older than the export).",
    )
    model: ModelSpec | None = Field(
        default=None,
        description="The model the weights belong to (its architecture, config and tokenizer). None: the "
        "checkpoint's own config and tokenizer files, or the preset the run record names.",
    )
    overwrite: bool = Field(
        default=False, description="Replace `out` if it exists and is not empty (otherwise refused)."
    )


class LiveExportConfig(BaseModel):
    """Deadlines of an export from a running swarm."""

    model_config = ConfigDict(extra="forbid")

    timeout: float = Field(
        default=300.0,
        gt=0,
        description="Seconds to find the run record, the trainers' newest version and to fetch it; the "
        "export fails (exit 1) past it.",
    )
    min_version: int | None = Field(
        default=None,
        ge=0,
        description="Wait for a policy version at least this new (None: the newest found).",
    )
    poll_period: float = Field(
        default=1.0, gt=0, description="Seconds between two looks at the run's policy records."
    )


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the directory, the policy version, the dtype and where the weights came from."""

    path: str
    version: int
    dtype: ExportDtype
    source: str  # "checkpoint <dir>" or "run <run id> (publisher <peer id>)"
