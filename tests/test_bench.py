"""Smoke tests of the orchestration and trace benchmarks and the report, at tiny sizes.

They check that records are well formed and consistent with each other (ratios are
value / baseline, hit rates stay under their upper bound), never how fast anything is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import msgspec
import numpy as np
import pytest
import redis
import structlog

from hicache_async._trace import TraceRequest, load_trace, request_tokens
from hicache_async.bench import Record, orchestration, report, trace, tree, write_records
from hicache_async.bench import storage as storage_bench
from hicache_async.bench._sim import (
    LLAMA3_8B_H100,
    NoCacheEngine,
    percentile,
    simulate,
    upper_bound,
)
from hicache_async.bench._timing import median_us
from hicache_async.cli import main
from hicache_async.storage import FileStorage, MemoryStorage
from hicache_async.testing._fixtures import redis_server, redis_url
from hicache_async.testing._servers import RedisServer, free_port

# Real servers for the Redis baseline's tests (pytest finds fixtures imported here).
__all__ = ["redis_server", "redis_url"]


def _args(module: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(argv)


def _by_name(records: list[Record]) -> dict[str, Record]:
    names = [r.name for r in records]
    assert len(names) == len(set(names)), "record names must be unique"
    return {r.name: r for r in records}


def _well_formed(records: list[Record]) -> None:
    assert records
    for r in records:
        assert r.name
        assert r.unit
        assert math.isfinite(r.value), r
        # Paired throughputs take the median of per-pair ratios, not a ratio of medians.
        paired = r.name.endswith("prefetch_gbps")
        if r.baseline is not None and r.ratio is not None and not paired:
            assert r.ratio == pytest.approx(r.value / r.baseline), r
        if r.ratio is not None:
            assert r.ratio >= 0, r


# The simulation helpers.


def test_upper_bound_counts_repeated_prefixes() -> None:
    requests = [
        TraceRequest(timestamp=0, input_length=1024, output_length=1, hash_ids=[1, 2]),
        TraceRequest(timestamp=1, input_length=1100, output_length=1, hash_ids=[1, 2, 3]),
        TraceRequest(timestamp=2, input_length=600, output_length=1, hash_ids=[9, 2]),
    ]
    bound = upper_bound(requests, 512)
    assert bound.blocks == 7
    assert bound.block_hits == 2  # blocks 1 and 2 of the second request
    assert bound.tokens == 1024 + 1100 + 600
    assert bound.token_hits == 1024
    # Smaller pages find the same whole blocks here (the tail pages were never computed).
    assert upper_bound(requests, 64).token_hits == 1024


def test_upper_bound_of_the_packaged_trace_matches_its_readme() -> None:
    bound = upper_bound(load_trace(), 512)
    assert bound.blocks == 288_500
    assert bound.block_hit_rate == pytest.approx(0.366, abs=0.001)
    assert bound.token_hit_rate <= 1.0


async def test_simulate_queues_behind_one_slot() -> None:
    profile = LLAMA3_8B_H100
    lengths = [1000, 1000, 1000]
    ttft, queued = await simulate([0.0, 0.0, 10.0], NoCacheEngine(profile, lengths), slots=1)
    one = profile.compute_s(1000, 0)
    assert ttft[0] == pytest.approx(one)
    assert ttft[1] == pytest.approx(2 * one)  # waited for the first
    assert queued[1] == pytest.approx(one)
    assert ttft[2] == pytest.approx(one)  # arrived to an idle server
    parallel, _ = await simulate([0.0, 0.0], NoCacheEngine(profile, lengths[:2]), slots=2)
    assert parallel == pytest.approx([one, one])


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert math.isnan(percentile([], 99))


def test_prompt_tokens_follow_block_identity() -> None:
    a = TraceRequest(timestamp=0, input_length=700, output_length=1, hash_ids=[5, 6])
    b = TraceRequest(timestamp=0, input_length=1024, output_length=1, hash_ids=[5, 7])
    ta, tb = trace.prompt_tokens(a), trace.prompt_tokens(b)
    assert len(ta) == 700
    assert len(tb) == 1024
    assert np.array_equal(ta[:512], tb[:512])
    assert not np.array_equal(ta[512:700], tb[512:700])
    assert len(request_tokens(a)) == len(ta)


# bench trace.


def test_trace_records_are_consistent() -> None:
    args = _args(
        trace,
        [
            *("--requests", "150", "--host-ratios", "0.5,2"),
            *("--storages", "off,4x,unbounded", "--device-tokens", "131072"),
            *("--jobs", "1"),
        ],
    )
    records = trace.run(args)
    _well_formed(records)
    by = _by_name(records)
    assert by["trace.requests"].value == 150
    bound = by["trace.bound.token_hit_rate"].value
    assert 0 <= bound <= 1
    for host in ("0.5", "2"):
        for storage in ("off", "4x", "unbounded"):
            prefix = f"trace.host{host}x.storage-{storage}"
            tiers = [by[f"{prefix}.hit.{t}"].value for t in ("device", "host", "storage")]
            total = by[f"{prefix}.hit.total"]
            assert all(0 <= t <= 1 for t in tiers)
            assert total.value == pytest.approx(sum(tiers))
            assert total.value <= bound + 1e-9
            assert total.baseline == bound
            p50, p99 = by[f"{prefix}.ttft_p50_s"], by[f"{prefix}.ttft_p99_s"]
            assert 0 < p50.value <= p99.value
            assert p50.baseline == by["trace.nocache.ttft_p50_s"].value
            if storage == "off":
                assert tiers[2] == 0
                assert f"{prefix}.storage.read_pages" not in by
            else:
                read = by[f"{prefix}.storage.read_pages"].value
                written = by[f"{prefix}.storage.written_pages"].value
                assert read >= 0
                assert written > 0
                assert by[f"{prefix}.prefetch.stuck"].value == 0
    # Unbounded storage serves at least what a 4x one does, which serves at least none.
    hit = {s: by[f"trace.host2x.storage-{s}.hit.total"].value for s in ("off", "4x", "unbounded")}
    assert hit["off"] <= hit["unbounded"]


def test_trace_replays_are_the_same_in_worker_processes() -> None:
    argv = ["--requests", "80", "--host-ratios", "2", "--storages", "off,unbounded"]
    argv += ["--device-tokens", "131072"]
    here = trace.run(_args(trace, [*argv, "--jobs", "1"]))
    there = trace.run(_args(trace, [*argv, "--jobs", "2"]))
    # The clock is virtual: everything but the wall time of each replay is reproducible.
    assert [r for r in here if "wall" not in r.name] == [r for r in there if "wall" not in r.name]


def test_trace_rejects_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        _args(trace, ["--storages", "small"])
    with pytest.raises(SystemExit):
        _args(trace, ["--host-ratios", "0"])


# bench orchestration.


def test_orchestration_records_are_consistent(tmp_path: Path) -> None:
    args = _args(
        orchestration,
        [
            *("--shape", "small", "--pages", "3", "--reps", "2"),
            *("--prompts", "3", "--prompt-pages", "4", "--root", str(tmp_path)),
        ],
    )
    records = orchestration.run(args)
    _well_formed(records)
    by = _by_name(records)
    for loop in ("asyncio", "uvloop"):
        memory = f"orchestration.memory.{loop}"
        for mode in ("sequential", "concurrent"):
            rate = by[f"{memory}.{mode}.pages_per_s"]
            cpu = by[f"{memory}.{mode}.loop_us_per_page"]
            assert rate.value > 0
            assert rate.baseline
            assert cpu.value > 0
            assert cpu.baseline
        assert by[f"{memory}.keys_us_per_page"].baseline is None
        for layout in ("page_first_direct", "layer_first"):
            gbps = by[f"orchestration.file.small.{layout}.{loop}.prefetch_gbps"]
            assert gbps.unit == "GB/s"
            assert gbps.value > 0
            assert gbps.baseline
            assert gbps.ratio
    # The temporary store is gone.
    assert list(tmp_path.iterdir()) == []


# The report.


def test_report_renders_missing_failed_and_skipped_jobs(tmp_path: Path) -> None:
    good = report.JobResult(
        key="demo", title="demo", kind="tree", command="hicache-async bench tree", status="ok"
    )
    records = [
        Record.compare("copy h2d contiguous host=layer_first", 9.0, "GB/s", 10.0),
        Record("storage.file.small.exists64_us", 20.0, "us"),
    ]
    write_records(tmp_path / "demo.json", records)
    good.json = "demo.json"
    results = [
        good,
        report.JobResult(
            key="gone", title="gone", kind="nope", command="x", status="missing", detail="absent"
        ),
        report.JobResult(
            key="bad", title="bad", kind="trace", command="y", status="failed", detail="boom"
        ),
        report.JobResult(
            key="off", title="off", kind="storage", command="z", status="skipped", detail="no"
        ),
    ]
    trace_records = [
        Record("trace.bound.token_hit_rate", 0.4, "fraction"),
        Record("trace.bound.block_hit_rate", 0.38, "fraction"),
        Record("trace.nocache.ttft_p50_s", 2.0, "s"),
        Record("trace.nocache.ttft_p99_s", 9.0, "s"),
        Record.compare("trace.host2x.storage-off.hit.device", 0.1, "fraction", 0.4),
        Record.compare("trace.host2x.storage-off.hit.host", 0.1, "fraction", 0.4),
        Record.compare("trace.host2x.storage-off.hit.storage", 0.0, "fraction", 0.4),
        Record.compare("trace.host2x.storage-off.hit.total", 0.2, "fraction", 0.4),
        Record.compare("trace.host2x.storage-off.ttft_p50_s", 1.0, "s", 2.0),
        Record.compare("trace.host2x.storage-off.ttft_p99_s", 4.5, "s", 9.0),
        Record("trace.host2x.storage-off.allocation_errors", 1.0, "count"),
    ]
    write_records(tmp_path / "trace.json", trace_records)
    results.append(
        report.JobResult(
            key="trace", title="trace", kind="trace", command="t", status="ok", json="trace.json"
        )
    )
    page = report.render(results, tmp_path, {"nproc": "2"}, quick=True)
    assert "| 2x, off | 10.0% | 10.0% | 0.0% | 20.0% | 50.0% | 1.00 s (0.50x) |" in page
    assert page.startswith(report.PREFACE.rstrip())
    assert "`copy h2d contiguous host=layer_first`" in page
    assert "**Not run:** absent." in page
    assert "**Failed** after 0 s: boom" in page
    assert "**Skipped:** no" in page
    assert "| copy ≥ 0.9x tensor.copy_ | 1 | 1 |" in page
    assert "| exists of 64 keys < 0.1 ms (file) | 1 | 1 |" in page


def test_report_targets_leave_out_the_checked_baseline(tmp_path: Path) -> None:
    records = [
        Record.compare("storage.mooncake.small.put_gbps", 1.9, "GB/s", 2.0),
        Record.compare("storage.mooncake.small.get_gbps", 1.9, "GB/s", 2.0),
        # The baseline's own calls with checksums: a reference, not a figure of ours.
        Record.compare("storage.mooncake.small.raw_checked_put_gbps", 1.6, "GB/s", 2.0),
        Record.compare("storage.mooncake.small.raw_checked_get_gbps", 1.6, "GB/s", 2.0),
    ]
    write_records(tmp_path / "s.json", records)
    job = report.JobResult(
        key="s", title="s", kind="storage", command="c", status="ok", json="s.json"
    )
    page = report.render([job], tmp_path, {}, quick=False)
    assert "| storage put ≥ 0.9x raw | 1 | 1 |" in page
    assert "| storage get ≥ 0.9x raw | 1 | 1 |" in page


def test_report_job_of_an_unknown_kind_is_missing(tmp_path: Path) -> None:
    job = report.Job(key="x", title="x", kind="no-such-benchmark", args=[])
    result = report.run_job(job, tmp_path, timeout_s=60)
    assert result.status == "missing"


def test_report_runs_a_benchmark_and_writes_the_page(tmp_path: Path) -> None:
    # A previous quick run left a result for another job: a partial run keeps it.
    earlier = report.JobResult(
        key="copy", title="copy", kind="copy", command="c", status="failed", detail="earlier"
    )
    payload = {"machine": {"nproc": "2"}, "quick": True, "results": [earlier]}
    (tmp_path / "report.json").write_bytes(msgspec.json.encode(payload))
    code = report.main(
        [
            *("--out-dir", str(tmp_path), "--docs", str(tmp_path / "page.md")),
            *("--quick", "--only", "tree"),
        ]
    )
    assert code == 0
    page = (tmp_path / "page.md").read_text(encoding="utf-8")
    assert "## tree" in page
    assert "`tree.match.ops_per_s`" in page
    assert "## copy" in page
    assert "earlier" in page
    assert (tmp_path / "tree.json").exists()
    # Rendering again from the JSON alone gives the same page.
    assert (
        report.main(
            ["--out-dir", str(tmp_path), "--docs", str(tmp_path / "again.md"), "--render-only"]
        )
        == 0
    )
    assert (tmp_path / "again.md").read_text(encoding="utf-8") == page


def test_simulate_is_deterministic() -> None:
    lengths = [600, 5000, 700]
    runs = [
        asyncio.run(simulate([0.0, 0.1, 0.2], NoCacheEngine(LLAMA3_8B_H100, lengths), slots=1))
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


# Options and URLs the benchmarks refuse, and what they run on.


def _bench_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["bench", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["tree", "--requests", "0"],
        ["tree", "--repeat", "0"],
        ["tree", "--page-size", "0"],
        ["copy", "--pages", "0"],
        ["copy", "--seed", "-1"],
        ["orchestration", "--batch-pages", "0"],
        ["storage", "--pages", "0"],
        ["trace", "--time-scale", "nan"],
        ["trace", "--time-scale", "inf"],
        ["trace", "--time-scale", "0"],
        ["trace", "--device-tokens", "0"],
        ["trace", "--jobs", "0"],
    ],
)
def test_bench_options_out_of_range_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Every prompt is shorter than a page: nothing to insert (was ZeroDivisionError).
        (["tree", "--requests", "5", "--page-size", "1000000"], "lower --page-size"),
        (["storage", "--backend", "file:///x?bogus=1"], "unknown parameter 'bogus'"),
        (["storage", "--backend", "memory://?bogus=1"], "unknown parameter 'bogus'"),
        # More buffers than one vectored call takes (was OSError from pwritev mid-run).
        (["storage", "--segments", "1024"], "--segments must be at most 1023"),
        (["storage", "--backend", "no_such_module_here.sub:make"], "cannot import"),
        (["trace", "--requests", "5", "--page-size", "100"], "must divide 512"),
        (["trace", "--requests", "5", "--device-tokens", "64"], "longest prompt"),
    ],
)
def test_bench_configuration_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, err = _bench_cli(capsys, *argv)
    assert code == 2
    assert message in err
    assert err.startswith(f"hicache-async bench {argv[0]}: error: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("backend", "package"),
    [("redis://127.0.0.1:1/0", "redis"), ("mooncake://127.0.0.1:1", "mooncake")],
)
def test_a_backend_without_its_client_library_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, backend: str, package: str
) -> None:
    # As if the extra were not installed (Mooncake's baseline raised ModuleNotFoundError
    # with a traceback mid-run).
    for name in ["hicache_async.storage._redis", "hicache_async.bench._storage_redis"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    names = [m for m in sys.modules if m == package or m.startswith(f"{package}.")]
    for name in names or [package]:
        monkeypatch.setitem(sys.modules, name, None)
    argv = ["storage", "--backend", backend, "--shape", "small", "--pages", "2", "--reps", "1"]
    code, err = _bench_cli(capsys, *argv)
    assert code == 2, err
    assert err.startswith("hicache-async bench storage: error: ")
    assert f"pip install 'hicache-async[{package}]'" in err
    assert "Traceback" not in err


_NO_UVLOOP_LINE = (
    "hicache-async bench: uvloop is not installed, running on asyncio's event loop "
    "(pip install 'hicache-async[bench]' for uvloop)\n"
)


@pytest.fixture
def without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the `bench` extra were not installed, in a process that has not said so yet."""
    from hicache_async.bench import _runner

    monkeypatch.setitem(sys.modules, "uvloop", None)
    monkeypatch.setattr(_runner, "_fallback_said", False, raising=False)


