"""Bad inputs found by fuzzing the parsers: each is a clear, typed error, not a hang, a raw
exception from a lower layer, or damage that grows."""

from __future__ import annotations

import array
import os
import threading
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_async import (
    CacheConfig,
    ConfigError,
    HiCache,
    InvalidTokensError,
    KVLayout,
    StorageConfigError,
    load_config,
)
from hicache_async._keys import as_token_array
from hicache_async._pool import _resolve_device
from hicache_async.bench import report
from hicache_async.cli import _build_parser, main
from hicache_async.storage import HEADER_NBYTES, FileStorage, Outcome, PageMeta, open_storage

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)


def _config(**fields: object) -> CacheConfig:
    return CacheConfig(**{"layout": LAYOUT, "device_pages": 4, "device": "cpu", **fields})


def test_a_mac_key_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "mac.key"
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException | None] = []

    def construct() -> None:
        try:
            HiCache(_config(mac_key_file=str(fifo)))
            outcome.append(None)
        except BaseException as exc:  # reported to the test thread below
            outcome.append(exc)

    thread = threading.Thread(target=construct, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        # Release the blocked open so the thread ends, then fail.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60)
        pytest.fail("HiCache blocked opening a FIFO as its MAC key file")
    assert isinstance(outcome[0], ConfigError)
    assert outcome[0].field == "mac_key_file"
    assert "not a regular file" in str(outcome[0])


def test_a_mac_key_file_path_with_a_nul_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not a usable path") as info:
        HiCache(_config(mac_key_file="/tmp/a\0b"))
    assert info.value.field == "mac_key_file"


def test_a_readable_mac_key_file_still_works(tmp_path: Path) -> None:
    key = tmp_path / "mac.key"
    key.write_bytes(b"  0123456789abcdef0123  \n")
    key.chmod(0o600)
    assert HiCache(_config(mac_key_file=str(key))).statistics().state == "new"
    key.chmod(0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        HiCache(_config(mac_key_file=str(key)))


def test_load_config_refuses_what_is_no_path_with_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a usable path"):
        load_config(str(tmp_path / "x\0.json"))
    with pytest.raises(ConfigError, match=r"a mapping or the path \(str or os.PathLike\)"):
        load_config(123)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"a JSON document \(str or bytes\) is required"):
        CacheConfig.from_json(5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"a TOML document \(str or bytes\) is required"):
        CacheConfig.from_toml(5)  # type: ignore[arg-type]


def test_from_toml_takes_utf8_bytes_as_from_json_does() -> None:
    text = "device_pages = 8\ndevice = 'cpu'\n[layout]\nnum_layers = 1\nnum_kv_heads = 1\n"
    text += "head_dim = 4\n"
    assert CacheConfig.from_toml(text.encode()) == CacheConfig.from_toml(text)
    with pytest.raises(ConfigError, match="not valid TOML: not UTF-8"):
        CacheConfig.from_toml(b"device = '\xff'")


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("raise RuntimeError('boom at import')\n", "failed to import: RuntimeError: boom"),
        ("def f(:\n", "failed to import: SyntaxError"),
        ("def __getattr__(name):\n    raise KeyError(name)\n", "cannot be looked up"),
    ],
)
def test_a_plugin_module_that_fails_its_own_way_is_a_storage_config_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    error: str,
) -> None:
    name = f"plugin_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(StorageConfigError, match=error):
        open_storage(f"{name}:factory")
    # The command line says so in one line and exits 2, as for any bad URL.
    assert main(["storage", "stats", f"{name}:factory"]) == 2
    assert error.split(":", maxsplit=1)[0] in capsys.readouterr().err


@pytest.mark.parametrize("field", ["model_id", "salt", "device"])
def test_a_text_field_with_a_lone_surrogate_is_a_config_error(field: str) -> None:
    with pytest.raises(ConfigError, match="UTF-8 can encode") as info:
        _config(**{field: "model-\ud800"})
    assert info.value.field == field
    layout = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4}
    document = {"layout": layout, "device_pages": 4, field: "\udcff"}
    with pytest.raises(ConfigError, match="UTF-8 can encode"):
        CacheConfig.from_dict(document)


@pytest.mark.parametrize("salt", ["\ud800", "ok-\udcff"])
def test_a_salt_with_a_lone_surrogate_is_the_documented_type_error(salt: str) -> None:
    cache = HiCache(_config())
    with pytest.raises(TypeError, match="salt must be text UTF-8 can encode"):
        cache.keys_for(list(range(64)), salt=salt)
    assert cache.keys_for(list(range(64)), salt="sel-\u00e9") != cache.keys_for(list(range(64)))


