"""Which torch device runs the model."""

from __future__ import annotations

import torch


def resolve_device(name: str | None) -> torch.device:
    """`name` ("cuda", "cuda:1", "cpu"), or the GPU when there is one and else the CPU."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