@pytest.mark.usefixtures("without_uvloop")
def test_orchestration_without_uvloop_runs_on_asyncio_and_says_so_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    json_path = tmp_path / "records.json"
    argv = ["orchestration", "--parts", "memory", "--reps", "1", "--prompts", "2"]
    code, err = _bench_cli(capsys, *argv, "--prompt-pages", "2", "--json", str(json_path))
    assert code == 0, err
    assert err == _NO_UVLOOP_LINE
    records = msgspec.json.decode(json_path.read_bytes(), type=list[Record])
    assert {r.name.split(".")[2] for r in records} == {"asyncio"}


@pytest.mark.usefixtures("without_uvloop")
@pytest.mark.parametrize("loops", ["uvloop", "asyncio,uvloop"])
def test_orchestration_asked_for_uvloop_without_it_names_the_extra(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, loops: str
) -> None:
    root = tmp_path / "root"
    code, err = _bench_cli(capsys, "orchestration", "--loops", loops, "--root", str(root))
    assert code == 2
    assert err == (
        "hicache-async bench orchestration: error: --loops uvloop: uvloop is not installed: "
        "pip install 'hicache-async[bench]'\n"
    )
    assert not root.exists()  # refused before anything was made


@pytest.mark.usefixtures("without_uvloop")
def test_storage_bench_without_uvloop_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["storage", "--backend", "memory://", "--shape", "small", "--pages", "2", "--reps", "1"]
    code, err = _bench_cli(capsys, *argv)
    assert code == 0, err
    assert err == _NO_UVLOOP_LINE


