"""A tiny but real decoder-only transformer whose attention reads and writes paged KV.

Token embedding, `num_layers` pre-norm blocks (multi-head attention with rotary positions, then
a SwiGLU MLP), a final RMSNorm and an LM head. The weights are random, drawn from a seeded
generator, so two processes with the same seed build the same model and their KV pages are
interchangeable (the seed is part of the cache namespace's model id).

A forward pass runs one layer at a time (`Prefill.run_layer`), so a request handler can start
layer i as soon as the cache has copied layer i of the cached prefix to the device. Where the
K/V live is up to a `KVStore`: `ContiguousKV` keeps them in plain tensors (no cache at all),
`PagedKV` writes the new tokens' K/V into a paged pool by slot and gathers every previous
token's K/V (cached or new) back from it.

A pass can be asked to stop (`Prefill.stop`): it checks between layers and between pieces of a
layer's attention, so a cancelled request frees its model thread within a fraction of a second
even on a long prompt.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from .._config import KVLayout
from .._pool import KVPool

__all__ = [
    "ContiguousKV",
    "ForwardStopped",
    "KVStore",
    "ModelConfig",
    "PagedKV",
    "Prefill",
    "TinyTransformer",
]


class ForwardStopped(Exception):
    """A forward pass was asked to stop (`Prefill.stop` was set) before it finished."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of the demo transformer. The defaults give a 33.8M-parameter model (all but 1M of
    them in the 128k x 128 embedding and LM head) whose KV is 4 KiB per token in float32.

    `kv_dtype` is what K/V are stored as (in the pools and in `ContiguousKV` alike);
    activations are float32 either way."""

    vocab_size: int = 128_000
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 512
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    kv_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(
                f"head_dim must be even and >= 2 for rotary positions, got {self.head_dim}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    def kv_layout(self) -> KVLayout:
        """The cache layout this model's KV needs."""
        return KVLayout(
            num_layers=self.num_layers,
            attention="mha",
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
        )

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """`kv_dtype` as a torch dtype."""
        return _KV_DTYPES[self.kv_dtype]


_KV_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _Layer:
    """One block's weights (float32, [in, out] so activations multiply on the left)."""

    __slots__ = ("attn_norm", "mlp_norm", "w_down", "w_gate", "w_k", "w_o", "w_q", "w_up", "w_v")

    def __init__(self, config: ModelConfig, draw: Callable[..., torch.Tensor]) -> None:
        d, hd = config.d_model, config.head_dim
        self.attn_norm = torch.ones(d) + 0.1 * draw(d)
        self.w_q = draw(d, config.num_heads * hd) / math.sqrt(d)
        self.w_k = draw(d, config.num_kv_heads * hd) / math.sqrt(d)
        self.w_v = draw(d, config.num_kv_heads * hd) / math.sqrt(d)
        self.w_o = draw(config.num_heads * hd, d) / math.sqrt(config.num_heads * hd)
        self.mlp_norm = torch.ones(d) + 0.1 * draw(d)
        self.w_gate = draw(d, config.mlp_dim) / math.sqrt(d)
        self.w_up = draw(d, config.mlp_dim) / math.sqrt(d)
        self.w_down = draw(config.mlp_dim, d) / math.sqrt(config.mlp_dim)

    def to(self, device: torch.device) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name).to(device))


