"""The demo: its model's paged attention, the trace subset and bound, and small end-to-end runs."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch

from hicache_async._errors import StorageConfigError
from hicache_async._pool import KVPool
from hicache_async._trace import TraceRequest, request_tokens
from hicache_async.cli import main
from hicache_async.demo import (
    ContiguousKV,
    DemoOptions,
    ForwardStopped,
    ModelConfig,
    ModelRunner,
    PagedKV,
    Prefill,
    Progress,
    TinyTransformer,
    _model,
    reuse_upper_bound,
    run_demo,
    select_requests,
)

# Small enough to keep the end-to-end runs quick; the vocabulary must cover the trace's ids.
SMALL = ModelConfig(d_model=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128)


def _prefill(
    model: TinyTransformer, tokens: np.ndarray, start: int, pool: KVPool, table: list[int]
) -> torch.Tensor:
    prefill = Prefill(model, tokens, start, PagedKV(pool, table, start, len(tokens)))
    for layer in range(model.config.num_layers):
        prefill.run_layer(layer)
    return prefill.logits()


@pytest.fixture(params=["flash-merge", "masked"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the model attends over a cached prefix: merged flash passes and one masked
    pass (what runs where the CPU flash kernel is missing)."""
    if request.param == "masked":
        monkeypatch.setattr(_model, "_FLASH_CPU", None)
    elif _model._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel")
    return str(request.param)


