"""Preallocated KV pools: one tensor per pool, carved into pages.

With B buffers (2 for MHA: K and V; 1 for MLA: the latent), L layers, P pages of S tokens and a
per-token shape (H, W), a pool is one tensor in one of three memory layouts:

==================== ======================= ==============================================
memory layout        tensor shape            one page
==================== ======================= ==============================================
`layer_first`        [B, L, P*S, H, W]       B*L segments: buf[b, l, p*S:(p+1)*S]
`page_first`         [B, P*S, L, H, W]       B segments: buf[b, p*S:(p+1)*S] (token-major)
`page_first_direct`  [P, B, L, S, H, W]      one contiguous segment: buf[p]
==================== ======================= ==============================================

A page's *canonical bytes* (what `read_page` returns, `page_segments` describes and storage
holds) are ordered

- [buffer][layer][token][head][width] for `layer_first` and `page_first_direct` (identical, so a
  page read from one can be written into the other), and
- [buffer][token][layer][head][width] for `page_first` (token-major, as SGLang stores it; the
  storage namespace keeps the two orders apart).

Copies between pools of any memory layouts go through integer views that present every layout
the same way (`copy_views`: [B, P, S, H, words] per layer; `copy_rows` and `copy_row_index`:
rows of whole page-layers or single tokens), so they are exact whatever the orders.
"""

from __future__ import annotations

import operator
import os
from typing import Any

import msgspec
import numpy as np
import torch
from numpy.typing import NDArray

from ._allocator import PageAllocator
from ._config import MAX_POOL_NBYTES, CacheConfig, HostLayout, KVLayout
from ._errors import ConfigError, index_of

__all__ = ["KVPool", "PoolStatistics", "make_pools", "torch_dtype"]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}

_MEMORY_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first", "page_first_direct")

# Integer words of these sizes move every dtype bit for bit, and wider words mean fewer
# elements for the copy kernels to walk.
_WORDS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of a layout's elements."""
    return _TORCH_DTYPES[layout.dtype]


def _memory_of(device: torch.device) -> int | None:
    """Bytes of memory `device` has in all (not what is free now), or None where unknown."""
    if device.type == "cpu":
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # not a POSIX system, or not told
            return None
        return total if total > 0 else None
    if device.type == "cuda" and torch.cuda.is_available():
        try:
            index = torch.cuda.current_device() if device.index is None else device.index
            return int(torch.cuda.get_device_properties(index).total_memory)
        except (RuntimeError, AssertionError):
            return None
    return None


def _check_device(device: torch.device) -> None:
    """Refuse a CUDA device this machine lacks with a `ConfigError` naming `device`, before
    torch fails on it with an assertion or an invalid-ordinal error."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            "device",
            f"{str(device)!r} needs a CUDA device, but none is available (torch "
            f"{torch.__version__}, {built}); use 'cpu' or 'auto'",
        )
    if device.index is not None and device.index >= count:
        raise ConfigError(
            "device",
            f"{str(device)!r} is not on this machine: it has {count} CUDA device(s), "
            f"'cuda:0' to 'cuda:{count - 1}'",
        )


def _check_fits(nbytes: int, device: torch.device, what: str, field: str) -> None:
    """Refuse pools larger than the device's memory before touching any of it: zeroing a pool
    the kernel overcommitted would end in the OOM killer, not in an exception."""
    memory = _memory_of(device)
    if memory is not None and nbytes > memory:
        raise ConfigError(
            field, f"{what} would take {nbytes} bytes, more than the {memory} bytes {device} has"
        )


class PoolStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a `KVPool`: its shape and its allocator's occupancy."""

    name: str
    device: str
    memory_layout: str
    num_pages: int
    page_nbytes: int
    free: int
    used: int
    pinned: bool