def test_a_backend_that_cannot_be_reached_fails_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()
    for backend, message in (
        (f"redis://127.0.0.1:{port}/0", "the raw baseline cannot reach"),
        (f"mooncake://127.0.0.1:{port}?protocol=tcp", "cannot reach the Mooncake master"),
        ("file:///proc/hicache-none", "No such file or directory"),
    ):
        argv = ["storage", "--backend", backend, "--shape", "small", "--pages", "2"]
        code, err = _bench_cli(capsys, *argv, "--reps", "1")
        assert code == 1, err
        assert err.startswith("hicache-async bench storage: failed: ")
        assert message in err
        assert "Traceback" not in err


@pytest.mark.parametrize(
    ("policy", "maxmemory", "message"),
    [
        # Refused: redis-py's OutOfMemoryError went up as a traceback.
        ("noeviction", "3mb", "the raw baseline's put failed"),
        # Evicted: the baseline's GETs of missing keys were timed as if they had read pages.
        ("allkeys-lru", "8mb", "the raw baseline's values were evicted"),
    ],
)
def test_a_full_redis_fails_the_bench_in_one_line(
    capsys: pytest.CaptureFixture[str], policy: str, maxmemory: str, message: str
) -> None:
    full = ["--maxmemory", maxmemory, "--maxmemory-policy", policy]
    with RedisServer(extra_args=full) as server:
        argv = ["storage", "--backend", server.url, "--shape", "small", "--pages", "64"]
        code, err = _bench_cli(capsys, *argv, "--reps", "1")
    assert code == 1, err
    assert err.startswith("hicache-async bench storage: failed: ")
    assert message in err
    assert "Traceback" not in err
    assert "SET " not in err  # not the command that failed, with its page bytes