class TinyTransformer:
    """The demo model: fixed random weights from `seed`, on `device`. Inference only."""

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config = config or ModelConfig()
        self.seed = seed
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(seed)

        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=torch.float32)

        self.embedding = draw(config.vocab_size, config.d_model).to(self.device)
        self.layers = [_Layer(config, draw) for _ in range(config.num_layers)]
        for layer in self.layers:
            layer.to(self.device)
        self.final_norm = (torch.ones(config.d_model) + 0.1 * draw(config.d_model)).to(self.device)
        # Untied: with a head tied to the embedding a random model mostly predicts its input
        # token back, and the first token would hardly depend on the context.
        self.lm_head = (draw(config.vocab_size, config.d_model) / math.sqrt(config.d_model)).to(
            self.device
        )
        half = config.head_dim // 2
        self._inv_freq = (
            config.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
        ).to(self.device)

    @property
    def num_parameters(self) -> int:
        """Weights in the model."""
        total = self.embedding.numel() + self.lm_head.numel() + self.final_norm.numel()
        for layer in self.layers:
            total += sum(getattr(layer, name).numel() for name in _Layer.__slots__)
        return total

    @property
    def model_id(self) -> str:
        """Names the weights, for the cache namespace: KV from other weights never matches."""
        c = self.config
        return (
            f"hicache-demo-tiny/v{c.vocab_size}-d{c.d_model}-l{c.num_layers}-h{c.num_heads}"
            f"-kv{c.num_kv_heads}x{c.head_dim}-m{c.mlp_dim}/seed{self.seed}"
        )

    # -- pieces of the forward pass -------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        return x * scale * weight

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary positions on [n, heads, head_dim] (the rotate-half convention)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles, [n, 1, head_dim / 2]."""
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings, [n, d_model]."""
        return self.embedding.index_select(0, tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits of one position's hidden state, [vocab_size] float32."""
        return torch.mv(self.lm_head, self._norm(hidden, self.final_norm))

    def block(
        self,
        index: int,
        x: torch.Tensor,
        start: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: KVStore,
        *,
        stop: threading.Event | None = None,
    ) -> torch.Tensor:
        """Block `index` over the hidden states of tokens start .. start + n - 1; raises
        ForwardStopped if `stop` is set between pieces of its attention."""
        c, layer = self.config, self.layers[index]
        n = x.shape[0]
        h = self._norm(x, layer.attn_norm)
        q = self._rotate((h @ layer.w_q).view(n, c.num_heads, c.head_dim), *rope)
        k = self._rotate((h @ layer.w_k).view(n, c.num_kv_heads, c.head_dim), *rope)
        v = (h @ layer.w_v).view(n, c.num_kv_heads, c.head_dim)
        kv.write(index, k, v)
        keys, values = kv.read(index)  # [start + n, kv_heads, head_dim]: prefix and new
        attn = _attention_in_pieces(
            q.transpose(0, 1)[None],
            keys.to(q.dtype).transpose(0, 1)[None],
            values.to(q.dtype).transpose(0, 1)[None],
            start,
            stop,
        )
        x = x + attn[0].transpose(0, 1).reshape(n, c.num_heads * c.head_dim) @ layer.w_o
        h = self._norm(x, layer.mlp_norm)
        gate: torch.Tensor = F.silu(h @ layer.w_gate)
        out: torch.Tensor = x + (gate * (h @ layer.w_up)) @ layer.w_down
        return out

    def prefill_logits(
        self, tokens: np.ndarray[Any, Any] | Sequence[int], *, stop: threading.Event | None = None
    ) -> torch.Tensor:
        """Logits of the last position, computing the whole prompt with a contiguous KV.
        Raises ForwardStopped if `stop` is set before it finishes."""
        array = np.asarray(tokens)
        kv = ContiguousKV(self.config.num_layers, self.config.kv_torch_dtype)
        prefill = Prefill(self, array, 0, kv, stop=stop)
        for index in range(self.config.num_layers):
            prefill.run_layer(index)
        return prefill.logits()


# The CPU flash kernel, which also returns each query's log-sum-exp (an aten op, present since
# torch 2.2; without it attention falls back to one masked pass).
_FLASH_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


# Attention scores (queries x keys) per piece of a layer's attention: a piece takes a fraction
# of a second on one core, and a prompt of up to 4096 tokens is one piece.
_PIECE_SCORES = 1 << 24


def _attention_in_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    stop: threading.Event | None,
) -> torch.Tensor:
    """`_attention` over consecutive runs of queries, checking `stop` before each: the
    cost of attention grows with the square of the prompt, and a stop must not wait for it."""
    n = q.shape[2]
    rows = max(1, _PIECE_SCORES // k.shape[2])
    if n <= rows:
        return _attention(q, k, v, start)
    pieces = []
    for first in range(0, n, rows):
        if stop is not None and stop.is_set():
            raise ForwardStopped
        end = min(n, first + rows)
        # Queries first .. end - 1 see the keys up to their own position.
        keys, values = k[:, :, : start + end], v[:, :, : start + end]
        pieces.append(_attention(q[:, :, first:end], keys, values, start + first))
    return torch.cat(pieces, dim=2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions start .. start + n - 1 over keys 0 .. start + n - 1.

    q is [1, heads, n, head_dim]; k and v are [1, kv_heads, start + n, head_dim].
    """
    gqa = k.shape[1] != q.shape[1]
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.device.type == "cpu" and _FLASH_CPU is not None:
        if gqa:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        # Two flash passes, over the cached prefix (nothing masked) and over the new tokens
        # (square, so plain causal), merged by their log-sum-exps: the exact softmax over all
        # keys, at a fraction of what one masked pass over the n x (start + n) scores costs.
        out_prefix, lse_prefix = _FLASH_CPU(q, k[:, :, :start], v[:, :, :start], 0.0, False)[:2]
        out_new, lse_new = _FLASH_CPU(q, k[:, :, start:], v[:, :, start:], 0.0, True)[:2]
        top = torch.maximum(lse_prefix, lse_new)
        w_prefix, w_new = (lse_prefix - top).exp()[..., None], (lse_new - top).exp()[..., None]
        merged: torch.Tensor = (out_prefix * w_prefix + out_new * w_new) / (w_prefix + w_new)
        return merged
    # Query i sits at position start + i and sees keys 0 .. start + i.
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class KVStore(Protocol):
    """Where a forward pass keeps the K/V of every token it attends to."""

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new tokens' K/V ([n, kv_heads, head_dim] each) of one layer."""
        ...

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of every token so far (cached prefix, then new), [total, kv_heads, head_dim]."""
        ...


class ContiguousKV:
    """Plain per-layer tensors holding the whole prompt's K/V, stored as `dtype` (as a pool
    of that dtype would hold them): no pool, no cache."""

    def __init__(self, num_layers: int, dtype: torch.dtype = torch.float32) -> None:
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self._dtype = dtype

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._kv[layer] = (keys.to(self._dtype), values.to(self._dtype))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._kv[layer]
        if entry is None:
            raise RuntimeError(f"layer {layer} was read before it was written")
        return entry


class PagedKV:
    """A request's K/V in a paged pool: token t lives at slot page_table[t // S] * S + t % S.

    Tokens `start` .. `end - 1` are the ones being computed (written); tokens before `start`
    must already be in the pool (a cached prefix, or an earlier pass of the same request).
    """

    def __init__(self, pool: KVPool, page_table: Sequence[int], start: int, end: int) -> None:
        size = pool.page_size
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        if len(page_table) * size < end:
            raise ValueError(
                f"the page table covers {len(page_table) * size} tokens, fewer than {end}"
            )
        positions = torch.arange(end, device=pool.device)
        table = torch.as_tensor(list(page_table), dtype=torch.int64, device=pool.device)
        self._pool = pool
        self._slots = table[positions // size] * size + positions % size
        self._new = self._slots[start:]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        pool_k, pool_v = self._pool.layer_buffers(layer)
        pool_k.index_copy_(0, self._new, keys.to(pool_k.dtype))
        pool_v.index_copy_(0, self._new, values.to(pool_v.dtype))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool_k, pool_v = self._pool.layer_buffers(layer)
        return pool_k.index_select(0, self._slots), pool_v.index_select(0, self._slots)


class Prefill:
    """One forward pass over tokens[start:] of a prompt, run a layer at a time.

    `run_layer(i)` must be called for i = 0, 1, ... in order; `logits()` then gives the last
    position's logits. Tokens before `start` are not computed: their K/V must be in `kv`.
    Everything here is synchronous torch work; call it off the event loop's thread.

    Setting `stop` (from any thread) makes the pass end early: `run_layer` then raises
    ForwardStopped at its next check (before a layer, or between pieces of its attention).
    """

    def __init__(
        self,
        model: TinyTransformer,
        tokens: np.ndarray[Any, Any],
        start: int,
        kv: KVStore,
        *,
        stop: threading.Event | None = None,
    ) -> None:
        if not 0 <= start < len(tokens):
            raise ValueError(f"start must be in [0, {len(tokens)}), got {start}")
        if len(tokens) and int(np.max(tokens)) >= model.config.vocab_size:
            raise ValueError(f"token ids must be < vocab_size ({model.config.vocab_size})")
        self._model = model
        self._tokens = tokens
        self._start = start
        self._kv = kv
        self._hidden: torch.Tensor | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next = 0
        #: set to stop the pass (see the class docstring).
        self.stop = stop if stop is not None else threading.Event()

    @property
    def num_tokens(self) -> int:
        """Tokens this pass computes."""
        return len(self._tokens) - self._start

    def run_layer(self, index: int) -> None:
        """Compute block `index` for the new tokens (embedding them first at layer 0)."""
        if index != self._next:
            raise RuntimeError(f"layer {index} run out of order; expected {self._next}")
        if self.stop.is_set():
            raise ForwardStopped
        model = self._model
        with torch.no_grad():
            if self._hidden is None or self._rope is None:
                ids = torch.from_numpy(self._tokens[self._start :].astype(np.int64))
                self._hidden = model.embed(ids.to(model.device))
                positions = torch.arange(self._start, len(self._tokens), device=model.device)
                self._rope = model.rope(positions)
            self._hidden = model.block(
                index, self._hidden, self._start, self._rope, self._kv, stop=self.stop
            )
        self._next += 1

    def logits(self) -> torch.Tensor:
        """Logits of the prompt's last position (after every layer ran), float32 on the CPU."""
        if self._hidden is None or self._next != self._model.config.num_layers:
            raise RuntimeError("logits() before every layer ran")
        with torch.no_grad():
            return self._model.logits(self._hidden[-1]).float().cpu()
