"""FP8 E4M3 block-scaled weights: the one statement of the convention (MODEL_SPEC §5.1).

    W[o, i] = float(W_fp8[o, i]) * scale[o // 128, i // 128]

`scale` is the checkpoint's `weight_scale_inv` (a plain multiplier despite its name), shape
[ceil(out/128), ceil(in/128)]; ragged last blocks use their block's scale. Weights keep the
checkpoint's [out, in] layout; scales are held as float32.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np

from qmtp.model.config import FP8_BLOCK

E4M3_MAX = 448.0
FP8_DTYPE = ml_dtypes.float8_e4m3fn

# safetensors' numpy reader looks float8 dtypes up on the numpy module; ml_dtypes provides them.
if not hasattr(np, "float8_e4m3fn"):
    np.float8_e4m3fn = ml_dtypes.float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Block:
    """A block-quantized linear weight. weight: [..., O, I] float8_e4m3fn, or for the Pallas kernels
    tiled as [O / tr, I / 128, tr, 128] with tr = 128 (64 where O is no multiple of 128;
    qmtp.model.weight_layout); scale: [..., ceil(O/128), ceil(I/128)] f32."""

    weight: jax.Array
    scale: jax.Array

    @property
    def tiled(self) -> bool:
        """Whether the weight is in the kernels' tiled layout (4-D) rather than the checkpoint's [O, I]."""
        return self.weight.ndim == 4

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [O, I] shape, in either layout."""
        w = self.weight.shape
        return (w[0] * w[2], w[1] * w[3]) if self.tiled else tuple(w)


def scale_grid(out_features: int, in_features: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of the scale grid for an [out, in] weight."""
    return (-(-out_features // block), -(-in_features // block))


def _expand_np(scale: np.ndarray, out_features: int, in_features: int, block: int, xp=np) -> np.ndarray:
    return xp.repeat(xp.repeat(scale, block, axis=-2), block, axis=-1)[..., :out_features, :in_features]


def _quantize(w, block: int, xp):
    o, i = w.shape
    go, gi = scale_grid(o, i, block)
    w32 = xp.asarray(w, xp.float32)
    amax = xp.pad(xp.abs(w32), ((0, go * block - o), (0, gi * block - i))).reshape(go, block, gi, block)
    amax = amax.max(axis=(1, 3))
    scale = xp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(xp.float32)
    q = xp.clip(w32 / _expand_np(scale, o, i, block, xp), -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE)
    return q, scale


def quantize_np(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """[O, I] float -> (E4M3 weight [O, I], f32 scale grid) with amax/448 per block (exact for zeros)."""
    return _quantize(w, block, np)


def quantize(w: jax.Array, block: int = FP8_BLOCK) -> Fp8Block:
    """`quantize_np` on the device, where w lives (XLA's f32 division may round 1 ulp away from
    numpy's); a weight split along O on 128-multiples stays split (blocks never straddle it)."""
    import jax.numpy as jnp
    return Fp8Block(*_quantize(w, block, jnp))


def dequantize_np(q: np.ndarray, scale: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """E4M3 [..., O, I] with scale grid -> float32 [..., O, I]."""
    o, i = q.shape[-2:]
    return q.astype(np.float32) * _expand_np(np.asarray(scale, np.float32), o, i, block)