def test_bench_checks_its_inputs_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(args: argparse.Namespace) -> list[Record]:
        raise AssertionError("ran with options that cannot work")

    monkeypatch.setattr(tree, "run", never)
    code, err = _bench_cli(capsys, "tree", "--trace", str(tmp_path / "absent.jsonl"))
    assert code == 2
    assert "absent.jsonl" in err
    # A --json path that cannot be written is found before the run, not after it.
    code, err = _bench_cli(
        capsys, "tree", "--requests", "5", "--json", str(tmp_path / "no-dir" / "r.json")
    )
    assert code == 2
    assert "no-dir" in err


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('"input_length": -5, "output_length": 1, "hash_ids": [1]', "$.input_length"),
        ('"input_length": 5, "output_length": -1, "hash_ids": [1]', "$.output_length"),
        ('"input_length": 5, "output_length": 1, "hash_ids": [-1]', "$.hash_ids[0]"),
        ('"input_length": 5, "output_length": 1, "hash_ids": [1, 4294967296]', "$.hash_ids[1]"),
        ('"input_length": 5, "output_length": 1, "hash_ids": [100000000000000000000000]', "$.hash"),
    ],
)
def test_a_trace_of_values_no_request_can_have_is_a_one_line_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    line: str,
    field: str,
) -> None:
    def never(args: argparse.Namespace) -> list[Record]:
        raise AssertionError("ran with a trace that cannot work")

    monkeypatch.setattr(trace, "run", never)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, ' + line + "}\n")
    code, err = _bench_cli(capsys, "trace", "--trace", str(path), "--storages", "off")
    assert code == 2, err
    assert field in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_trace_line_that_is_no_request_is_a_value_error_naming_the_line(
    tmp_path: Path,
) -> None:
    # msgspec's errors subclass ValueError only from 0.22 on: the commands catch ValueError.
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    for bad, why in ((good.replace("5", "-5"), "$.input_length"), ("{", "truncated")):
        path.write_text(f"{good}\n\n{bad}\n")
        with pytest.raises(ValueError, match=r"^line 3: ") as info:
            load_trace(path)
        assert type(info.value) is ValueError
        assert why in str(info.value)


