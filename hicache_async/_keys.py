"""Page keys: a sha256 chain over page token ids, started from a namespace seed.

key(i) = sha256(key(i-1) || token ids of page i as 4-byte little-endian unsigned), with key(-1)
the namespace seed. An empty seed gives exactly SGLang HiCache's chain, so pages can be shared
with it; a non-empty seed separates deployments whose pages must never mix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, Union

import msgspec
import numpy as np
from numpy.typing import NDArray

from ._config import CacheConfig
from ._errors import InvalidTokensError

if TYPE_CHECKING:
    import torch

__all__ = ["KEY_NBYTES", "Namespace", "as_token_array", "page_keys"]

#: Token ids as every method that takes a prompt accepts them (`as_token_array` checks them at
#: run time). Typed, so that a type checker catches a prompt passed as text.
if TYPE_CHECKING:
    TokenIds: TypeAlias = Sequence[int | np.integer[Any]] | np.ndarray[Any, Any] | torch.Tensor
else:
    # torch is not imported with the package: tools that read hints at run time (beartype,
    # typeguard, sphinx) see a tensor as Any rather than fail to resolve the name.
    TokenIds = Union[Sequence[Union[int, np.integer]], np.ndarray, Any]  # noqa: UP007 - 3.10

KEY_NBYTES = 32
_MAX_TOKEN = 2**32 - 1
# Host layouts whose stored page bytes are laid out token-major rather than layer-major; two
# instances that differ here must not share pages, so the order is part of the namespace.
_TOKEN_MAJOR_LAYOUTS = frozenset({"page_first"})
_FINGERPRINT_NBYTES = 16


class Namespace(msgspec.Struct, frozen=True):
    """The seed a key chain starts from, and the fingerprint stored in every page header.

    `seed` is empty for SGLang-compatible keys. `fingerprint` always covers the layout (even
    with an empty seed), so a reader rejects a page written under another layout.

    The tensor-parallel rank is not in the seed: every rank names a prefix with the same keys,
    which is what lets ranks agree on which prefixes to load. It is in `rank_salt`, which
    turns a key into the rank's own storage key, and in the fingerprint. So are the KV heads
    the rank holds, which may differ between ranks. Not for MLA: every
    rank holds the same latent KV, so all ranks (and deployments of any TP size) share one
    namespace and store each page once.
    """

    seed: bytes
    fingerprint: bytes
    rank_salt: bytes = b""

    def __post_init__(self) -> None:
        """Refuse what would only fail later, in every backup (`TypeError` for a field that is
        not `bytes`, `ValueError` for a fingerprint that is not 16 bytes). The seed may be any
        bytes: it only starts the key chain."""
        for name in ("seed", "fingerprint", "rank_salt"):
            value = getattr(self, name)
            if not isinstance(value, bytes):
                raise TypeError(f"Namespace.{name} must be bytes, got {type(value).__name__}")
        if len(self.fingerprint) != _FINGERPRINT_NBYTES:
            raise ValueError(
                f"Namespace.fingerprint must be {_FINGERPRINT_NBYTES} bytes, "
                f"got {len(self.fingerprint)}"
            )

    def storage_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys under which this rank stores `keys` (themselves with one rank)."""
        salt = self.rank_salt
        if not salt:
            return list(keys)
        sha256 = hashlib.sha256
        return [sha256(salt + key).digest() for key in keys]

    @classmethod
    def from_config(cls, config: CacheConfig, *, sglang_compatible: bool = False) -> Namespace:
        """The namespace of a deployment: model, layout, dtype, page size, TP rank/size, salt."""
        layout = config.layout
        fields: dict[str, Any] = {
            "v": 1,
            "model_id": config.model_id,
            "attention": layout.attention,
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "kv_lora_rank": layout.kv_lora_rank,
            "qk_rope_head_dim": layout.qk_rope_head_dim,
            "dtype": layout.dtype,
            "page_size": config.page_size,
            # MLA pages are the same on every rank, whatever the TP size (see the class).
            "tp_size": 1 if layout.attention == "mla" else config.tp_size,
            "salt": config.salt,
            "token_major": config.host_layout in _TOKEN_MAJOR_LAYOUTS,
        }
        digest = hashlib.sha256(msgspec.json.encode(fields, order="sorted")).digest()
        if config.tp_size == 1 or layout.attention == "mla":
            seed = b"" if sglang_compatible else digest
            return cls(seed=seed, fingerprint=digest[:_FINGERPRINT_NBYTES])
        # The heads a rank holds may differ between ranks (5 KV heads over 2 ranks: 3 and 2),
        # and the chain must not: agreements and warmup entries name a prefix by its keys. The
        # fingerprint below still covers them.
        del fields["num_kv_heads"]
        chain = hashlib.sha256(msgspec.json.encode(fields, order="sorted")).digest()
        seed = b"" if sglang_compatible else chain
        rank_salt = b"hicache-tp\x00%d\x00%d\x00" % (config.tp_rank, config.tp_size)
        # The seed goes in too: releases whose seed held the heads stamped pages and manifest
        # entries with `sha256(digest + rank_salt)`, and a warmup of this release must not
        # take their chains (keys it never computes) for its own and fill the host pool with
        # pages no request matches. An empty seed's keys did not change, nor does its
        # fingerprint: those pages stay readable.
        fingerprint = hashlib.sha256(digest + rank_salt + seed).digest()[:_FINGERPRINT_NBYTES]
        return cls(seed=seed, fingerprint=fingerprint, rank_salt=rank_salt)

    @classmethod
    def empty(cls) -> Namespace:
        """No seed and an all-zero fingerprint: raw SGLang-compatible chains (tests, tools)."""
        return cls(seed=b"", fingerprint=bytes(_FINGERPRINT_NBYTES))

    def salted(self, salt: str | bytes) -> Namespace:
        """A namespace for one request's salt: pages under different salts never match.

        Raises `TypeError` unless `salt` is a `str` UTF-8 can encode or `bytes` (an empty one
        is no salt).
        """
        if not isinstance(salt, (str, bytes)):
            # bytes(123) would be 123 zero bytes, and 0 or False no salt at all.
            raise TypeError(f"salt must be a str, bytes or None, got {type(salt).__name__}")
        if not salt:
            return self
        try:
            raw = salt.encode() if isinstance(salt, str) else salt
        except UnicodeEncodeError as exc:
            raise TypeError(
                f"a str salt must be text UTF-8 can encode, got a lone surrogate at {exc.start}"
            ) from None
        # The salt goes in hashed: with a namespace's seed (empty or 32 bytes) the input is 38
        # or 70 bytes, never the 4k or 32 + 4k of a chain step, so no page of any prompt hashes
        # to a salted seed. (Taken whole, a salt of 4 * page_size - 6 bytes made one prompt's
        # unsalted chain, shifted by a page, the salted chain.)
        seed = hashlib.sha256(self.seed + b"\x00salt\x00" + hashlib.sha256(raw).digest()).digest()
        fingerprint = hashlib.sha256(self.fingerprint + raw).digest()[:_FINGERPRINT_NBYTES]
        return Namespace(seed=seed, fingerprint=fingerprint, rank_salt=self.rank_salt)