@pytest.mark.parametrize(
    ("kv_heads", "kv_dtype"),
    [(4, "float32"), (2, "float32"), (4, "bfloat16")],
    ids=["mha", "gqa", "mha-bf16"],
)
def test_paged_attention_over_cached_prefix_equals_recompute(
    attention_path: str, kv_heads: int, kv_dtype: Literal["float32", "bfloat16"]
) -> None:
    config = ModelConfig(
        vocab_size=1000,
        d_model=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=kv_heads,
        head_dim=16,
        kv_dtype=kv_dtype,
    )
    model = TinyTransformer(config, seed=3)
    tokens = np.random.default_rng(0).integers(0, 1000, size=301)
    expected = model.prefill_logits(tokens)

    page = 16
    pool = KVPool(config.kv_layout(), page, 40)
    # Scattered, out-of-order pages, and cut points off page boundaries.
    table = [int(p) for p in np.random.default_rng(1).permutation(40)[:19]]
    _prefill(model, tokens[:100], 0, pool, table)
    _prefill(model, tokens[:250], 100, pool, table)
    got = _prefill(model, tokens, 250, pool, table)

    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()
    assert int(got.argmax()) == int(expected.argmax())

    # The pool holds the same K/V as a contiguous recompute, slot by slot (up to a rounding
    # step of the storage dtype, where the two passes' float32 values differ in the last bit).
    slot_tolerance = 1e-5 if kv_dtype == "float32" else 1e-2
    kv = ContiguousKV(config.num_layers, config.kv_torch_dtype)
    prefill = Prefill(model, tokens, 0, kv)
    for layer in range(config.num_layers):
        prefill.run_layer(layer)
    positions = np.arange(len(tokens))
    slots = torch.as_tensor(np.asarray(table)[positions // page] * page + positions % page)
    for layer in range(config.num_layers):
        pool_k, pool_v = pool.layer_buffers(layer)
        ref_k, ref_v = kv.read(layer)
        assert pool_k.dtype == ref_k.dtype == config.kv_torch_dtype
        assert torch.allclose(pool_k[slots].float(), ref_k.float(), atol=slot_tolerance)
        assert torch.allclose(pool_v[slots].float(), ref_v.float(), atol=slot_tolerance)


def test_suffix_pass_reads_the_prefix_from_the_pool() -> None:
    config = ModelConfig(
        vocab_size=500, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16
    )
    model = TinyTransformer(config, seed=0)
    tokens = np.random.default_rng(2).integers(0, 500, size=64)
    pool = KVPool(config.kv_layout(), 8, 8)
    table = list(range(8))
    _prefill(model, tokens[:48], 0, pool, table)
    clean = _prefill(model, tokens, 48, pool, table)
    pool.layer_buffers(1)[1][8:16].add_(1.0)  # the V of page 1 (tokens 8..15), layer 1
    assert not torch.allclose(_prefill(model, tokens, 48, pool, table), clean, atol=1e-3)


def test_model_is_deterministic_per_seed() -> None:
    config = ModelConfig(
        vocab_size=300, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16
    )
    tokens = np.arange(40) % 300
    a = TinyTransformer(config, seed=7).prefill_logits(tokens)
    b = TinyTransformer(config, seed=7).prefill_logits(tokens)
    c = TinyTransformer(config, seed=8).prefill_logits(tokens)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert TinyTransformer(config, seed=7).model_id != TinyTransformer(config, seed=8).model_id


def _req(timestamp: int, length: int, blocks: list[int]) -> TraceRequest:
    return TraceRequest(timestamp=timestamp, input_length=length, output_length=1, hash_ids=blocks)


def test_reuse_upper_bound_counts_blocks_seen_at_the_same_position() -> None:
    requests = [
        _req(0, 1300, [1, 2, 3]),  # nothing before it
        _req(1, 1800, [1, 2, 3, 4]),  # 512 + 512 + the 276 tokens block 3 had before
        _req(2, 700, [1, 5]),  # block 1 only
        _req(3, 1100, [9, 2, 3]),  # same ids, different prefix: nothing
        _req(4, 1536, [1, 2, 3]),  # block 3 was seen whole in request 1; the last token is not
    ]
    assert reuse_upper_bound(requests) == 1300 + 512 + 0 + 1535
    # Whole pages only: request 0 leaves 1280 tokens in pages of 64, all request 1 finds;
    # request 4's last page holds its last token, so 1472.
    assert reuse_upper_bound(requests, page_size=64) == 1280 + 512 + 0 + 1472
    # Pages of 1024 span two blocks: only request 1 (1024 of 1300) and 4 (1024) reuse any.
    assert reuse_upper_bound(requests, page_size=1024) == 1024 + 0 + 0 + 1024
    # A page larger than every prompt: nothing can be reused.
    assert reuse_upper_bound(requests, page_size=4096) == 0
    with pytest.raises(ValueError, match="page_size"):
        reuse_upper_bound(requests, page_size=0)


def test_select_requests_picks_multi_turn_prompts_that_fit() -> None:
    from hicache_async._trace import load_trace

    trace = load_trace()
    chosen = select_requests(trace, 40, 4096)
    assert len(chosen) == 40
    assert all(r.input_length <= 4096 and len(r.hash_ids) >= 2 for r in chosen)
    assert [r.timestamp for r in chosen] == sorted(r.timestamp for r in chosen)
    # Conversations beyond the shared first block make the bound well above block 0 alone.
    assert reuse_upper_bound(chosen) > 0.3 * sum(r.input_length for r in chosen)


# Prompt A, B extending A, then A and B again: every repeat has something to reuse.
_CONVERSATION = [
    _req(0, 1400, [900_001, 900_002, 900_003]),
    _req(1000, 1900, [900_001, 900_002, 900_003, 900_004]),
    _req(2000, 1400, [900_001, 900_002, 900_003]),
    _req(3000, 1900, [900_001, 900_002, 900_003, 900_004]),
]


def _options(storage: str, **overrides: object) -> DemoOptions:
    base: dict[str, object] = {
        "storage": storage,
        "device_pages": 256,
        "host_pages": 512,
        "page_size": 16,
        "max_prompt_tokens": 2048,
        # One at a time: every repeat starts after the prompt it repeats was committed.
        "concurrency": 1,
        "time_compression": 100.0,
        "progress": False,
        "prefetch_policy": "wait_complete",
    }
    base.update(overrides)
    return DemoOptions(**base)  # type: ignore[arg-type]


def test_small_demo_run_is_consistent() -> None:
    summary = run_demo(_options("memory://"), requests=_CONVERSATION, model_config=SMALL)

    prompt = sum(len(request_tokens(r)) for r in _CONVERSATION)
    t = summary.tokens
    assert summary.requests == 4
    assert summary.prompt_tokens == prompt
    assert t.device + t.host + t.storage + t.computed == prompt
    served = prompt - t.computed
    assert served > 0
    # Within one run nothing can be served that was not computed earlier in it.
    assert served <= summary.upper_bound_tokens
    # Every request computes at least its last token, and the first computes everything.
    assert t.computed >= 1400 + 3
    assert summary.check.compared == 4
    assert summary.check.max_abs_diff < 1e-3
    assert summary.check.argmax_agreement == 1.0
    assert summary.bytes.device_to_host > 0  # write_through backs every commit up
    assert summary.ttft_baseline.p50_s > 0
    assert summary.ttft_hicache.p50_s > 0


def test_file_storage_serves_a_restarted_cache(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    first = run_demo(_options(url), requests=_CONVERSATION[:2], model_config=SMALL)
    assert first.storage_pages_at_start == 0
    assert first.bytes.storage_written > 0

    # One request, so one prefetch: a fresh cache with empty pools can only have its pages
    # from storage (all 87 whole pages; the 88th token page is a partial tail).
    again = run_demo(
        _options(url, keep_storage=True), requests=_CONVERSATION[:1], model_config=SMALL
    )
    assert again.storage_pages_at_start > 0
    assert again.tokens.storage == 1392
    assert again.tokens.computed == 8
    assert again.bytes.storage_read > 0
    assert again.check.max_abs_diff < 1e-3
    assert again.check.argmax_agreement == 1.0

    # Without keep_storage the demo's pages are dropped first: a cold start again.
    cold = run_demo(_options(url), requests=_CONVERSATION[:1], model_config=SMALL)
    assert cold.tokens.storage == 0
    assert cold.tokens.computed == 1400


def test_options_refuse_a_device_pool_too_small_for_the_concurrency() -> None:
    with pytest.raises(ValueError, match="device pages"):
        DemoOptions(concurrency=4, max_prompt_tokens=4096, page_size=64, device_pages=200)


def test_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "demo",
            "--json",
            "--storage",
            "none",
            "--requests",
            "3",
            "--max-prompt-tokens",
            "1024",
            "--device-pages",
            "64",
            "--host-pages",
            "64",
            "--time-compression",
            "10000",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 3
    assert summary["storage"] is None
    tokens = summary["tokens"]
    assert sum(tokens.values()) == summary["prompt_tokens"]
    assert tokens["storage"] == 0
    assert summary["check"]["argmax_agreement"] == 1.0


def test_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device-pages", "10"]) == 2
    assert "device pages" in capsys.readouterr().err
    with pytest.raises(ValueError, match="time_compression must be a finite number > 0"):
        DemoOptions(time_compression=10**400)  # an int past a float's range
    # inf passed the flag's check and was refused later as if it were not above 0.
    for bad in ("inf", "nan", "0", "-1", "1e400"):
        with pytest.raises(SystemExit) as exited:
            main(["demo", "--time-compression", bad])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "argument --time-compression: must be a finite number > 0" in err, err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_only() -> None:
    terminal = _Terminal()
    bar = Progress({"baseline": 4, "hicache": 4}, stream=terminal)
    bar.advance("baseline", 2)
    bar.advance("hicache")
    bar.advance("hicache", 10)  # clamped to the lane's total
    bar.close()
    text = terminal.getvalue()
    assert "\r[" in text
    assert "baseline 2/4  hicache 4/4" in text
    assert bar.done("hicache") == 4
    assert text.endswith("\n")

    pipe = io.StringIO()
    bar = Progress({"baseline": 4}, stream=pipe)
    bar.advance("baseline")
    bar.close()
    assert pipe.getvalue() == ""


def _closed_port() -> int:
    """A local port nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize("keep_storage", [False, True])
def test_unreachable_storage_stops_the_demo_before_the_replay(keep_storage: bool) -> None:
    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{_closed_port()}"
    options = _options(url, keep_storage=keep_storage)
    with pytest.raises(StorageConfigError, match="storage cannot be used"):
        run_demo(options, requests=_CONVERSATION[:1], model_config=SMALL)


def test_cli_unreachable_storage_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("redis")
    argv = ["--requests", "1", "--max-prompt-tokens", "1024"]
    argv += ["--device-pages", "64", "--host-pages", "64"]
    url = f"redis://127.0.0.1:{_closed_port()}"
    assert main(["demo", "--storage", url, *argv]) == 2
    err = capsys.readouterr().err
    assert "hicache-async demo: error: the demo's storage cannot be used" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("seed", [str(2**64), "-1"])
def test_cli_refuses_a_seed_out_of_range(seed: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--seed", seed]) == 2
    assert "seed must be in [0, 2**64)" in capsys.readouterr().err
    DemoOptions(seed=2**64 - 1)  # the largest torch takes


def test_attention_in_pieces_equals_one_pass(
    attention_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ModelConfig(
        vocab_size=1000, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = TinyTransformer(config, seed=5)
    tokens = np.random.default_rng(3).integers(0, 1000, size=301)
    table = list(range(19))

    def both_passes() -> tuple[torch.Tensor, torch.Tensor]:
        pool = KVPool(config.kv_layout(), 16, 19)
        _prefill(model, tokens[:100], 0, pool, table)
        return model.prefill_logits(tokens), _prefill(model, tokens, 100, pool, table)

    whole = both_passes()
    monkeypatch.setattr(_model, "_PIECE_SCORES", 7 * len(tokens))  # 7 queries or more a piece
    pieced = both_passes()
    for got, expected in zip(pieced, whole, strict=True):
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


class _PausesOnRead(ContiguousKV):
    """A contiguous KV that sets `reading` as a layer reads it (after writing its own K/V,
    before its attention), then waits until `release` is set."""

    def __init__(self, config: ModelConfig, release: threading.Event) -> None:
        super().__init__(config.num_layers, config.kv_torch_dtype)
        self.reading = threading.Event()
        self.release = release

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reading.set()
        self.release.wait(30)
        return super().read(layer)


# A prompt whose attention is more than one piece (over 4096 tokens).
_LONG = np.arange(9000) % SMALL.vocab_size


def test_a_stop_during_a_layer_ends_it_before_its_next_attention_piece() -> None:
    model = TinyTransformer(SMALL)
    stop = threading.Event()
    kv = _PausesOnRead(SMALL, release=stop)
    prefill = Prefill(model, _LONG, 0, kv, stop=stop)
    asker = threading.Thread(target=lambda: kv.reading.wait(30) and stop.set())
    asker.start()
    try:
        with pytest.raises(ForwardStopped):
            prefill.run_layer(0)  # stop is asked while the layer runs
    finally:
        stop.set()
        asker.join()
    with pytest.raises(ForwardStopped):
        prefill.run_layer(0)  # and nothing more runs
    with pytest.raises(ForwardStopped):
        model.prefill_logits(_LONG, stop=stop)


async def test_a_cancelled_model_job_is_stopped_and_waited_for() -> None:
    # The caller is cancelled the way Ctrl-C cancels the demo's main task: the runner must ask
    # the layer to stop and return only once the thread has left it, mid-layer.
    model = TinyTransformer(SMALL)
    prefill_stop = threading.Event()
    kv = _PausesOnRead(SMALL, release=prefill_stop)
    prefill = Prefill(model, _LONG, 0, kv, stop=prefill_stop)
    left = threading.Event()

    def layer() -> None:
        try:
            prefill.run_layer(0)
        finally:
            left.set()

    runner = ModelRunner()
    job = asyncio.ensure_future(runner.run(layer, stop=prefill.stop))
    assert await asyncio.to_thread(kv.reading.wait, 30)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert left.is_set()  # the thread was waited for
    assert prefill.stop.is_set()
    with pytest.raises(RuntimeError, match="before every layer ran"):
        prefill.logits()  # layer 0 never completed
    # The runner is free for the next job.
    tokens = np.arange(40) % SMALL.vocab_size
    logits = await asyncio.wait_for(runner.run(functools.partial(model.prefill_logits, tokens)), 30)
    assert torch.equal(logits, model.prefill_logits(tokens))


def test_options_refuse_a_page_longer_than_the_longest_prompt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match=r"page_size \(8192\) must not exceed max_prompt_tokens"):
        DemoOptions(page_size=8192, max_prompt_tokens=4096)
    DemoOptions(page_size=4096, max_prompt_tokens=4096, device_pages=4)
    assert main(["demo", "--page-size", "100000", "--device-pages", "1"]) == 2
    err = capsys.readouterr().err
    assert "page_size (100000) must not exceed max_prompt_tokens (4096)" in err
    assert "Traceback" not in err


# Runs `hicache-async demo` and prints "started" as the model's warm-up pass begins: with pages
# of 65536 tokens that pass covers 131072 tokens, minutes of work on one thread.
_ANNOUNCED_DEMO = """
import sys
from hicache_async.cli import main
from hicache_async.demo import TinyTransformer

prefill_logits = TinyTransformer.prefill_logits

def announced(self, *args, **kwargs):
    print("started", flush=True)
    return prefill_logits(self, *args, **kwargs)

TinyTransformer.prefill_logits = announced
sys.exit(main(sys.argv[1:]))
"""


def test_interrupt_stops_the_model_and_exits_130() -> None:
    argv = ["demo", "--storage", "none", "--requests", "1", "--concurrency", "1"]
    argv += ["--max-prompt-tokens", "65536", "--page-size", "65536"]
    argv += ["--device-pages", "1", "--host-pages", "1", "--threads", "1"]
    process = subprocess.Popen(
        [sys.executable, "-c", _ANNOUNCED_DEMO, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "started\n"
        process.send_signal(signal.SIGINT)
        # Only a guard against hanging: an interrupted run ends within about a second.
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert err == "hicache-async: interrupted\n"
    assert out == ""


def test_the_trace_request_run_demo_takes_is_exported() -> None:
    import hicache_async.demo

    assert hicache_async.demo.TraceRequest is TraceRequest
    assert "TraceRequest" in hicache_async.demo.__all__
