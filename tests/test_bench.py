"""Smoke tests of the orchestration and trace benchmarks and the report, at tiny sizes.

They check that records are well formed and consistent with each other (ratios are
value / baseline, hit rates stay under their upper bound), never how fast anything is.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from hicache_async._trace import TraceRequest, load_trace, request_tokens
from hicache_async.bench import Record, orchestration, report, trace, write_records
from hicache_async.bench._sim import (
    LLAMA3_8B_H100,
    NoCacheEngine,
    percentile,
    simulate,
    upper_bound,
)


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