def _tensor_tokens(tokens: Any) -> np.ndarray[Any, Any]:
    """A torch tensor's token ids as numpy (an empty tensor, of any dtype, as no tokens)."""
    shape = tuple(getattr(tokens, "shape", ()))
    if shape == (0,):
        return np.zeros(0, dtype="<u4")  # `torch.tensor([])` is float32: empty is empty
    if (
        getattr(tokens, "is_floating_point", lambda: False)()
        or getattr(tokens, "is_complex", lambda: False)()
    ):
        kind = getattr(tokens, "dtype", "floating-point")
        raise InvalidTokensError(f"token ids must be integers, got a {kind} tensor")
    array: np.ndarray[Any, Any] = tokens.detach().cpu().numpy()
    return array


def as_token_array(tokens: Sequence[int] | np.ndarray[Any, Any] | Any) -> NDArray[np.uint32]:
    """Validate token ids and return them as a little-endian uint32 array.

    Accepts a sequence of ints (Python or numpy integer scalars), a 1-D integer numpy array or
    a 1-D integer torch tensor. Booleans are refused wherever they appear: a stray `True` is a
    bug upstream, not token 1.
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):
        try:
            tokens = _tensor_tokens(tokens)
        except InvalidTokensError:
            raise
        except Exception as exc:  # sparse, quantized, meta, nested: torch's own errors
            raise InvalidTokensError(
                f"token ids must be a dense 1-D integer tensor holding data, got one with "
                f"layout {getattr(tokens, 'layout', '?')} and dtype "
                f"{getattr(tokens, 'dtype', '?')}: {type(exc).__name__}: {exc}"
            ) from None
    # A memoryview of bytes is bytes as much as bytes is (numpy would read it as small token
    # ids); one of typed items (`array('i')`, an int32 buffer) is a sequence of integers.
    if isinstance(tokens, (str, bytes, bytearray)) or (
        isinstance(tokens, memoryview) and tokens.itemsize == 1
    ):
        raise InvalidTokensError(
            f"token ids must be a sequence of integers, got {type(tokens).__name__}"
        )
    from_array = isinstance(tokens, np.ndarray)
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidTokensError(f"token ids must be a sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise InvalidTokensError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind in "iu":
        if not from_array and not isinstance(tokens, range):
            # numpy turns a bool among ints into 0 or 1 silently: look at the elements.
            _check_element_types(tokens)
        _check_range(int(arr.min()), int(arr.max()))
        result = arr.astype("<u4", copy=False)
        if result is arr and not isinstance(tokens, (list, tuple, range)):
            # Still the caller's buffer: a request keeps its tokens while the caller may
            # reuse that buffer for the next prompt, and its keys stand for these tokens.
            result = result.copy()
        return result
    if arr.dtype == object or (not from_array and arr.dtype.kind == "f"):
        # Mixed Python and numpy ints, or ints past int64 that numpy made floats or objects.
        items = arr.tolist() if arr.dtype == object else list(tokens)
        _check_element_types(items)
        ints = [int(t) for t in items]
        _check_range(min(ints), max(ints))
        return np.asarray(ints, dtype="<u4")
    raise InvalidTokensError(f"token ids must be integers, got dtype {arr.dtype}")


def _check_element_types(items: Any) -> None:
    try:
        kinds = set(map(type, items))
    except TypeError:  # an object with `__array__` but no iteration
        raise InvalidTokensError(
            f"token ids must be a sequence of integers, got {type(items).__name__}"
        ) from None
    for kind in kinds:
        if issubclass(kind, (bool, np.bool_)):
            raise InvalidTokensError("token ids must be integers, got a bool")
        if not issubclass(kind, (int, np.integer)):
            raise InvalidTokensError(f"token ids must be integers, got {kind.__name__}")


def _check_range(low: int, high: int) -> None:
    if low < 0 or high > _MAX_TOKEN:
        raise InvalidTokensError(f"token ids must be in [0, 2**32), got min {low} max {high}")


def page_keys(
    tokens: TokenIds,
    page_size: int,
    seed: bytes = b"",
    *,
    prior: bytes | None = None,
) -> list[bytes]:
    """Keys of every whole page of `tokens` (a short tail page gets none).

    `prior` continues a chain from a known key instead of the seed (for extending a prefix
    without rehashing it).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    data = as_token_array(tokens).tobytes()
    step = page_size * 4
    previous = seed if prior is None else prior
    keys: list[bytes] = []
    sha256 = hashlib.sha256
    for start in range(0, len(data) - step + 1, step):
        hasher = sha256(previous) if previous else sha256()
        hasher.update(data[start : start + step])
        previous = hasher.digest()
        keys.append(previous)
    return keys