def test_a_config_error_in_a_worker_process_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Scenarios run in a process pool: the worker's ConfigError comes back pickled.
    code, err = _bench_cli(
        capsys,
        *("trace", "--requests", "1", "--storages", "off", "--host-ratios", "0.5,2"),
        *("--jobs", "2", "--device-tokens", str(10**20)),
    )
    assert code == 1, err
    assert "invalid configuration at 'device_pages'" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_non_finite_records_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = [Record("x.ok", 1.0, "s"), Record.compare("x.nan", float("nan"), "s", 1.0)]
    with pytest.raises(ValueError, match=r"'x\.nan' has a non-finite value"):
        write_records(tmp_path / "r.json", bad)
    assert not (tmp_path / "r.json").exists()
    # Through the command line: the run itself went wrong, so 1, not a usage error.
    monkeypatch.setattr(tree, "run", lambda args: bad)
    code, err = _bench_cli(capsys, "tree", "--requests", "5", "--json", str(tmp_path / "r.json"))
    assert code == 1
    assert "non-finite" in err
    assert not (tmp_path / "r.json").exists()


def test_storage_workdir_keeps_a_quoted_path_inside_it(tmp_path: Path) -> None:
    parent = tmp_path / "a%41b#c"
    parent.mkdir()
    with storage_bench._workdir("file://" + quote(str(parent)) + "?spare=0") as (url, raw):
        store = FileStorage.from_url(url)
        assert store.root == raw.parent / "store"
        assert url.endswith("?spare=0")
    assert list(parent.iterdir()) == []
    assert list(tmp_path.iterdir()) == [parent]


def test_storage_memory_url_keeps_its_parameters() -> None:
    assert storage_bench._memory_url("memory://", 100) == "memory://?capacity=100"
    assert storage_bench._memory_url("memory://?spare=0", 100) == "memory://?spare=0&capacity=100"
    assert storage_bench._memory_url("memory://?capacity=1KiB", 100) == "memory://?capacity=1KiB"
    # The given capacity is the one used: too small for the pages, so the run says so.
    args = _args(storage_bench, ["--backend", "memory://?capacity=1KiB", "--shape", "small"])
    args.pages = 2
    with pytest.raises(SystemExit, match="capacity"):
        storage_bench.run(args)


def test_storage_exists_probes_64_keys_with_few_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[int] = []
    exists = MemoryStorage.exists

    async def spy(self: MemoryStorage, keys: list[bytes]) -> int:
        probed.append(len(keys))
        return await exists(self, keys)

    monkeypatch.setattr(MemoryStorage, "exists", spy)
    monkeypatch.setattr(storage_bench, "_EXISTS_CALLS", 3)
    args = _args(storage_bench, ["--backend", "memory://", "--shape", "small", "--pages", "2"])
    args.reps = 1
    records = storage_bench.run(args)
    assert probed
    assert set(probed) == {64}
    assert "storage.memory.small.exists64_us" in _by_name(records)