class KVPool:
    """A preallocated pool of KV pages on one device, with its page allocator.

    The memory is allocated once and zeroed up front so that no page fault lands on a hot path.
    Page indices handed out by `allocator` index every method here.

    A pool that cannot be allocated (more bytes than the device has, or refused by torch)
    raises `ConfigError` naming `config_field`, the setting that sized it.
    """

    def __init__(
        self,
        layout: KVLayout,
        page_size: int,
        num_pages: int,
        *,
        device: torch.device | str = "cpu",
        memory_layout: HostLayout = "layer_first",
        pin_memory: bool = False,
        name: str = "pool",
        config_field: str = "num_pages",
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        page_size = operator.index(page_size)
        num_pages = operator.index(num_pages)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if memory_layout not in _MEMORY_LAYOUTS:
            raise ValueError(
                f"memory_layout must be one of {', '.join(_MEMORY_LAYOUTS)}, got {memory_layout!r}"
            )
        dev = torch.device(device)
        _check_device(dev)
        if pin_memory and (dev.type != "cpu" or not torch.cuda.is_available()):
            raise ValueError("pin_memory applies only to a CPU pool on a machine with CUDA")

        self._layout = layout
        self._page_size = page_size
        self._num_pages = num_pages
        self._device = dev
        self._memory_layout: HostLayout = memory_layout
        self._dtype = torch_dtype(layout)
        self._name = name
        self._page_nbytes = layout.page_nbytes(page_size)
        self._nbytes = self._page_nbytes * num_pages
        what = f"the {name} pool ({num_pages} pages of {self._page_nbytes} bytes)"
        if self._nbytes > MAX_POOL_NBYTES:
            raise ConfigError(
                config_field,
                f"{what} would take {self._nbytes} bytes, more than the {MAX_POOL_NBYTES} a pool "
                "may take",
            )
        _check_fits(self._nbytes, dev, what, config_field)
        self._allocator = PageAllocator(num_pages, name=name)

        nb, nl, ns = layout.num_buffers, layout.num_layers, page_size
        heads, width = layout.token_shape
        shape: tuple[int, ...]
        if memory_layout == "layer_first":
            shape = (nb, nl, num_pages * ns, heads, width)
        elif memory_layout == "page_first":
            shape = (nb, num_pages * ns, nl, heads, width)
        else:
            shape = (num_pages, nb, nl, ns, heads, width)
        try:
            data = torch.empty(shape, dtype=self._dtype, device=dev, pin_memory=pin_memory)
        except (RuntimeError, OverflowError, MemoryError, TypeError) as exc:
            raise ConfigError(
                config_field, f"cannot allocate {what}, {self._nbytes} bytes on {dev}: {exc}"
            ) from exc
        raw = data.view(torch.uint8)
        raw.zero_()
        self._data = data
        self._pinned = bool(pin_memory)

        row_nbytes = width * layout.itemsize
        word_size, word_dtype = next((s, d) for s, d in _WORDS if row_nbytes % s == 0)
        words = raw.view(word_dtype) if word_size > 1 else raw
        self._page_views = [self._per_layer(data, layer) for layer in range(nl)]
        self._words = words
        self._copy_views = [self._layer_words(layer) for layer in range(nl)]

        # Byte offsets of page 0's canonical segments, the stride from one page to the next, and
        # the segment length: enough to slice any page's segments out of one flat memoryview.
        tl = layout.token_layer_nbytes
        if memory_layout == "layer_first":
            self._seg_bases = [
                (b * nl + layer) * num_pages * ns * tl for b in range(nb) for layer in range(nl)
            ]
            self._seg_stride = ns * tl
            self._seg_len = ns * tl
        elif memory_layout == "page_first":
            self._seg_bases = [b * num_pages * ns * nl * tl for b in range(nb)]
            self._seg_stride = ns * nl * tl
            self._seg_len = ns * nl * tl
        else:
            self._seg_bases = [0]
            self._seg_stride = self._page_nbytes
            self._seg_len = self._page_nbytes
        self._flat: memoryview | None = None
        if dev.type == "cpu":
            array: np.ndarray[Any, Any] = raw.numpy().reshape(-1)
            self._flat = array.data.cast("B")

    def _per_layer(self, t: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        """Per-buffer [P, S, H, last] views of one layer of `t` (the pool in some element type)."""
        nb, ns, np_ = self._layout.num_buffers, self._page_size, self._num_pages
        views: list[torch.Tensor] = []
        for b in range(nb):
            if self._memory_layout == "layer_first":
                v = t[b, layer].view(np_, ns, *t.shape[-2:])
            elif self._memory_layout == "page_first":
                v = t[b, :, layer].view(np_, ns, *t.shape[-2:])
            else:
                v = t[:, b, layer]
            views.append(v)
        return tuple(views)

    def _layer_words(self, layer: int) -> torch.Tensor:
        """One [B, P, S, H, words] view of one layer, whatever the memory layout."""
        words, ns, np_ = self._words, self._page_size, self._num_pages
        nb = self._layout.num_buffers
        if self._memory_layout == "layer_first":
            return words[:, layer].view(nb, np_, ns, *words.shape[-2:])
        if self._memory_layout == "page_first":
            return words[:, :, layer].view(nb, np_, ns, *words.shape[-2:])
        return words[:, :, layer].transpose(0, 1)

    # -- properties ---------------------------------------------------------------------------

    # Read-only: the views, copies and page bounds were made for this shape, and the cache
    # hands out pages only through this allocator.
    @property
    def layout(self) -> KVLayout:
        """The KV layout of one token."""
        return self._layout

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def device(self) -> torch.device:
        """The device the pool is on."""
        return self._device

    @property
    def memory_layout(self) -> HostLayout:
        """`layer_first`, `page_first` or `page_first_direct`."""
        return self._memory_layout

    @property
    def dtype(self) -> torch.dtype:
        """The element type."""
        return self._dtype

    @property
    def name(self) -> str:
        """The pool's name in logs and statistics."""
        return self._name

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page."""
        return self._page_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self._nbytes

    @property
    def allocator(self) -> PageAllocator:
        """The allocator handing out this pool's pages."""
        return self._allocator

    @property
    def data(self) -> torch.Tensor:
        """The whole pool tensor, in the shape its memory layout gives (see the module doc)."""
        return self._data

    @property
    def pinned(self) -> bool:
        """Whether the pool is in page-locked host memory."""
        return self._pinned

    @property
    def token_major(self) -> bool:
        """Whether canonical page bytes are token-major (`page_first`)."""
        return self._memory_layout == "page_first"

    # -- views --------------------------------------------------------------------------------

    def _check_page(self, page: int) -> int:
        page = index_of(page, "page")
        if not 0 <= page < self._num_pages:
            raise ValueError(f"{self._name}: page {page} is out of range [0, {self._num_pages})")
        return page

    def _check_layer(self, layer: int) -> int:
        layer = index_of(layer, "layer")
        if not 0 <= layer < self._layout.num_layers:
            raise ValueError(
                f"{self._name}: layer {layer} is out of range [0, {self._layout.num_layers})"
            )
        return layer

    def page_view(self, page: int, layer: int) -> tuple[torch.Tensor, ...]:
        """One page of one layer: per buffer (K, V for MHA; the latent for MLA) a
        [page_size, heads, width] view, not necessarily contiguous."""
        page = self._check_page(page)
        return tuple(v[page] for v in self._page_views[self._check_layer(layer)])

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Per buffer a [num_pages * page_size, heads, width] view of one layer: what attention
        kernels index by token slot (slot = page * page_size + offset). `layer_first` only."""
        if self._memory_layout != "layer_first":
            raise ValueError(
                f"{self._name}: layer_buffers needs the layer_first layout, "
                f"not {self._memory_layout}"
            )
        layer = self._check_layer(layer)
        return tuple(self._data[b, layer] for b in range(self._layout.num_buffers))

    def copy_views(self, layer: int) -> torch.Tensor:
        """A [buffers, num_pages, page_size, heads, words] integer view of one layer.

        The words are the widest integer type that divides a token row, so copying between
        these views moves every bit of every dtype exactly; copy engines slice them by page.
        """
        return self._copy_views[self._check_layer(layer)]

    def copy_rows(self, *, per_token: bool) -> torch.Tensor:
        """The pool as a 2-D [rows, words] integer view, for row gathers and scatters.

        A row is one page of one layer and buffer (`per_token=False`; not available for the
        token-major `page_first`) or one token of one layer and buffer (`per_token=True`).
        `copy_row_index` says which rows hold which pages.
        """
        words = self._words
        row_words = words.shape[-2] * words.shape[-1]
        if per_token:
            return words.view(-1, row_words)
        if self._memory_layout == "page_first":
            raise ValueError("page_first pages are token-major: use per_token rows")
        return words.view(-1, self._page_size * row_words)

    def copy_row_index(
        self, pages: NDArray[np.integer[Any]], *, per_token: bool
    ) -> tuple[NDArray[np.int64], int]:
        """Rows of `copy_rows(per_token=...)` that hold layer 0 of `pages`, and the row step
        from one layer to the next.

        The rows come as a [buffers, len(pages)] array (rows of a page) or a
        [buffers, len(pages) * page_size] array (rows of each page's tokens in order), so two
        pools' indices for the same pages pair up row for row whatever their memory layouts.
        """
        nb, nl = self._layout.num_buffers, self._layout.num_layers
        np_, ns = self._num_pages, self._page_size
        b = np.arange(nb, dtype=np.int64)[:, None]
        p = np.asarray(pages, dtype=np.int64)[None, :]
        if self._memory_layout == "layer_first":
            rows, step = b * nl * np_ + p, np_
        elif self._memory_layout == "page_first_direct":
            rows, step = (p * nb + b) * nl, 1
        else:
            if not per_token:
                raise ValueError("page_first pages are token-major: use per_token rows")
            s = np.arange(ns, dtype=np.int64)
            rows = ((b * np_ + p)[:, :, None] * ns + s) * nl
            return rows.reshape(nb, -1), 1
        if not per_token:
            return rows, step
        s = np.arange(ns, dtype=np.int64)
        return (rows[:, :, None] * ns + s).reshape(nb, -1), step * ns

    def page_segments(self, page: int) -> list[memoryview]:
        """Writable byte views of one page in canonical order (CPU pools only).

        Their total length is `page_nbytes`; storage backends read into and write from them
        directly.
        """
        if self._flat is None:
            raise ValueError(f"{self._name}: page_segments needs a CPU pool, not {self._device}")
        page = self._check_page(page)
        flat, length = self._flat, self._seg_len
        offset = page * self._seg_stride
        return [flat[base + offset : base + offset + length] for base in self._seg_bases]

    def _canonical_tensors(self, page: int) -> list[torch.Tensor]:
        """Byte tensors of one page in canonical order (any device)."""
        raw = self._data.view(torch.uint8)
        ns, nb, nl = self._page_size, self._layout.num_buffers, self._layout.num_layers
        lo, hi = page * ns, (page + 1) * ns
        if self._memory_layout == "layer_first":
            return [raw[b, layer, lo:hi] for b in range(nb) for layer in range(nl)]
        if self._memory_layout == "page_first":
            return [raw[b, lo:hi] for b in range(nb)]
        return [raw[page]]

    def read_page(self, page: int) -> bytes:
        """The canonical bytes of one page."""
        page = self._check_page(page)
        if self._flat is not None:
            return b"".join(self.page_segments(page))
        parts = [t.reshape(-1) for t in self._canonical_tensors(page)]
        return bytes(torch.cat(parts).cpu().numpy().tobytes())

    def write_page(self, page: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one page with canonical bytes (exactly `page_nbytes` of them)."""
        page = self._check_page(page)
        src = memoryview(data).cast("B")
        if src.nbytes != self._page_nbytes:
            raise ValueError(f"{self._name}: a page is {self._page_nbytes} bytes, got {src.nbytes}")
        if self._flat is not None:
            start = 0
            for segment in self.page_segments(page):
                end = start + len(segment)
                segment[:] = src[start:end]
                start = end
            return
        staged = torch.frombuffer(bytearray(src), dtype=torch.uint8)
        start = 0
        for target in self._canonical_tensors(page):
            end = start + target.numel()
            target.copy_(staged[start:end].view(target.shape))
            start = end

    # -- introspection ------------------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's shape and occupancy."""
        return PoolStatistics(
            name=self._name,
            device=str(self._device),
            memory_layout=self._memory_layout,
            num_pages=self._num_pages,
            page_nbytes=self._page_nbytes,
            free=self._allocator.free_count,
            used=self._allocator.used_count,
            pinned=self._pinned,
        )

    def __repr__(self) -> str:
        return (
            f"KVPool(name={self._name!r}, device={str(self._device)!r}, "
            f"memory_layout={self._memory_layout!r}, pages={self._allocator.used_count}/"
            f"{self._num_pages} used, page_nbytes={self._page_nbytes}, pinned={self._pinned})"
        )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The configuration checked the string; torch may still parse it otherwise (an index
    # past its 8 bits wraps round), so what it made must say the same.
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError("device", f"torch refuses {device!r}: {exc}") from None
    if str(resolved) != device:
        raise ConfigError("device", f"torch reads {device!r} as {str(resolved)!r}")
    return resolved


def make_pools(config: CacheConfig) -> tuple[KVPool, KVPool]:
    """The (device, host) pools a configuration describes.

    The device pool is always `layer_first` (what attention kernels index); the host pool uses
    `config.host_layout` and is pinned exactly when CUDA is available. Raises `ConfigError`
    before allocating anything if the pools do not fit the memory they go to.
    """
    device = _resolve_device(config.device)
    host_field = config._host_pages_field
    host_pages = config.resolved_host_pages
    if device.type == "cpu":
        # Both pools in host memory: each may fit on its own and the two together not.
        page = config.page_nbytes
        what = f"the device pool ({config.device_pages} pages of {page} bytes)"
        _check_fits(config.device_pages * page, device, what, "device_pages")
        what = f"the device and host pools ({config.device_pages} + {host_pages} pages)"
        _check_fits((config.device_pages + host_pages) * page, device, what, host_field)
    device_pool = KVPool(
        config.layout,
        config.page_size,
        config.device_pages,
        device=device,
        memory_layout="layer_first",
        name="device",
        config_field="device_pages",
    )
    host_pool = KVPool(
        config.layout,
        config.page_size,
        host_pages,
        device="cpu",
        memory_layout=config.host_layout,
        pin_memory=torch.cuda.is_available(),
        name="host",
        config_field=host_field,
    )
    return device_pool, host_pool