@pytest.mark.parametrize(
    "device", ["cuda:128", "cuda:256", "cuda:2147483648", "cuda:01", "cuda:" + "9" * 5000]
)
def test_a_cuda_index_torch_cannot_hold_is_a_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match=r"N from 0 to 127") as info:
        _config(device=device)
    assert info.value.field == "device"
    with pytest.raises(ConfigError, match="torch"):
        _resolve_device(device)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:7", "cuda:127"])
def test_a_cuda_index_torch_holds_is_accepted(device: str) -> None:
    assert _config(device=device).device == device
    assert str(_resolve_device(device)) == device


async def _store_zero_page(root: Path, payload: int) -> Path:
    """The file of one all-zero page of `payload` bytes, stored by FileStorage."""
    key = bytes(range(32))
    async with FileStorage(root) as storage:
        meta = PageMeta(key=key, namespace=bytes(16), num_tokens=4)
        page = [memoryview(bytearray(payload))]
        assert await storage.put([key], [page], [meta]) == [Outcome.OK]
    return root / "pages" / key.hex()[:2] / key.hex()


async def test_verify_leaves_a_long_sparse_page_unchecked_without_reading_it(
    tmp_path: Path,
) -> None:
    path = await _store_zero_page(tmp_path / "s", 80 << 20)
    # The same bytes, its zeros made a hole (as a sparse-aware copy makes them): the checksum
    # still holds, but a header can claim any length over holes, so it is not read; nor is
    # it removed, as it may well be sound.
    header = path.read_bytes()[:HEADER_NBYTES]
    size = path.stat().st_size
    path.unlink()
    with path.open("wb") as f:
        f.write(header)
        f.truncate(size)
    assert os.stat(path).st_blocks * 512 < size // 16, "the file system filled the hole"
    async with FileStorage(tmp_path / "s") as storage:
        report = await storage.verify()
    assert (report.ok, report.corrupt_removed, report.unchecked) == (0, 0, 1)
    assert path.exists()


async def test_verify_keeps_a_sound_page_longer_than_the_capacity(tmp_path: Path) -> None:
    path = await _store_zero_page(tmp_path / "s", 2 << 20)
    # Written under a larger capacity (lowered since, or another instance's): a misfit,
    # evicted first, but sound.
    async with FileStorage(tmp_path / "s", capacity_bytes=1 << 20) as storage:
        report = await storage.verify()
    assert (report.ok, report.corrupt_removed) == (1, 0)
    assert path.exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file:///tmp/x?io_threads=\u00b2", r"io_threads='\u00b2' must be an integer >= 1 \(ASCII"),
        ("file:///tmp/x?io_threads=\u0661\u0662", "must be an integer >= 1"),
        ("file:///tmp/x?io_threads=" + "9" * 5000, r"\.\.\. \(5000 characters\) must be an"),
        ("memory://?capacity=\u0661\u0662", "is not a byte size such as"),
        ("memory://?capacity=" + "9" * 5000, r"\(5000 characters\) is not a byte size"),
        ("redis://h/0?timeout=\u0661\u0662", r"is not a number \(ASCII decimal digits"),
        ("redis://h/0?timeout=" + "9" * 5000, "is not a number"),
        ("redis://h/0?ttl=\u0661\u0662", "ttl='\u0661\u0662' must be an integer >= 1"),
        ("redis://h/0?ttl=" + "9" * 5000, "must be an integer >= 1"),
        ("mooncake://h:1?admin=http://[::1", "admin must be an http://host:port URL"),
        ("mooncake://h:1?replicas=\u0661", "replicas='\u0661' must be an integer >= 1: replicas"),
        ("rediss://h/0?ssl_ca_certs=\ud800", "must be text UTF-8 can encode"),
    ],
)
def test_a_url_parameter_is_read_in_ascii_or_refused_saying_what_is_accepted(
    url: str, message: str
) -> None:
    with pytest.raises(StorageConfigError, match=message):
        open_storage(url)


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["storage", "ls", "memory://", "--limit", "\u0663"], "--limit"),
        (["demo", "--device-pages", "\u0661\u0662"], "--device-pages"),
        (["demo", "--threads", "\u0663"], "--threads"),
        (["demo", "--seed", "\u0663"], "--seed"),
        (["demo", "--time-compression", "\u0663"], "--time-compression"),
        (["bench", "copy", "--seed", "\u0663"], "--seed"),
        (["bench", "trace", "--time-scale", "\u0663"], "--time-scale"),
        (["bench", "trace", "--host-ratios", "1,\u0663"], "--host-ratios"),
        (["bench", "trace", "--storages", "\u0663x"], "--storages"),
    ],
)
def test_a_command_line_number_in_other_digits_is_refused_as_url_parameters_are(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # int() and float() read "\u0663" as 3: "--limit \u0663" listed three pages. Parsed
    # only: a command that took it would run.
    with pytest.raises(SystemExit) as info:
        _build_parser(argv).parse_args(argv)
    assert info.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert f"argument {option}:" in line
    assert "(ASCII digits 0-9)" in line


def test_the_report_timeout_is_refused_in_other_digits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        report._parse(["--timeout", "\u0663"])  # parsed only: main would run every benchmark
    assert info.value.code == 2
    assert "(ASCII digits 0-9)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "attribute", "value"),
    [
        ("file:///tmp/fz-unused?io_threads=12", "io_threads", 12),
        ("redis://h/0?timeout=0.25", "_timeout", 0.25),
        ("redis://h/0?timeout=1e1", "_timeout", 10.0),
    ],
)
def test_a_url_parameter_in_ascii_is_read(url: str, attribute: str, value: object) -> None:
    assert getattr(open_storage(url), attribute) == value


