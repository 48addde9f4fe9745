"""Released checkpoints' quantized weights, dequantized on import (NumPy, float32).

- FP8 with block scales (DeepSeek-V3, Kimi K2): `float8_e4m3fn` weights [..., N, K] beside `weight_scale_inv`
  float32 [..., ceil(N / 128), ceil(K / 128)], one per 128 x 128 block (edge blocks partial); the weight is the
  FP8 values times their block's scale, despite the name (transformers' `_dequantize_fp8_weight`).
- MXFP4 (GPT-OSS's experts): `*_blocks` uint8 [..., G, B], each byte two e2m1 codes (low nibble first), and
  `*_scales` uint8 E8M0 [..., G], 2^(s - 127) for each group of 2B values (transformers' `convert_moe_packed_tensors`,
  which also swaps the last two axes: `mxfp4_weight`).

Safetensors' NumPy reader knows no float8 dtype: `read_raw` reads such a tensor's bytes from the file as
`ml_dtypes`' type.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from lm.config import ConfigError

FLOAT8 = {'F8_E4M3': ml_dtypes.float8_e4m3fn, 'F8_E5M2': ml_dtypes.float8_e5m2}
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)  # e2m1: sign, 2 exponent bits, 1 mantissa bit


def read_raw(path: Path, name: str) -> np.ndarray:
  """Tensor `name` of safetensors file `path` read from its bytes (for the float8 dtypes safetensors' NumPy reader
  lacks)."""
  with open(path, 'rb') as f:
    (size,) = struct.unpack('<Q', f.read(8))
    info = json.loads(f.read(size))[name]
    if info['dtype'] not in FLOAT8:
      raise ConfigError(f'{path}: tensor {name!r} has dtype {info["dtype"]}, which lm cannot read; re-save it in '
                        f'float32, bfloat16, float16 or {" or ".join(FLOAT8)}')
    begin, end = info['data_offsets']
    f.seek(8 + size + begin)
    data = f.read(end - begin)
  return np.frombuffer(data, FLOAT8[info['dtype']]).reshape(info['shape'])


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
  """float32 [..., N, K] of FP8 `weight` [..., N, K] and its block scales `scale_inv` [..., ceil(N/b0), ceil(K/b1)]
  (one scale for the whole tensor when it has a single entry)."""
  rows, cols = weight.shape[-2:]
  scale = np.asarray(scale_inv, np.float32)
  want = (-(-rows // block[0]), -(-cols // block[1]))
  if scale.size != 1 and scale.shape[-2:] != want:
    raise ConfigError(f'an FP8 weight of shape {weight.shape} needs block scales of shape {want} for blocks of '
                      f'{block[0]} x {block[1]}, not {scale.shape}; check quantization_config.weight_block_size')
  if scale.size != 1:
    scale = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)[..., :rows, :cols]
  return weight.astype(np.float32) * scale


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32 [..., G * B * 2] of MXFP4 `blocks` uint8 [..., G, B] and `scales` uint8 [..., G]."""
  if blocks.shape[:-1] != scales.shape:
    raise ConfigError(f'MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match: each group of blocks '
                      f'[..., G, B] needs one scale [..., G]')
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)  # low nibble first
  values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127)
  return values.reshape(*blocks.shape[:-2], -1)


def mxfp4_weight(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """GPT-OSS's expert weight from its MXFP4 tensors: `mxfp4_values` with the last two axes swapped, as
  transformers lays the dequantized experts out ([experts, in, out])."""
  return np.swapaxes(mxfp4_values(blocks, scales), -1, -2)