_PLUGIN = """
from hicache_async.storage import MemoryStorage

def make(url, *, mac_key=None):
    return MemoryStorage(capacity_bytes=1 << 26)
"""


def test_storage_plugin_import_path_runs_without_a_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hicache_benchplug.py").write_text(_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(storage_bench, "_EXISTS_CALLS", 3)
    url = "hicache_benchplug:make"
    assert storage_bench._scheme(url) is None
    args = _args(
        storage_bench, ["--backend", url, "--shape", "small", "--pages", "2", "--reps", "1"]
    )
    storage_bench.prepare(args)
    records = _by_name(storage_bench.run(args))
    assert set(records) == {
        "storage.plugin.small.put_gbps",
        "storage.plugin.small.get_gbps",
        "storage.plugin.small.exists64_us",
    }
    assert all(r.baseline is None for r in records.values())


def test_storage_raw_baseline_of_each_scheme() -> None:
    pytest.importorskip("redis")
    redis = storage_bench._raw_module("redis")
    assert redis is not None
    assert storage_bench._raw_module("rediss") is redis  # TLS: same baseline ("redi" is none)
    assert storage_bench._raw_module("no.such-scheme") is None  # not a module name: no crash
    assert storage_bench._raw_module("kvstore") is None


def test_trace_workers_log_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    saved = structlog.get_config()
    try:
        trace._configure_logging()
        structlog.get_logger("bench-test").warning("bench.trace.test_event")
        structlog.get_logger("bench-test").info("bench.trace.quiet_event")
    finally:
        structlog.configure(**saved)
    out, err = capsys.readouterr()
    assert "bench.trace.test_event" in err
    assert "bench.trace.test_event" not in out
    assert "quiet_event" not in out + err


def test_report_exits_1_when_a_job_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failed(job: report.Job, out_dir: Path, timeout_s: float) -> report.JobResult:
        return report.JobResult(
            key=job.key, title=job.title, kind=job.kind, command="c", status="failed"
        )

    monkeypatch.setattr(report, "run_job", failed)
    argv = ["--out-dir", str(tmp_path), "--docs", str(tmp_path / "p.md"), "--quick"]
    assert report.main([*argv, "--only", "copy"]) == 1
    assert "**Failed**" in (tmp_path / "p.md").read_text(encoding="utf-8")


