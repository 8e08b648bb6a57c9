"""The indexer's keys as the pools store them: 128-coordinate blocks of FP8 e4m3 codes,
each block with one float32 scale (amax / 448), codes of a key first and its scales after
(d + 4 d / 128 bytes: 132 at V4's index_head_dim of 128). The engine writes them, its torch
paths and remnant.kernels.indexer's reference read them back through here."""

from __future__ import annotations

import torch

#: Coordinates per scale block, and the bytes of one block's float32 scale.
BLOCK = 128
SCALE_BYTES = 4


def quantize_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """Indexer keys float [k, d] -> FP8 codes + one fp32 scale per 128 coords, uint8 [k, d + 4d/128]."""
    return join_index_keys(*index_key_codes(keys))


def index_key_codes(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys float [k, d] -> (FP8 codes as uint8 [k, d], scales float32 [k, d/128])."""
    k, d = keys.shape
    blocks = keys.view(k, d // BLOCK, BLOCK)
    scale = (blocks.abs().amax(-1) / 448.0).clamp_min(1e-12)
    return (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(k, d), scale


def join_index_keys(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """index_key_codes' two parts as stored: uint8 [k, d + 4d/128] (codes, then the scales' bytes)."""
    return torch.cat([codes, scale.contiguous().view(torch.uint8).reshape(codes.shape[0], -1)], dim=1)


def dequantize_index_keys(stored: torch.Tensor) -> torch.Tensor:
    """quantize_index_keys' inverse up to FP8 rounding: uint8 [..., d + 4d/128] -> float32 [..., d]."""
    *lead, width = stored.shape
    d = width * BLOCK // (BLOCK + SCALE_BYTES)
    codes = stored[..., :d].contiguous().view(torch.float8_e4m3fn).float().view(*lead, d // BLOCK, BLOCK)
    scale = stored[..., d:].contiguous().view(torch.float32).view(*lead, d // BLOCK, 1)
    return (codes * scale).reshape(*lead, d)
