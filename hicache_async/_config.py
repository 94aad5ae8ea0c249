"""Configuration as frozen msgspec Structs, loadable from a dict, JSON or TOML.

Construction validates everything (msgspec checks types on decode; `__post_init__` checks values
and combinations on both paths), and every rejection names the field and the reason.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import stat
import sys
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import msgspec

from ._errors import ConfigError
from ._numbers import as_float

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "AttentionKind",
    "BackupConfig",
    "CacheConfig",
    "DType",
    "EvictionPolicy",
    "HostLayout",
    "KVLayout",
    "MAX_PAGE_TOKENS",
    "MAX_POOL_NBYTES",
    "PrefetchConfig",
    "PrefetchPolicy",
    "WarmupConfig",
    "WritePolicy",
    "load_config",
]

DType = Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8"]
AttentionKind = Literal["mha", "mla"]
HostLayout = Literal["layer_first", "page_first", "page_first_direct"]
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
EvictionPolicy = Literal["lru", "lfu"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
#: Every prefetch policy, for checks of a policy given at run time.
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = get_args(PrefetchPolicy)

_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

_DEVICES = ("auto", "cpu", "cuda")
# torch keeps a device index in 8 signed bits: "cuda:256" would silently be cuda:0.
MAX_DEVICE_INDEX = 127

#: The most bytes one pool may take. No machine holds more (256 TiB), element counts and
#: byte offsets stay far inside int64, and the limit does not depend on the machine a
#: configuration happens to be checked on. Whether a pool fits the memory actually present is
#: checked when it is allocated.
MAX_POOL_NBYTES = 1 << 48

#: The most tokens a page may hold: a stored page records its token count in 32 bits.
MAX_PAGE_TOKENS = (1 << 32) - 1


def _positive(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, f"must be an integer >= 1, got {value!r}")


def _non_negative(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, f"must be an integer >= 0, got {value!r}")


def _within_pool(nbytes: int, factors: list[tuple[str, int]], what: str) -> int:
    """`nbytes` times every factor; the first factor that takes the product past
    `MAX_POOL_NBYTES` is the field the error names."""
    for field, value in factors:
        nbytes *= value
        if nbytes > MAX_POOL_NBYTES:
            raise ConfigError(
                field,
                f"{what} would take {nbytes} bytes, more than the {MAX_POOL_NBYTES} bytes "
                f"({MAX_POOL_NBYTES >> 40} TiB) a pool may take",
            )
    return nbytes


def _times_ratio(count: int, ratio: float) -> int:
    """`count` x `ratio` rounded down, the ratio taken as the decimal it is written as: 90
    device pages x 0.7 are 63 host pages, where the binary product (62.99999999999999) would
    give 62. Or the binary product where it is larger: a ratio computed as a fraction is
    written as a decimal short of it (1/3 as 0.3333333333333333), and 1/3 x 300 device pages
    are the 100 host pages the product gives, not 99."""
    return max(math.floor(Fraction(repr(ratio)) * count), math.floor(ratio * count))


def _finite(field: str, value: object, *, low: float, high: float | None = None) -> float:
    # numbers.Real takes numpy's scalars too (a ratio computed with numpy is one).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    number = as_float(value)
    if not math.isfinite(number):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    if number < low or (high is not None and number > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(field, f"must be {bound}, got {value!r}")
    return number


def _float_field(
    config: msgspec.Struct, name: str, field: str, *, low: float, high: float | None = None
) -> None:
    """Check a float field with `_finite` and store it as a Python float: numpy's float32 or a
    Fraction would otherwise pass and then break `to_dict` (msgspec cannot encode them)."""
    number = _finite(field, getattr(config, name), low=low, high=high)
    msgspec.structs.force_setattr(config, name, number)


def _flag(field: str, value: object) -> None:
    # A string "false" is truthy: from an environment variable it would turn a feature on.
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be a bool (True or False), got {value!r}")


def _text(field: str, value: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(field, f"must be a string, got {type(value).__name__}")
    if not value.isascii():
        # It is hashed or printed as UTF-8 later: a lone surrogate (JSON's "\ud800") would
        # fail there, far from the configuration.
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(
                field, f"must be text UTF-8 can encode, got a lone surrogate at {exc.start}"
            ) from None


def _choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(choice) for choice in choices[:-1])
        raise ConfigError(field, f"must be {listed} or {choices[-1]!r}, got {value!r}")


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape of the KV of one token in one layer.

    MHA keeps separate K and V buffers of `num_kv_heads x head_dim`; MLA keeps one latent
    buffer of `kv_lora_rank + qk_rope_head_dim` per token.
    """

    num_layers: int
    attention: AttentionKind = "mha"
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    dtype: DType = "float16"

    def __post_init__(self) -> None:
        _positive("layout.num_layers", self.num_layers)
        _choice("layout.attention", self.attention, ("mha", "mla"))
        _choice("layout.dtype", self.dtype, get_args(DType))
        # Every size field is an int, also those the other attention kind leaves 0 (a 0.0 or
        # False there would pass as 0 and then fail `from_dict(to_dict())`).
        for name in ("num_kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim"):
            _non_negative(f"layout.{name}", getattr(self, name))
        if self.attention == "mha":
            _positive("layout.num_kv_heads", self.num_kv_heads)
            _positive("layout.head_dim", self.head_dim)
            for name in ("kv_lora_rank", "qk_rope_head_dim"):
                if getattr(self, name):
                    raise ConfigError(
                        f"layout.{name}", "applies only to attention='mla'; leave it 0 for mha"
                    )
        else:
            _positive("layout.kv_lora_rank", self.kv_lora_rank)
            for name in ("num_kv_heads", "head_dim"):
                if getattr(self, name):
                    raise ConfigError(
                        f"layout.{name}",
                        "applies only to attention='mha'; MLA uses kv_lora_rank + qk_rope_head_dim",
                    )
        # A layout whose single token overflows a pool can never be allocated.
        factors = [("layout.num_layers", self.num_layers)]
        if self.attention == "mha":
            factors += [
                ("layout.num_kv_heads", self.num_kv_heads),
                ("layout.head_dim", self.head_dim),
            ]
        else:
            widest = (
                "layout.kv_lora_rank"
                if self.kv_lora_rank >= self.qk_rope_head_dim
                else "layout.qk_rope_head_dim"
            )
            factors.append((widest, self.kv_lora_rank + self.qk_rope_head_dim))
        _within_pool(self.itemsize * self.num_buffers, factors, "one token")

    @property
    def num_buffers(self) -> int:
        """2 for MHA (K and V), 1 for MLA (the latent)."""
        return 2 if self.attention == "mha" else 1

    @property
    def token_shape(self) -> tuple[int, int]:
        """(heads, width) of one token in one layer and buffer."""
        if self.attention == "mha":
            return (self.num_kv_heads, self.head_dim)
        return (1, self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def token_layer_nbytes(self) -> int:
        """Bytes of one token in one layer and one buffer."""
        heads, width = self.token_shape
        return heads * width * self.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token across every layer and buffer."""
        return self.token_layer_nbytes * self.num_layers * self.num_buffers

    def page_nbytes(self, page_size: int) -> int:
        """Bytes of one page across every layer and buffer."""
        return self.token_nbytes * page_size


class PrefetchConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Storage → host prefetch settings (policies as in SGLang HiCache)."""

    # `timeout` by default: an awaited `prefetch()` gets what storage can deliver within a
    # bounded wait; `best_effort` suits callers that start early and collect at scheduling.
    policy: PrefetchPolicy = "timeout"
    timeout_base_s: float = 1.0
    timeout_per_1k_tokens_s: float = 0.25
    timeout_max_s: float = 10.0
    threshold_tokens: int = 256
    max_host_share: float = 0.5
    batch_pages: int = 64
    queue_size: int = 64
    workers: int = 4
    #: A storage call that takes longer is abandoned and counted as an error (a hung backend
    #: must not hold a worker and its host pages forever).
    io_timeout_s: float = 10.0
    #: A page whose read failed (`ERROR`, or a call that raised or timed out) is taken as a
    #: miss, without a read, by prefetches planned this long after the failure: a failing or
    #: hanging store then costs one read of such a page per window, not one per prefetch.
    #: 0: every prefetch reads it again.
    failed_read_window_s: float = 2.0
    #: How many such pages are remembered at most (the oldest failure is forgotten first; of a
    #: larger failed batch, its first pages). 0: none.
    failed_read_keys: int = 4096

    def __post_init__(self) -> None:
        _choice("prefetch.policy", self.policy, PREFETCH_POLICIES)
        for name in ("timeout_base_s", "timeout_per_1k_tokens_s", "timeout_max_s"):
            _float_field(self, name, f"prefetch.{name}", low=0.0)
        if self.timeout_max_s < self.timeout_base_s:
            raise ConfigError("prefetch.timeout_max_s", "must be >= prefetch.timeout_base_s")
        _non_negative("prefetch.threshold_tokens", self.threshold_tokens)
        _float_field(self, "max_host_share", "prefetch.max_host_share", low=0.0, high=1.0)
        _positive("prefetch.batch_pages", self.batch_pages)
        _positive("prefetch.queue_size", self.queue_size)
        _positive("prefetch.workers", self.workers)
        _float_field(self, "io_timeout_s", "prefetch.io_timeout_s", low=0.001)
        _float_field(self, "failed_read_window_s", "prefetch.failed_read_window_s", low=0.0)
        _non_negative("prefetch.failed_read_keys", self.failed_read_keys)

    def timeout_for(self, num_tokens: int) -> float:
        """The `timeout` policy's wait for a prefetch of `num_tokens` tokens."""
        wait = self.timeout_base_s + self.timeout_per_1k_tokens_s * num_tokens / 1000.0
        return min(wait, self.timeout_max_s)


class BackupConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Host → storage backup settings."""

    queue_size: int = 256
    batch_pages: int = 64
    max_retries: int = 3
    retry_backoff_s: float = 0.05
    flush_deadline_s: float = 10.0
    io_timeout_s: float = 30.0
    #: Before each batch, ask storage (one `exists` per chain) whether the prefix above each
    #: job is still there, and write again what it lost and this instance still holds.
    check_prefix: bool = True
    #: A chain found whole this recently is asked about only below that part, each part
    #: counted from when it was itself asked about (so a conversation still going on asks
    #: about its whole history once per interval). The asking is also what keeps a hot
    #: prefix in a store that evicts by use: a store that cycles through its whole capacity
    #: faster than this may evict one.
    check_prefix_interval_s: float = 2.0
    #: Before writing, ask storage (one `exists` per chain) which of the batch's pages it
    #: holds already (another instance stored them, or this one before its tree forgot
    #: them), and write only the others. Left out for a backend whose put already moves
    #: nothing for them (`StorageCapabilities.put_skips_stored`: file, memory, Mooncake).
    skip_stored: bool = True

    def __post_init__(self) -> None:
        _positive("backup.queue_size", self.queue_size)
        _positive("backup.batch_pages", self.batch_pages)
        _non_negative("backup.max_retries", self.max_retries)
        _float_field(self, "retry_backoff_s", "backup.retry_backoff_s", low=0.0)
        _float_field(self, "flush_deadline_s", "backup.flush_deadline_s", low=0.0)
        _float_field(self, "io_timeout_s", "backup.io_timeout_s", low=0.001)
        _flag("backup.check_prefix", self.check_prefix)
        _float_field(self, "check_prefix_interval_s", "backup.check_prefix_interval_s", low=0.0)
        _flag("backup.skip_stored", self.skip_stored)


class WarmupConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Cold-start warmup from shared storage into the host pool."""

    enabled: bool = False
    ratio: float = 0.5
    deadline_s: float = 60.0

    def __post_init__(self) -> None:
        _flag("warmup.enabled", self.enabled)
        _float_field(self, "ratio", "warmup.ratio", low=0.0, high=1.0)
        _float_field(self, "deadline_s", "warmup.deadline_s", low=0.0)


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything a `HiCache` needs to know.

    `host_pages` and `host_ratio` are alternatives: give at most one; with neither, the host
    pool is twice the device pool.
    """

    layout: KVLayout
    device_pages: int
    page_size: int = 64
    host_pages: int | None = None
    host_ratio: float | None = None
    host_layout: HostLayout = "layer_first"
    write_policy: WritePolicy = "write_through"
    write_through_threshold: int = 2
    eviction: EvictionPolicy = "lru"
    model_id: str = ""
    salt: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    device: str = "auto"
    storage: str | None = None
    #: A file holding the secret shared by trusted instances; when set, every stored page
    #: carries a keyed MAC and pages without a valid one are misses. The file must not be
    #: readable by group or others.
    mac_key_file: str | None = None
    prefetch: PrefetchConfig = PrefetchConfig()
    backup: BackupConfig = BackupConfig()
    warmup: WarmupConfig = WarmupConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError("layout", "must be a KVLayout")
        for name, kind in (
            ("prefetch", PrefetchConfig),
            ("backup", BackupConfig),
            ("warmup", WarmupConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(name, f"must be a {kind.__name__} (use from_dict for mappings)")
        for name in ("storage", "mac_key_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(name, f"must be a string or None, got {type(value).__name__}")
        for name in ("model_id", "salt", "device"):
            _text(name, getattr(self, name))
        _positive("page_size", self.page_size)
        _positive("device_pages", self.device_pages)
        # Before anything multiplies device_pages by a float (a huge int cannot become one).
        page_nbytes = self._check_device_pool()
        if self.host_pages is not None and self.host_ratio is not None:
            raise ConfigError("host_pages", "give host_pages or host_ratio, not both")
        if self.host_pages is not None:
            _positive("host_pages", self.host_pages)
        if self.host_ratio is not None:
            _float_field(self, "host_ratio", "host_ratio", low=0.0)
            # The product can overflow to inf (1e308 x 10), which no page count converts from.
            if not math.isfinite(self.host_ratio * self.device_pages):
                raise ConfigError(
                    "host_ratio",
                    f"host_ratio x device_pages is too large a host pool, got {self.host_ratio!r}",
                )
            if _times_ratio(self.device_pages, self.host_ratio) < 1:
                raise ConfigError(
                    "host_ratio", "host_ratio x device_pages must give at least one host page"
                )
        _within_pool(
            page_nbytes, [(self._host_pages_field, self.resolved_host_pages)], "the host pool"
        )
        _choice("host_layout", self.host_layout, get_args(HostLayout))
        _choice("write_policy", self.write_policy, get_args(WritePolicy))
        _positive("write_through_threshold", self.write_through_threshold)
        _choice("eviction", self.eviction, get_args(EvictionPolicy))
        _positive("tp_size", self.tp_size)
        _non_negative("tp_rank", self.tp_rank)
        if self.tp_rank >= self.tp_size:
            raise ConfigError("tp_rank", f"must be < tp_size ({self.tp_size}), got {self.tp_rank}")
        base, colon, index = self.device.partition(":")
        # An index is ASCII digits (str.isdigit() also takes "²") without leading zeros,
        # as torch parses it, and within what torch can hold.
        if base not in _DEVICES or (
            colon
            and (
                base != "cuda"
                or not (index.isascii() and index.isdigit())
                or len(index) > 3
                or (index != "0" and index.startswith("0"))
                or int(index) > MAX_DEVICE_INDEX
            )
        ):
            raise ConfigError(
                "device",
                f"must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N from 0 to {MAX_DEVICE_INDEX}, "
                f"no leading zeros), got {self.device!r}",
            )

    def _check_device_pool(self) -> int:
        """The bytes of one page, once the page and the device pool are known to be sizes a
        machine can hold: refused here, not as a torch error when the cache opens."""
        if self.page_size > MAX_PAGE_TOKENS:
            raise ConfigError(
                "page_size",
                f"must be <= {MAX_PAGE_TOKENS} (a stored page records its token count in 32 "
                f"bits), got {self.page_size}",
            )
        page_nbytes = _within_pool(
            self.layout.token_nbytes, [("page_size", self.page_size)], "a page"
        )
        _within_pool(page_nbytes, [("device_pages", self.device_pages)], "the device pool")
        return page_nbytes

    @property
    def resolved_host_pages(self) -> int:
        """Size of the host pool in pages."""
        if self.host_pages is not None:
            return self.host_pages
        ratio = 2.0 if self.host_ratio is None else self.host_ratio
        return max(1, _times_ratio(self.device_pages, ratio))

    @property
    def _host_pages_field(self) -> str:
        """The field that sizes the host pool, for errors about its size."""
        if self.host_pages is not None:
            return "host_pages"
        if self.host_ratio is not None:
            return "host_ratio"
        return "device_pages"  # the host pool defaults to twice the device pool

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across every layer and buffer."""
        return self.layout.page_nbytes(self.page_size)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheConfig:
        """Build from a mapping (as parsed from JSON or TOML), checked as direct construction
        checks it: the same numbers taken, the same errors for refused values."""
        return _convert(data, cls)

    @classmethod
    def from_json(cls, text: str | bytes) -> CacheConfig:
        """Build from a JSON document (str, or UTF-8 bytes)."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise ConfigError(
                "$", f"a JSON document (str or bytes) is required, not {type(text).__name__}"
            )
        try:
            data = json.loads(text)
        except RecursionError:
            raise ConfigError("$", "not valid JSON: nested too deeply") from None
        except ValueError as exc:
            # Also bytes that are not UTF-8 and integers past Python's digit limit.
            raise ConfigError("$", f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("$", "a JSON object is required")
        return cls.from_dict(data)

    @classmethod
    def from_toml(cls, text: str | bytes) -> CacheConfig:
        """Build from a TOML document (str, or UTF-8 bytes)."""
        if isinstance(text, (bytes, bytearray)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError("$", f"not valid TOML: not UTF-8 ({exc.reason})") from None
        if not isinstance(text, str):
            raise ConfigError(
                "$", f"a TOML document (str or bytes) is required, not {type(text).__name__}"
            )
        try:
            data = tomllib.loads(text)
        except RecursionError:
            raise ConfigError("$", "not valid TOML: nested too deeply") from None
        except ValueError as exc:  # TOMLDecodeError, and integers past the digit limit
            raise ConfigError("$", f"not valid TOML: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain builtins (round-trips through `from_dict`)."""
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result


_T = TypeVar("_T", bound=msgspec.Struct)


def _prepared(data: Mapping[str, Any], cls: type[msgspec.Struct], prefix: str) -> dict[str, Any]:
    """`data` as a dict msgspec can convert to `cls`, checked as direct construction checks it
    where msgspec would differ: a choice field's error names the accepted values (msgspec's
    says only "Invalid enum value"), and a float field takes any finite real number, a
    Fraction or a numpy scalar too (msgspec takes only int and float). Names `cls` does not
    have are left for msgspec to refuse."""
    hints = get_type_hints(cls)
    result: dict[Any, Any] = dict(data)  # parsed input: keys need not be strings
    for name, value in result.items():
        if not isinstance(name, str):
            continue  # msgspec refuses it, naming where
        hint = hints.get(name)
        field = prefix + name
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            if isinstance(value, Mapping):
                result[name] = _prepared(value, hint, f"{field}.")
        elif get_origin(hint) is Literal:
            _choice(field, value, get_args(hint))
        elif float in (hint, *get_args(hint)) and value is not None:
            # Stored as a float, as `_float_field` stores what direct construction is given.
            result[name] = _finite(field, value, low=-math.inf)
    return result


def _convert(data: Mapping[str, Any], cls: type[_T]) -> _T:
    if not isinstance(data, Mapping):
        raise ConfigError("$", f"a mapping is required, got {type(data).__name__}")
    try:
        return msgspec.convert(_prepared(data, cls, ""), cls)
    except ConfigError:
        raise
    except msgspec.ValidationError as exc:
        original = exc.__cause__ or exc.__context__
        if isinstance(original, ConfigError):
            raise original from None
        message = str(exc)
        field = "$"
        marker = " - at `$."
        if marker in message:
            message, _, rest = message.partition(marker)
            field = rest.rstrip("`")
        raise ConfigError(field, message) from None


def load_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> CacheConfig:
    """Load a `CacheConfig` from a mapping, or a `.json` / `.toml` file path (str or
    `os.PathLike`)."""
    if isinstance(source, Mapping):
        return CacheConfig.from_dict(source)
    if not isinstance(source, (str, os.PathLike)) or isinstance(os.fspath(source), bytes):
        raise ConfigError(
            "$",
            "load_config takes a mapping or the path (str or os.PathLike) of a .json or .toml "
            f"file, not {type(source).__name__}",
        )
    if isinstance(source, str) and (source.lstrip().startswith(("{", "[")) or "\n" in source):
        # Text, not a path: its "suffix" would make a baffling message.
        raise ConfigError(
            "$",
            "load_config takes a mapping or the path of a .json or .toml file, not the "
            "document's text; for text use CacheConfig.from_json or CacheConfig.from_toml",
        )
    path = Path(source)
    if path.suffix not in (".toml", ".json"):
        raise ConfigError("$", f"unknown config file type {path.suffix!r}; use .json or .toml")
    data, _ = read_regular_file(path, "$", _MAX_CONFIG_BYTES)
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError("$", f"{path} is larger than {_MAX_CONFIG_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("$", f"{path} is not UTF-8 text") from None
    if path.suffix == ".toml":
        return CacheConfig.from_toml(text)
    return CacheConfig.from_json(text)


_MAX_CONFIG_BYTES = 16 << 20


def read_regular_file(
    path: str | os.PathLike[str], field: str, limit: int
) -> tuple[bytes, os.stat_result]:
    """Up to `limit` + 1 bytes of the regular file at `path`, and its status; anything that
    keeps it from being read (a path with a NUL or that cannot be encoded, a missing file, a
    FIFO, a device, a directory) is a `ConfigError` naming `field`."""
    # Non-blocking open and a regular-file check: a FIFO or a device at the path would
    # otherwise block the caller for ever or stream without end.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror}") from None
    except ValueError:  # an embedded NUL, or text the file system encoding cannot hold
        raise ConfigError(
            field, f"{os.fspath(path)!r} is not a usable path (NUL or unencodable characters)"
        ) from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ConfigError(field, f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(limit + 1)
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return data, status
