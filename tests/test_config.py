from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from hicache_async import (
    BackupConfig,
    CacheConfig,
    ConfigError,
    KVLayout,
    PrefetchConfig,
    WarmupConfig,
    load_config,
)
from hicache_async._config import MAX_PAGE_TOKENS, MAX_POOL_NBYTES

MHA = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 8}


def test_defaults_and_derived_sizes() -> None:
    cfg = CacheConfig(layout=KVLayout(**MHA), device_pages=10)
    assert cfg.resolved_host_pages == 20
    assert cfg.page_nbytes == 64 * 4 * 2 * 2 * 8 * 2
    assert (
        CacheConfig(layout=KVLayout(**MHA), device_pages=10, host_ratio=3.5).resolved_host_pages
        == 35
    )


@pytest.mark.parametrize(
    ("device_pages", "host_ratio", "host_pages"),
    [(90, 0.7, 63), (10, 2.3, 23), (100, 0.29, 29), (1000, 0.07, 70), (3, 1.5, 4), (7, 1 / 3, 2)],
)
def test_host_ratio_gives_the_pages_its_decimal_says(
    device_pages: int, host_ratio: float, host_pages: int
) -> None:
    # 90 x 0.7 is 62.99999999999999 in binary floating point: rounded down, a page short.
    for config in (
        CacheConfig(layout=KVLayout(**MHA), device_pages=device_pages, host_ratio=host_ratio),
        CacheConfig.from_json(
            f'{{"layout": {json.dumps(MHA)}, "device_pages": {device_pages}, '
            f'"host_ratio": {host_ratio!r}}}'
        ),
    ):
        assert config.resolved_host_pages == host_pages


@pytest.mark.parametrize(
    ("device_pages", "host_ratio", "host_pages"),
    [(300, 1 / 3, 100), (300, 2 / 3, 200), (700, 1 / 7, 100), (3, 1 / 3, 1), (3, 2 / 3, 2)],
)
def test_a_host_ratio_computed_as_a_fraction_gives_the_pages_of_its_product(
    device_pages: int, host_ratio: float, host_pages: int
) -> None:
    # 1/3 is written as 0.3333333333333333, whose decimal x 300 is 99.99999999999999: taken
    # alone, a page short of the product, and 1/3 x 3 device pages was refused as no page.
    config = CacheConfig(layout=KVLayout(**MHA), device_pages=device_pages, host_ratio=host_ratio)
    assert config.resolved_host_pages == host_pages


def test_mla_layout_is_one_latent_buffer() -> None:
    layout = KVLayout(num_layers=3, attention="mla", kv_lora_rank=512, qk_rope_head_dim=64)
    assert layout.num_buffers == 1
    assert layout.token_shape == (1, 576)
    assert layout.token_nbytes == 3 * 576 * 2


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"layout": {**MHA, "num_layers": 0}, "device_pages": 4}, "layout.num_layers"),
        ({"layout": {**MHA, "num_layers": "x"}, "device_pages": 4}, "layout.num_layers"),
        ({"layout": MHA, "device_pages": 0}, "device_pages"),
        ({"layout": MHA, "device_pages": 4, "host_pages": 4, "host_ratio": 2.0}, "host_pages"),
        ({"layout": MHA, "device_pages": 4, "host_layout": "diagonal"}, "host_layout"),
        ({"layout": MHA, "device_pages": 4, "write_policy": "sometimes"}, "write_policy"),
        ({"layout": MHA, "device_pages": 4, "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"layout": MHA, "device_pages": 4, "device": "tpu"}, "device"),
        ({"layout": MHA, "device_pages": 4, "device": "cuda:"}, "device"),
        ({"layout": MHA, "device_pages": 4, "device": "cuda:\u00b2"}, "device"),
        # host_ratio x device_pages overflows to inf: an error naming the field, not OverflowError.
        ({"layout": MHA, "device_pages": 10, "host_ratio": 1e308}, "host_ratio"),
        ({"layout": {**MHA, "kv_lora_rank": 4}, "device_pages": 4}, "layout.kv_lora_rank"),
        (
            {"layout": {"num_layers": 2, "attention": "mla"}, "device_pages": 4},
            "layout.kv_lora_rank",
        ),
        # A field of the other attention kind: the error names the one set.
        ({"layout": {**MHA, "qk_rope_head_dim": 64}, "device_pages": 4}, "layout.qk_rope_head_dim"),
        (
            {
                "layout": {"num_layers": 2, "attention": "mla", "kv_lora_rank": 8, "head_dim": 64},
                "device_pages": 4,
            },
            "layout.head_dim",
        ),
        (
            {
                "layout": {
                    "num_layers": 2,
                    "attention": "mla",
                    "kv_lora_rank": 8,
                    "num_kv_heads": 2,
                },
                "device_pages": 4,
            },
            "layout.num_kv_heads",
        ),
        (
            {"layout": MHA, "device_pages": 4, "prefetch": {"max_host_share": 1.5}},
            "prefetch.max_host_share",
        ),
        (
            {"layout": MHA, "device_pages": 4, "prefetch": {"timeout_base_s": float("nan")}},
            "prefetch.timeout_base_s",
        ),
        (
            {"layout": MHA, "device_pages": 4, "backup": {"check_prefix_interval_s": -1}},
            "backup.check_prefix_interval_s",
        ),
        (
            {"layout": MHA, "device_pages": 4, "prefetch": {"failed_read_window_s": -0.5}},
            "prefetch.failed_read_window_s",
        ),
        (
            {"layout": MHA, "device_pages": 4, "prefetch": {"failed_read_window_s": float("inf")}},
            "prefetch.failed_read_window_s",
        ),
        (
            {"layout": MHA, "device_pages": 4, "prefetch": {"failed_read_keys": -1}},
            "prefetch.failed_read_keys",
        ),
        (
            {"layout": MHA, "device_pages": 4, "prefetch": {"failed_read_keys": 1.5}},
            "prefetch.failed_read_keys",
        ),
    ],
)
def test_invalid_values_name_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(data)
    assert info.value.field == field
    assert field in str(info.value)


