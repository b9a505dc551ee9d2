"""Strip and re-apply rotary position embedding on cached keys, using the model's own rotary module.

HF rotary modules return `cos = cos(pos * inv_freq) * a` and `sin = sin(pos * inv_freq) * a` where
`a = attention_scaling` (1 for default/llama3 RoPE, != 1 for YaRN). Applying is
`k_rot = k * cos + rotate_half(k) * sin`, i.e. multiplying each pair by (cI + sJ) with J^2 = -I.
Its inverse is (cI - sJ) / (c^2 + s^2): the division by a^2 is what makes YaRN models come out right.
`rotate` is the one implementation of both formulas in this package (RopeCodec and the transfer
fast path use it).
"""
from __future__ import annotations

import torch

from .models import decoder, rope_type

_POSITION_DEPENDENT = {"dynamic", "longrope"}  # cos/sin depend on sequence length, not position alone


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) on the two halves, as in HF Llama-family models."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE on float32 keys [..., d] with HF-layout cos/sin (broadcastable to k); returns `out`.

    With halves (k1, k2) of the last dim:
        apply   (inverse=False):  (k1 c - k2 s,  k2 c + k1 s)            = k c + rotate_half(k) s
        strip   (inverse=True):   (k1 c + k2 s,  k2 c - k1 s) / (c² + s²)  = (k c - rotate_half(k) s) / (c² + s²)
    `out` defaults to a new tensor; `out=k` rotates in place (no rotate_half temporaries either way).
    """
    h = k.shape[-1] // 2
    if out is None:
        out = torch.empty(torch.broadcast_shapes(k.shape, cos.shape), dtype=k.dtype, device=k.device)
    k1, k2 = k[..., :h], k[..., h:]
    if out.data_ptr() == k.data_ptr():
        k1 = k1.clone()  # in place: the first half is overwritten before the second half reads it
    sign = 1.0 if inverse else -1.0
    torch.mul(k1, cos[..., :h], out=out[..., :h]).addcmul_(k2, sin[..., :h], value=sign)
    torch.mul(k2, cos[..., h:], out=out[..., h:]).addcmul_(k1, sin[..., h:], value=-sign)
    if inverse:
        out.div_(cos * cos + sin * sin)
    return out


def find_rotary(model) -> torch.nn.Module:
    """The rotary embedding module of a causal LM (e.g. `model.model.rotary_emb`)."""
    body = decoder(model)
    if hasattr(body, "rotary_emb"):
        return body.rotary_emb
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    raise ValueError(f"{type(model).__name__} has no rotary_emb module; only RoPE models are supported")


class RopeCodec:
    """Per-position cos/sin table of one model, grown on demand, with `apply` and `strip` for keys.

    Tables are float32 on the rotary module's device; keys of any dtype are rotated in float32 and
    returned in their own dtype. Positions are int64 tensors [seq] or [batch, seq].
    """

    def __init__(self, model, initial_positions: int = 4096):
        kind = rope_type(model)
        if kind in _POSITION_DEPENDENT:
            raise NotImplementedError(f"RoPE type {kind!r} depends on sequence length; cannot strip it "
                                      "per position. Supported: default, linear, llama3, yarn.")
        self.rotary = find_rotary(model)
        self.rope_type = kind
        self._cos = self._sin = None
        self._grow(initial_positions)

    @torch.no_grad()
    def _grow(self, n_positions: int) -> None:
        device = self.rotary.inv_freq.device
        pos = torch.arange(n_positions, device=device)[None]
        dummy = torch.zeros(1, dtype=torch.float32, device=device)
        cos, sin = self.rotary(dummy, pos)
        self._cos, self._sin = cos[0].float(), sin[0].float()  # [n_positions, head_dim]

    @property
    def attention_scaling(self) -> float:
        """The factor `a` HF multiplies into cos and sin (1.0 unless YaRN-like scaling)."""
        return float(getattr(self.rotary, "attention_scaling", 1.0))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as float32 [batch|1, 1, seq, head_dim] for int positions [seq] or [batch, seq]."""
        if positions.dim() == 1:
            positions = positions[None]
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            self._grow(max(needed, 2 * self._cos.shape[0]))
        idx = positions.to(self._cos.device)
        return self._cos[idx][:, None], self._sin[idx][:, None]

    def apply(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate content-space keys [batch, heads, seq, head_dim] to their positions."""
        cos, sin = self.cos_sin(positions)
        return rotate(keys.float(), cos.to(keys.device), sin.to(keys.device)).to(keys.dtype)

    def strip(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo `apply`: rotated keys [batch, heads, seq, head_dim] -> content-space keys."""
        cos, sin = self.cos_sin(positions)
        return rotate(keys.float(), cos.to(keys.device), sin.to(keys.device), inverse=True).to(keys.dtype)