def test_report_refuses_unknown_only_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        report.main(["--out-dir", str(tmp_path), "--quick", "--only", "tree,storage"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "storage" in err
    assert "storage-file" in err  # the known keys are listed
    assert not (tmp_path / "benchmarks.md").exists()


def test_report_render_only_writes_the_stored_runs_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    payload = {"machine": {"nproc": "2"}, "quick": True, "results": []}
    (out / "report.json").write_bytes(msgspec.json.encode(payload))
    # A quick run re-rendered without --quick still goes beside its JSON, not over the docs.
    assert report.main(["--out-dir", str(out), "--render-only"]) == 0
    assert (out / "benchmarks.md").exists()
    assert not (tmp_path / "docs").exists()
    payload["quick"] = False
    (out / "report.json").write_bytes(msgspec.json.encode(payload))
    assert report.main(["--out-dir", str(out), "--render-only", "--quick"]) == 0
    assert (tmp_path / "docs" / "benchmarks.md").exists()


# How the storage bench's raw baselines are chosen and timed.


def test_storage_pick_keeps_the_two_best_medians_of_interleaved_trials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storage_bench, "_MODE_TRIALS", 3)
    # Seconds of each trial per mode; one slow trial does not sink "a", one fast one does not
    # lift "c".
    seconds = {"a": [1.0, 9.0, 1.0], "b": [2.0, 2.0, 2.0], "c": [0.1, 5.0, 5.0], "d": [3.0] * 3}
    calls: list[str] = []

    def trial(mode: str) -> float:
        calls.append(mode)
        return seconds[mode][calls.count(mode) - 1]

    assert storage_bench._pick(list(seconds), trial) == ["a", "b"]
    assert calls == list(seconds) * 3  # round after round over every mode
    assert storage_bench._pick(["only"], lambda mode: 1.0) == ["only"]
    with pytest.raises(ValueError, match="no modes"):
        storage_bench._pick([], lambda mode: 1.0)


def _counted_checksums(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the bench's checksums from now on: the bytes of each call, in order."""
    hashed: list[int] = []
    checksum = storage_bench._native.checksum

    def counted(segments: list[memoryview]) -> int:
        hashed.append(sum(view.nbytes for view in segments))
        return checksum(segments)

    monkeypatch.setattr(storage_bench._native, "checksum", counted)
    return hashed


def test_storage_file_read_modes_each_read_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Five segments per page: pieces of the chunked mode straddle the segments' ends.
    data = storage_bench._Data(storage_bench.SHAPES["small"], 3, 5)
    keys = data.keys()
    paths = [str(tmp_path / key.hex()) for key in keys]
    with ThreadPoolExecutor(2) as pool, contextlib.ExitStack() as stack:
        storage_bench._raw_put(pool, paths, data)
        reads = storage_bench._FileReads(stack, paths, data)
        assert sorted(reads.modes) == sorted(
            f"{how}/t{n}" for how in ("preadv", "split", "chunked") for n in (2, 4, 8)
        )
        assert reads.modes == list(storage_bench._READ_MODES)
        for mode in reads.modes:
            assert reads(mode) > 0
            data.check()  # exits unless every page came back whole; then zeroes the pages
        hashed = _counted_checksums(monkeypatch)
        assert reads("split/t2", checked=True) > 0
        data.check()
        assert hashed == [data.nbytes] * 3  # each page hashed once, whole
        with pytest.raises(ValueError, match="unknown read mode 'mmap/t2'"):
            reads("mmap/t2")


def test_storage_file_put_modes_write_over_the_files_before_or_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = storage_bench._Data(storage_bench.SHAPES["small"], 4, 2)
    root, fresh = tmp_path / "raw", tmp_path / "fresh"
    root.mkdir()
    fresh.mkdir()
    page = bytes(storage_bench.HEADER_NBYTES) + bytes(data.source[: data.nbytes])

    def contents(folder: Path) -> list[bytes]:
        return [path.read_bytes() for path in sorted(folder.iterdir())]

    with contextlib.ExitStack() as stack:
        puts = storage_bench._FilePuts(stack, root, fresh, data, keep=3)
        assert puts.modes == ["t1", "t2", "t4", "t8"]
        for mode in puts.modes:
            # Held open, the files before keep their inodes (none is reused for a new file).
            held = [os.open(path, os.O_RDONLY) for path in puts.paths]
            try:
                assert puts.over(mode) > 0
                before = {os.fstat(fd).st_ino for fd in held}
            finally:
                for fd in held:
                    os.close(fd)
            # Every page in a file of its own; three of them the files before, renamed.
            assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in puts.paths)
            assert contents(root)[0] == page
            reused = {os.stat(path).st_ino for path in puts.paths} & before
            assert len(reused) == (3 if held else 0)
            assert puts.new(mode) > 0
            assert len(os.listdir(fresh)) == 4  # the new() before's files went first
            assert contents(fresh)[0] == page
        puts.discard()
        assert os.listdir(fresh) == []
        hashed = _counted_checksums(monkeypatch)
        assert puts.over("t2", checked=True) > 0
        assert hashed == [data.nbytes] * 4  # each page hashed once, whole
        assert contents(root)[0] == page
        with pytest.raises(ValueError, match="unknown write mode 't3'"):
            puts.over("t3")


def test_storage_file_baseline_reads_in_its_best_modes_each_from_a_cold_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    drop, call = storage_bench._drop_cache, storage_bench._FileReads.__call__

    def dropped(*dirs: Path) -> None:
        events.append("drop")
        drop(*dirs)

    def read(self: storage_bench._FileReads, mode: str, *, checked: bool = False) -> float:
        events.append(f"{mode}+xxh3" if checked else mode)
        return call(self, mode, checked=checked)

    monkeypatch.setattr(storage_bench, "_drop_cache", dropped)
    monkeypatch.setattr(storage_bench._FileReads, "__call__", read)
    monkeypatch.setattr(storage_bench, "_EXISTS_CALLS", 3)
    args = _args(
        storage_bench,
        ["--backend", f"file://{tmp_path}", "--shape", "small", "--pages", "2", "--reps", "2"],
    )
    records = _by_name(storage_bench.run(args))
    assert records["storage.file.small.get_cold_gbps"].baseline
    err = capsys.readouterr().err
    assert "file small: baseline put t" in err  # its thread counts, chosen as the reads' ways
    chosen = {}
    for figure in ("get_hot", "get_cold"):
        head = f"file small: baseline {figure} "
        line = next(x for x in err.splitlines() if x.startswith(head))
        chosen[figure] = line.removeprefix(head).split(" or ")
        assert len(chosen[figure]) == 2
    modes = list(storage_bench._READ_MODES)
    trials = storage_bench._MODE_TRIALS * len(modes)
    # Hot: trials of every mode in turn, then 4 runs (twice --reps) reading in both best,
    # plain and with each page hashed (the checked ceiling).
    assert events[:trials] == modes * storage_bench._MODE_TRIALS
    hot_runs = events[trials : trials + 4 * 4]
    assert sorted(hot_runs) == sorted(
        4 * [*chosen["get_hot"], *(f"{mode}+xxh3" for mode in chosen["get_hot"])]
    )
    assert records["storage.file.small.raw_checked_get_hot_gbps"].baseline == (
        records["storage.file.small.get_hot_gbps"].baseline
    )
    # Cold: every trial read, and every read of the pairs, right after an eviction; one pair
    # (--reps less one) of the store's read and the baseline's two best modes.
    cold = events[trials + 4 * 4 :]
    assert cold[: 2 * trials] == [
        e for m in modes * storage_bench._MODE_TRIALS for e in ("drop", m)
    ]
    first, second = chosen["get_cold"]
    assert cold[2 * trials :] == ["drop", "drop", first, "drop", second]  # ours went first


def test_storage_exists_is_the_median_of_as_many_calls_on_each_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts: list[tuple[str, int]] = []
    median_us, amedian_us = storage_bench.median_us, storage_bench.amedian_us

    def spy(call: Callable[[], object], calls: int) -> float:
        counts.append(("baseline", calls))
        return median_us(call, calls)

    async def aspy(call: Callable[[], Awaitable[object]], calls: int) -> float:
        counts.append(("ours", calls))
        return await amedian_us(call, calls)

    monkeypatch.setattr(storage_bench, "median_us", spy)
    monkeypatch.setattr(storage_bench, "amedian_us", aspy)
    monkeypatch.setattr(storage_bench, "_EXISTS_CALLS", 7)
    args = _args(storage_bench, ["--backend", "memory://", "--shape", "small", "--pages", "2"])
    args.reps = 1
    storage_bench.run(args)
    assert counts == [("ours", 7), ("baseline", 7)]


def test_median_us_times_each_call() -> None:
    ticks = iter(range(100))
    assert median_us(lambda: next(ticks), 5) >= 0
    assert next(ticks) == 5
    with pytest.raises(ValueError, match="calls must be >= 1"):
        median_us(lambda: None, 0)


def test_redis_baseline_reports_its_reply_parser(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    from hicache_async.bench import _storage_redis

    with _storage_redis.RawModes(redis_url, 1024, 4) as raw:
        # What the baseline's connections really parse with, sync and asyncio alike.
        client = redis.Redis.from_url(redis_url)
        try:
            conn = client.connection_pool.get_connection()
            parser = type(conn._parser).__name__
            client.connection_pool.release(conn)
        finally:
            client.close()
        assert raw.parser == ("hiredis" if "Hiredis" in parser else "python")
        assert ("hiredis" in raw.parser) == redis.utils.HIREDIS_AVAILABLE
        assert (raw.warning is None) == (raw.parser == "hiredis")
    args = _args(
        storage_bench,
        ["--backend", redis_url, "--shape", "small", "--pages", "2", "--reps", "1"],
    )
    storage_bench.run(args)
    err = capsys.readouterr().err
    assert f"; reply parser {raw.parser}\n" in err
    if raw.parser == "hiredis":
        assert "warning" not in err
    else:
        warning = next(line for line in err.splitlines() if line.startswith("warning: "))
        assert "not redis-py's fastest mode" in warning
        assert "pip install hiredis" in warning


def test_redis_baseline_opens_its_connections_before_timing(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from hicache_async.bench import _storage_redis

    watcher = redis.Redis.from_url(redis_url)
    opened: list[int] = []
    timed = _storage_redis._atimed

    def connections() -> int:
        return int(watcher.info("stats")["total_connections_received"])

    async def counted(run: Callable[[], Awaitable[None]]) -> float:
        before = connections()
        seconds = await timed(run)
        opened.append(connections() - before)
        return seconds

    monkeypatch.setattr(_storage_redis, "_atimed", counted)
    try:
        watcher.ping()
        with _storage_redis.RawModes(redis_url, 256 << 10, 8) as raw:
            modes = [m for m in raw.modes if m.startswith("async/w4")]
            assert modes
            for mode in modes:
                raw.put(mode)
                raw.get(mode)
    finally:
        watcher.close()
    assert opened == [0] * 2 * len(modes)


def test_redis_baseline_runs_its_asyncio_modes_on_the_stores_loop(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_async.bench import _storage_redis

    loops: list[type[asyncio.AbstractEventLoop]] = []
    timed = _storage_redis._atimed

    async def on(run: Callable[[], Awaitable[None]]) -> float:
        loops.append(type(asyncio.get_running_loop()))
        return await timed(run)

    monkeypatch.setattr(_storage_redis, "_atimed", on)
    with _storage_redis.RawModes(redis_url, 1024, 4) as raw:
        raw.put("async/w2/d1")
        raw.get("async/w2/d1")
    assert raw.modes
    loop = storage_bench.fastest_loop_factory()()
    loop.close()
    assert loops == [type(loop), type(loop)]
    with pytest.raises(RuntimeError, match="outside its with block"):
        raw.get("async/w2/d1")


def test_a_redis_that_fills_part_way_through_the_bench_keeps_none_of_its_pages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Room for the baseline's values and part of the store's pages: the store's put is
    # declined part-way, and the pages it had stored stayed in the server, keeping it full.
    full = ["--maxmemory", "80mb", "--maxmemory-policy", "noeviction"]
    with RedisServer(extra_args=full) as server:
        argv = ["storage", "--backend", server.url, "--shape", "small", "--pages", "64"]
        with pytest.raises(SystemExit, match="put returned"):
            _bench_cli(capsys, *argv, "--reps", "1")
        client = redis.Redis(host=server.host, port=server.port)
        try:
            assert client.dbsize() == 0
        finally:
            client.close()
