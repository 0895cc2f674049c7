"""Can this machine run the model as configured? Checked before a peer joins a run, with the fix in one line.

Owned here: ``machine_problems(spec, engine)``: the device (a CUDA device on a CPU build of torch, or on a
machine without a GPU, or past the GPUs it has), the dtype (bf16 on a GPU without it), the engine (vLLM
outside its environment). A donor who asks for what the machine cannot do used to join, wait for the first
version and die ~20 s later inside the engine (``Torch not compiled with CUDA enabled``).
Called by ``echo_p2p.peer`` before anything starts; the peer exits 2 with the first problem.
Must not load a model or touch the network; imports torch only when the spec names a CUDA device.
"""

from __future__ import annotations

import importlib.util

from echo_p2p.ml.models import ModelSpec

#: What a donor runs to get a CUDA build of torch in the project's environment (PyPI's Linux wheels of
#: torch are CUDA builds; ``scripts/setup.sh --cuda`` checks for one and says this when it finds a CPU build).
CUDA_FIX = "bash scripts/setup.sh --cuda (a CUDA build of torch in .venv), or --device cpu"


def machine_problems(spec: ModelSpec, engine: str = "transformers") -> list[str]:
    """Why this machine cannot run ``spec`` with ``engine``, each with its fix; empty when it can."""
    problems: list[str] = []
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(
            "engine vllm asked, but vLLM is not installed in this environment: run the peer from vLLM's own "
            "environment (bash scripts/setup_vllm.sh), or use --engine transformers"
        )
    if not spec.device.startswith("cuda"):
        return problems
    import torch

    if torch.version.cuda is None:
        problems.append(
            f"device {spec.device} asked, but this torch ({torch.__version__}) is a CPU build: {CUDA_FIX}"
        )
        return problems
    if not torch.cuda.is_available():
        problems.append(
            f"device {spec.device} asked, but torch sees no CUDA GPU (driver missing or no GPU visible: "
            f"nvidia-smi tells): fix the driver, or use --device cpu"
        )
        return problems
    index = torch.device(spec.device).index or 0
    if index >= torch.cuda.device_count():
        problems.append(
            f"device {spec.device} asked, but this machine has {torch.cuda.device_count()} GPU(s): "
            f"use --device cuda:0"
        )
        return problems
    if spec.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        problems.append(
            f"dtype bfloat16 asked, but {torch.cuda.get_device_name(index)} has no bf16: use float16 "
            "(run.model.dtype) or float32"
        )
    return problems