# 256-byte tokens and 64-token pages: 2**14 bytes a page, so 2**34 pages fill the bound.
POOL_PAGES = MAX_POOL_NBYTES // (64 * 256)


@pytest.mark.parametrize(
    ("data", "field", "needle"),
    [
        ({"device_pages": POOL_PAGES + 1, "host_pages": 1}, "device_pages", "device pool"),
        ({"device_pages": 4, "host_pages": POOL_PAGES + 1}, "host_pages", "host pool"),
        ({"device_pages": 4, "host_ratio": POOL_PAGES / 2}, "host_ratio", "host pool"),
        # The host pool defaults to twice the device pool: the device pages are what to change.
        ({"device_pages": POOL_PAGES // 2 + 1}, "device_pages", "host pool"),
        ({"device_pages": 1, "page_size": MAX_PAGE_TOKENS + 1}, "page_size", "32 bits"),
        (
            {"device_pages": 1, "page_size": 2**21 + 1, "layout": {**MHA, "num_kv_heads": 2**20}},
            "page_size",
            "a page",
        ),
        (
            {"device_pages": 1, "layout": {**MHA, "num_kv_heads": MAX_POOL_NBYTES}},
            "layout.num_kv_heads",
            "one token",
        ),
        (
            {
                "device_pages": 1,
                "layout": {
                    "num_layers": 1,
                    "attention": "mla",
                    "kv_lora_rank": 1,
                    "qk_rope_head_dim": MAX_POOL_NBYTES,
                },
            },
            "layout.qk_rope_head_dim",
            "one token",
        ),
    ],
)
def test_pools_past_the_bound_name_the_field(
    data: dict[str, object], field: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"layout": MHA, **data})
    assert info.value.field == field
    assert needle in info.value.reason


def test_pools_up_to_the_bound_are_accepted() -> None:
    config = CacheConfig(layout=KVLayout(**MHA), device_pages=POOL_PAGES, host_pages=POOL_PAGES)
    assert config.device_pages * config.page_nbytes == MAX_POOL_NBYTES
    assert CacheConfig(layout=KVLayout(**MHA), device_pages=POOL_PAGES // 2).resolved_host_pages
    assert CacheConfig(layout=KVLayout(**MHA), device_pages=1, page_size=MAX_PAGE_TOKENS)


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        CacheConfig.from_dict({"layout": MHA, "device_pages": 4, "bogus": 1})


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError) as info:
        KVLayout(num_layers=2, num_kv_heads=0, head_dim=4)
    assert info.value.field == "layout.num_kv_heads"
    with pytest.raises(ConfigError) as info:
        CacheConfig(layout=KVLayout(**MHA), device_pages=10, host_ratio=1e308)
    assert info.value.field == "host_ratio"


def test_round_trip_dict_json_toml(tmp_path: Path) -> None:
    cfg = CacheConfig(
        layout=KVLayout(**MHA, dtype="bfloat16"),
        device_pages=8,
        host_pages=32,
        host_layout="page_first_direct",
        write_policy="write_through_selective",
        write_through_threshold=3,
        eviction="lfu",
        model_id="m",
        salt="s",
    )
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg
    assert CacheConfig.from_json(json.dumps(cfg.to_dict())) == cfg
    toml_path = tmp_path / "c.toml"
    toml_path.write_text(
        'device_pages = 8\nhost_pages = 32\nhost_layout = "page_first_direct"\n'
        'write_policy = "write_through_selective"\nwrite_through_threshold = 3\n'
        'eviction = "lfu"\nmodel_id = "m"\nsalt = "s"\n'
        '[layout]\nnum_layers = 4\nnum_kv_heads = 2\nhead_dim = 8\ndtype = "bfloat16"\n'
    )
    assert load_config(toml_path) == cfg
    json_path = tmp_path / "c.json"
    json_path.write_bytes(msgspec.json.encode(cfg))
    assert load_config(json_path) == cfg


def test_bad_documents() -> None:
    with pytest.raises(ConfigError, match="JSON"):
        CacheConfig.from_json("{not json")
    with pytest.raises(ConfigError, match="TOML"):
        CacheConfig.from_toml("= nope")
    with pytest.raises(ConfigError, match="object"):
        CacheConfig.from_json("[1, 2]")
    with pytest.raises(ConfigError, match="unknown config file type"):
        load_config("config.yaml")
    # The text of a document, not its path: the message says where text goes.
    for text in ('{"page_size": 64, "x": 1.0}', "page_size = 64\ndevice_pages = 8\n"):
        with pytest.raises(
            ConfigError, match=re.escape("CacheConfig.from_json or CacheConfig.from_toml")
        ):
            load_config(text)


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (CacheConfig.from_json, "[" * 100_000),
        (CacheConfig.from_json, '{"page_size": 1' + "0" * 5000 + "}"),
        (CacheConfig.from_json, b'{"page_size": "\xff"}'),
        (CacheConfig.from_toml, "a = " + "[" * 100_000),
        (CacheConfig.from_toml, "page_size = 1" + "0" * 5000),
    ],
    ids=["json-deep", "json-digits", "json-not-utf8", "toml-deep", "toml-digits"],
)
def test_documents_past_the_parsers_limits_are_config_errors(
    parse: Callable[[Any], CacheConfig], text: str | bytes
) -> None:
    # They raised RecursionError or ValueError, not the HiCacheError the docs promise.
    with pytest.raises(ConfigError, match="not valid"):
        parse(text)