@pytest.mark.parametrize("path", ["/tmp/fz-pct/%FF", "/tmp/fz-pct/%ED%A0%80", "/tmp/fz-\ud800"])
def test_a_file_url_path_that_is_no_utf8_is_refused_not_replaced(path: str) -> None:
    with pytest.raises(StorageConfigError, match="file:// paths must be UTF-8 text"):
        open_storage(f"file://{path}")
    assert str(open_storage("file:///tmp/fz-pct/%C3%A9").root) == "/tmp/fz-pct/\u00e9"  # type: ignore[attr-defined]


async def test_a_numpy_integer_priority_is_taken_as_its_value_through_to_storage(
    tmp_path: Path,
) -> None:
    # It once reached the manifest's JSON encoder as a numpy scalar and failed the backup.
    tokens = list(range(16))
    async with HiCache(_config(host_pages=8, page_size=4), storage=FileStorage(tmp_path)) as cache:
        with cache.request(tokens, priority=np.int64(3)) as req:  # type: ignore[arg-type]
            pages = await req.allocate(len(tokens))
            assert len(pages) == len(tokens) // cache.config.page_size
            req.commit()
        await cache.drain()
        status = cache.storage_status()
        assert status.backup is not None
        assert (status.backup.written_pages, status.backup.failed_pages) == (4, 0)
        manifest = cache._link.backend.manifest()  # type: ignore[union-attr]
        entries = (await manifest.read()).entries
        assert [(e.priority, type(e.priority)) for e in entries] == [(3, int)]
        for bad in (np.bool_(True), True, 1 << 31, np.int64(1 << 31), 3.0):
            with pytest.raises(ValueError, match="must be an int in"):
                cache.request(tokens, priority=bad)  # type: ignore[arg-type]


def _odd_tensors() -> dict[str, Any]:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and sparse tensors are announced as beta
        return {
            "sparse": torch.arange(8).to_sparse(),
            "quantized": torch.quantize_per_tensor(torch.zeros(8), 1.0, 0, torch.quint8),
            "meta": torch.empty(8, dtype=torch.long, device="meta"),
            "nested": torch.nested.nested_tensor([torch.arange(2), torch.arange(3)]),
        }


@pytest.mark.parametrize("kind", ["sparse", "quantized", "meta", "nested"])
def test_a_tensor_without_dense_data_is_invalid_tokens(kind: str) -> None:
    with pytest.raises(InvalidTokensError, match="dense 1-D integer tensor holding data"):
        as_token_array(_odd_tensors()[kind])


def test_a_memoryview_is_refused_as_bytes_are() -> None:
    for tokens in (b"\x01\x02", memoryview(b"\x01\x02"), memoryview(bytearray(4))):
        with pytest.raises(InvalidTokensError, match="sequence of integers, got"):
            as_token_array(tokens)


def test_a_memoryview_of_typed_items_is_read_as_token_ids() -> None:
    ids = [101, 2023, 3000]
    for view in (
        memoryview(array.array("i", ids)),
        memoryview(array.array("I", ids)),
        memoryview(np.asarray(ids, dtype=np.int64)),
    ):
        assert as_token_array(view).tolist() == ids