def test_load_config_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # opening it to read blocked until a writer came: for ever
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(tmp_path / "dir.toml")
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate((16 << 20) + 1)
    with pytest.raises(ConfigError, match="larger than 16 MiB"):
        load_config(big)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")


def test_timeout_policy_is_capped() -> None:
    cfg = CacheConfig.from_dict(
        {"layout": MHA, "device_pages": 4, "prefetch": {"policy": "timeout", "timeout_max_s": 2.0}}
    )
    assert cfg.prefetch.timeout_for(0) == pytest.approx(1.0)
    assert cfg.prefetch.timeout_for(2000) == pytest.approx(1.5)
    assert cfg.prefetch.timeout_for(100_000) == pytest.approx(2.0)


# -- field types: what construction takes must survive `from_dict(to_dict())` -----------------


def _cache(**fields: Any) -> CacheConfig:
    return CacheConfig(layout=KVLayout(**MHA), device_pages=4, **fields)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        # A str "false" (from an environment variable, say) is truthy: warmup would run.
        (lambda: WarmupConfig(enabled="false"), "warmup.enabled"),
        (lambda: WarmupConfig(enabled=1), "warmup.enabled"),
        (lambda: WarmupConfig(enabled=None), "warmup.enabled"),
        (lambda: WarmupConfig(enabled=np.True_), "warmup.enabled"),
        (lambda: WarmupConfig(deadline_s=10**400), "warmup.deadline_s"),
        (lambda: BackupConfig(check_prefix="false"), "backup.check_prefix"),
        (lambda: BackupConfig(check_prefix=0), "backup.check_prefix"),
        (lambda: BackupConfig(skip_stored="false"), "backup.skip_stored"),
        (lambda: BackupConfig(skip_stored=1), "backup.skip_stored"),
        (lambda: PrefetchConfig(policy=["timeout"]), "prefetch.policy"),
        (lambda: PrefetchConfig(policy=None), "prefetch.policy"),
        (lambda: KVLayout(**MHA, dtype=["float16"]), "layout.dtype"),
        (lambda: KVLayout(**MHA, dtype=None), "layout.dtype"),
        (lambda: KVLayout(**MHA, attention=None), "layout.attention"),
        (lambda: KVLayout(**MHA, kv_lora_rank=0.0), "layout.kv_lora_rank"),
        (lambda: KVLayout(**MHA, qk_rope_head_dim=False), "layout.qk_rope_head_dim"),
        (
            lambda: KVLayout(num_layers=2, attention="mla", kv_lora_rank=8, head_dim=0.0),
            "layout.head_dim",
        ),
        (lambda: _cache(model_id=5), "model_id"),
        (lambda: _cache(model_id=None), "model_id"),
        (lambda: _cache(salt=b"x"), "salt"),
        (lambda: _cache(device=None), "device"),
        (lambda: _cache(device=5), "device"),
        (lambda: _cache(host_layout=None), "host_layout"),
        (lambda: _cache(write_policy=b"write_back"), "write_policy"),
        (lambda: _cache(eviction=["lru"]), "eviction"),
        (lambda: _cache(host_ratio=Fraction(10**400, 3)), "host_ratio"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_config_error(build: Callable[[], Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.field == field


SECTIONS: list[Any] = [
    KVLayout(**MHA, dtype="bfloat16"),
    KVLayout(num_layers=3, attention="mla", kv_lora_rank=512, qk_rope_head_dim=64),
    # Numbers of other types where a float goes: numpy's, an int, a Fraction.
    PrefetchConfig(
        policy="wait_complete",
        timeout_base_s=np.float32(0.5),
        timeout_per_1k_tokens_s=1,
        timeout_max_s=Fraction(3, 2),
        max_host_share=np.float64(0.25),
        io_timeout_s=np.int64(2),
    ),
    BackupConfig(
        check_prefix=False,
        retry_backoff_s=np.float16(0.5),
        check_prefix_interval_s=0,
        skip_stored=False,
    ),
    WarmupConfig(enabled=True, ratio=Fraction(1, 4), deadline_s=np.float32(1.5)),
]


@pytest.mark.parametrize("section", SECTIONS, ids=lambda section: type(section).__name__)
def test_every_section_built_directly_round_trips(section: Any) -> None:
    data = msgspec.to_builtins(section)
    assert msgspec.convert(data, type(section)) == section
    assert json.loads(json.dumps(data)) == data


def test_a_config_built_directly_round_trips_through_its_dict() -> None:
    layout, mla, prefetch, backup, warmup = SECTIONS
    for chosen in (layout, mla):
        config = CacheConfig(
            layout=chosen,
            device_pages=4,
            host_ratio=np.float32(1.5),
            model_id="model",
            salt="salt",
            device="cpu",
            prefetch=prefetch,
            backup=backup,
            warmup=warmup,
        )
        assert CacheConfig.from_dict(config.to_dict()) == config
        assert CacheConfig.from_json(json.dumps(config.to_dict())) == config
        assert type(config.host_ratio) is float


# -- a mapping is checked as direct construction checks ------------------------------------------

CHOICES: list[tuple[str, tuple[str, ...]]] = [
    ("host_layout", ("layer_first", "page_first", "page_first_direct")),
    ("write_policy", ("write_through", "write_through_selective", "write_back")),
    ("eviction", ("lru", "lfu")),
    ("prefetch.policy", ("best_effort", "wait_complete", "timeout")),
    ("layout.attention", ("mha", "mla")),
    ("layout.dtype", ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8")),
]


def _with(field: str, value: object) -> dict[str, Any]:
    """A valid mapping with `field` (dotted for a section) set to `value`."""
    data: dict[str, Any] = {"layout": dict(MHA), "device_pages": 4}
    section, _, name = field.rpartition(".")
    if section:
        data.setdefault(section, {})[name] = value
    else:
        data[name] = value
    return data


def _direct(data: dict[str, Any]) -> CacheConfig:
    sections = {"prefetch": PrefetchConfig, "backup": BackupConfig, "warmup": WarmupConfig}
    fields = {name: sections[name](**value) for name, value in data.items() if name in sections}
    rest = {name: value for name, value in data.items() if name not in sections}
    return CacheConfig(**{**rest, "layout": KVLayout(**data["layout"]), **fields})


@pytest.mark.parametrize(("field", "choices"), CHOICES, ids=[field for field, _ in CHOICES])
@pytest.mark.parametrize("value", ["x", 5])
def test_a_choice_refused_in_a_mapping_names_its_values_as_direct_construction_does(
    field: str, choices: tuple[str, ...], value: object
) -> None:
    data = _with(field, value)
    with pytest.raises(ConfigError) as direct:
        _direct(data)
    for load in (
        CacheConfig.from_dict,
        load_config,
        lambda d: CacheConfig.from_json(json.dumps(d)),
    ):
        with pytest.raises(ConfigError) as mapped:
            load(data)
        assert (mapped.value.field, mapped.value.reason) == (field, direct.value.reason)
    listed = ", ".join(repr(choice) for choice in choices[:-1])
    assert direct.value.reason == f"must be {listed} or {choices[-1]!r}, got {value!r}"


FLOATS = [
    "host_ratio",
    "prefetch.timeout_base_s",
    "prefetch.failed_read_window_s",
    "prefetch.max_host_share",
    "backup.retry_backoff_s",
    "warmup.ratio",
]


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize(
    "value",
    [Fraction(1, 2), np.float32(0.5), np.float64(0.5), np.int64(1), 1],
    ids=["Fraction", "float32", "float64", "int64", "int"],
)
def test_a_mapping_takes_every_finite_number_direct_construction_takes(
    field: str, value: object
) -> None:
    data = _with(field, value)
    config = CacheConfig.from_dict(data)
    assert config == _direct(data)
    section, _, name = field.rpartition(".")
    stored = getattr(getattr(config, section) if section else config, name)
    assert type(stored) is float
    assert stored == float(value)  # type: ignore[arg-type]
    assert CacheConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "value", [Fraction(10**400, 3), float("inf"), "0.5", True], ids=["huge", "inf", "str", "bool"]
)
def test_a_number_refused_in_a_mapping_is_refused_as_direct_construction_refuses_it(
    value: object,
) -> None:
    data = _with("prefetch.timeout_base_s", value)
    with pytest.raises(ConfigError) as direct:
        _direct(data)
    with pytest.raises(ConfigError) as mapped:
        CacheConfig.from_dict(data)
    assert (mapped.value.field, mapped.value.reason) == (direct.value.field, direct.value.reason)


@pytest.mark.parametrize("value", [np.int64(4), 4.0, True], ids=["int64", "float", "bool"])
def test_an_int_field_refuses_in_a_mapping_what_direct_construction_refuses(
    value: object,
) -> None:
    data = _with("device_pages", value)
    with pytest.raises(ConfigError, match="device_pages"):
        _direct(data)
    with pytest.raises(ConfigError) as mapped:
        CacheConfig.from_dict(data)
    assert mapped.value.field == "device_pages"


@pytest.mark.parametrize("section", ["", "layout", "prefetch"])
@pytest.mark.parametrize("key", [1, b"x", None], ids=["int", "bytes", "None"])
def test_a_mapping_key_that_is_no_string_is_a_config_error(section: str, key: object) -> None:
    data = _with("device_pages", 4)
    (data.setdefault(section, {}) if section else data)[key] = 2
    for load in (CacheConfig.from_dict, load_config):
        with pytest.raises(ConfigError, match=r"Expected `str`"):
            load(data)


def test_a_config_error_survives_pickling() -> None:
    # A process pool's worker hands its exceptions back pickled.
    error = ConfigError("device_pages", "too many")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is ConfigError
    assert (back.field, back.reason, str(back)) == (error.field, error.reason, str(error))


def test_a_pickled_config_error_keeps_its_notes_and_attributes() -> None:
    # As the default pickling keeps an exception's __dict__: notes added on the way up (a
    # caller saying which file held the value) must come back from a worker process too.
    error = ConfigError("device_pages", "too many")
    error.add_note("in scenario.toml")
    error.scenario = "trace"  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(error))
    assert back.__notes__ == ["in scenario.toml"]
    assert back.scenario == "trace"
    assert (back.field, back.reason, str(back)) == (error.field, error.reason, str(error))
