"""The reference pages list what the code has: every setting with its default, every URL
parameter, command-line flag, log event, metric and error class, and the runnable examples
run and print what their comments say."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
from _log_table import documented_fields

import hicache_async
from hicache_async import (
    BackupConfig,
    CacheConfig,
    HiCache,
    KVLayout,
    PrefetchConfig,
    WarmupConfig,
    distributed,
)
from hicache_async.bench import BENCHMARKS
from hicache_async.cli import COMMANDS, _build_parser
from hicache_async.storage import _file, _memory, _mooncake, _redis

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _doc(name: str) -> str:
    return (DOCS / name).read_text()


def _all_docs() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))])


def _section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    ends = [body.find(f"\n{'#' * n} ") for n in range(1, len(level) + 1)]
    return body[: min([end for end in ends if end >= 0], default=len(body))]


def _table(section: str) -> dict[str, str]:
    """First column (a `name`) to second column of every table row in `section`."""
    return {
        match.group(1): match.group(2).strip()
        for match in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", section, re.M)
    }


def _default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.default is msgspec.NODEFAULT and field.default_factory is msgspec.NODEFAULT:
        return "required"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if isinstance(value, msgspec.Struct):
        return f"`{type(value).__name__}()`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@pytest.mark.parametrize(
    "cls", [CacheConfig, KVLayout, PrefetchConfig, BackupConfig, WarmupConfig], ids=str
)
def test_every_config_field_is_in_its_table_with_the_default_the_code_has(
    cls: type[msgspec.Struct],
) -> None:
    rows = _table(_section(_doc("configuration.md"), f"## `{cls.__name__}`"))
    fields = msgspec.structs.fields(cls)
    assert list(rows) == [field.name for field in fields]
    for field in fields:
        assert rows[field.name] == _default_text(field), field.name


def _url_section(scheme: str) -> str:
    return _section(_doc("configuration.md"), f"### `{scheme}`")


@pytest.mark.parametrize(
    ("scheme", "params"),
    [("file://", _file._URL_PARAMS), ("memory://", _memory._URL_PARAMS)],
    ids=["file", "memory"],
)
def test_every_url_parameter_of_file_and_memory_is_in_its_table(
    scheme: str, params: dict[str, str]
) -> None:
    assert list(_table(_url_section(scheme))) == list(params)


@pytest.mark.parametrize(
    ("params", "page", "scheme"),
    [
        (_redis._URL_PARAMS, "storage-redis.md", "`redis://`, `rediss://`"),
        (_mooncake._URL_PARAMS, "storage-mooncake.md", "`mooncake://`"),
    ],
    ids=["redis", "mooncake"],
)
def test_every_url_parameter_of_redis_and_mooncake_is_listed_and_described(
    params: dict[str, str], page: str, scheme: str
) -> None:
    listed = re.findall(r"`(\w+)`", _section(_doc("configuration.md"), f"### {scheme}"))
    assert set(params) <= set(listed)
    described = set()
    for row in re.findall(r"^\| ([^|]+) \|", _section(_doc(page), "## URL"), re.M):
        described.update(re.findall(r"`(\w+)`", row))
    assert set(params) <= described


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_and_its_flags_are_in_the_docs(command: str) -> None:
    docs = _all_docs()
    assert f"hicache-async {command}" in docs
    parser = _subparsers(_build_parser([command]))[command]
    for action in parser._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                assert option in docs, f"{command} {option}"
        if action.option_strings and action.choices is not None:
            for choice in action.choices:
                assert f"{choice}" in docs, f"{command} {action.option_strings[0]} {choice}"


def test_every_benchmark_is_in_the_docs() -> None:
    docs = _all_docs()
    for kind in BENCHMARKS:
        assert f"hicache-async bench {kind}" in docs, kind


def test_every_log_event_is_in_the_table_of_events() -> None:
    # The table names each event, or a family of them as `prefix.*`.
    logs = _section(_doc("operations.md"), "## Logs")
    named = set(re.findall(r"`((?:hicache|storage|tp)\.[a-z_.]+)`", logs))
    families = {match.rstrip("*.") for match in re.findall(r"`([a-z_.]+\.\*)`", logs)}
    events = {
        event
        for path in sorted((ROOT / "hicache_async").rglob("*.py"))
        for event in re.findall(
            r"[\"']((?:hicache|storage|tp)\.[a-z_]+(?:\.[a-z_]+)+)[\"']", path.read_text()
        )
    }
    assert len(events) > 50
    missing = sorted(
        event
        for event in events
        if event not in named and not any(event.startswith(f"{f}.") for f in families)
    )
    assert missing == []


_LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


def test_each_event_logged_by_name_has_only_the_fields_its_row_names() -> None:
    # Every call that names its event and fields (`log.warning("event", field=...)`): a
    # field the table leaves out is one an operator's query cannot know of. Lines built
    # through the rate limiters are compared where the tests log them (test_storm_logs).
    rows = documented_fields()
    calls: list[tuple[str, str, set[str]]] = []
    for path in sorted((ROOT / "hicache_async").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _LOG_METHODS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in rows
            ):
                continue
            fields = {keyword.arg for keyword in node.keywords if keyword.arg is not None}
            place = f"{path.relative_to(ROOT)}:{node.lineno}"
            calls.append((place, node.args[0].value, fields - {"exc_info"}))
    assert len(calls) > 50
    undocumented = [
        (place, event, sorted(fields - rows[event]))
        for place, event, fields in calls
        if not fields <= rows[event]
    ]
    assert undocumented == []


def _expand(name: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", name)
    if match is None:
        return [name]
    return [
        expanded
        for part in match.group(1).split(",")
        for expanded in _expand(name[: match.start()] + part + name[match.end() :])
    ]


async def test_the_metric_table_lists_every_family_a_cache_with_storage_exports() -> None:
    config = CacheConfig(
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8),
        page_size=4,
        device_pages=8,
        model_id="docs-metrics",
        storage=f"file://{tempfile.mkdtemp()}?capacity=1MiB",
    )
    async with HiCache(config) as cache:
        text = cache.metrics_text()
    exported = set(re.findall(r"^# TYPE (\S+) \S+$", text, re.M))
    table = _section(_doc("operations.md"), "### Prometheus").split("| metric |", 1)[1]
    listed: set[str] = set()
    for row in re.findall(r"^\| ([^|]+) \|", table, re.M):
        names = re.findall(r"`([^`]+)`", row)
        for name in names:
            # `_host` after `hicache_tier_tokens_device` shares its stem.
            full = names[0].rsplit("_", 1)[0] + name if name.startswith("_") else name
            listed.update(_expand(full))
    # The flushing series exist only while a detach flushes: listed, not exported here.
    assert exported == {name for name in listed if not name.startswith("hicache_flushing_")}


def test_the_error_table_gives_each_class_its_bases() -> None:
    rows = _table(_section(_doc("api.md"), "### Errors"))
    assert len(rows) >= 13
    for name, bases in rows.items():
        cls = getattr(hicache_async, name, None) or getattr(distributed, name)
        assert re.findall(r"`(\w+)`", bases) == [base.__name__ for base in cls.__bases__], name


# Runnable examples: (page, a line the block starts with, what its output must hold).
_RUNNABLE = [
    ("api.md", 'model_id="api-prefetch"', ["complete 400 400"]),
    ("api.md", 'model_id="api-slots"', ["2 pages committed", "device=8"]),
    ("api.md", "rank0, rank1 = Namespace.from_config", ["2 "]),
    ("api.md", '"model_id": "api-faults"', ["FaultCounts("]),
    ("architecture.md", 'model_id="architecture"', [""]),
    ("configuration.md", "# In code", [""]),
    ("operations.md", 'model_id="ops-switch"', ["memory://?capacity=1073741824 2"]),
    ("api.md", 'model_id="api-prometheus"', ["metric families"]),
]


def _block(page: str, marker: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", _doc(page), re.S | re.M)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"{page}: {marker}"
    return found[0]


@pytest.mark.parametrize(("page", "marker", "expected"), _RUNNABLE, ids=lambda v: str(v)[:24])
def test_a_runnable_example_runs_and_prints_what_it_says(
    page: str, marker: str, expected: list[str], tmp_path: Path
) -> None:
    block = _block(page, marker)
    if "prometheus_client" in block:
        pytest.importorskip("prometheus_client")  # the `prometheus` extra
    script = tmp_path / "example.py"
    script.write_text(block)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for text in expected:
        assert text in result.stdout, (text, result.stdout)


def test_the_demo_runs_shown_give_the_upper_bound_the_code_computes() -> None:
    from hicache_async._trace import load_trace
    from hicache_async.demo import DemoOptions, reuse_upper_bound, select_requests

    options = DemoOptions()
    requests = select_requests(load_trace(), options.requests, options.max_prompt_tokens)
    total = sum(request.input_length for request in requests)
    bound = reuse_upper_bound(requests, page_size=options.page_size)
    runs = re.findall(
        r"^```text\n\$ time python -m hicache_async demo.*?^```", _doc("demo.md"), re.S | re.M
    )
    assert len(runs) == 2
    for run in runs:
        tiers = {
            label: int(value.replace(",", ""))
            for label, value in re.findall(
                r"^  (device|host|storage) \(L\d\)\s+([\d,]+)", run, re.M
            )
        }
        assert f"{total:,} prompt tokens" in run
        assert f"upper bound of {100 * bound / total:.1f}%" in run
        assert f"{100 * sum(tiers.values()) / bound:.1f}% of the reachable reuse" in run


@pytest.mark.parametrize(
    "module", ["", ".workers", ".transfer", ".storage", ".testing", ".distributed", ".admin"]
)
def test_the_api_reference_names_every_public_name(module: str) -> None:
    # docs/index.md promises every public name of these modules.
    names: list[str] = importlib.import_module(f"hicache_async{module}").__all__
    api = _doc("api.md")
    assert [name for name in names if not re.search(rf"\b{re.escape(name)}\b", api)] == []


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_reaches_a_file_and_heading() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

    def prose(page: Path) -> str:
        return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)

    anchors = {
        page.resolve(): {_slug(h) for h in re.findall(r"^#+ (.*)$", prose(page), re.M)}
        for page in pages
    }
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            # Anchors are checked in these pages only.
            if not dest.exists() or anchor not in anchors.get(dest, {anchor}) | {""}:
                broken.append(f"{page.name}: {target}")
    assert broken == []


def _cells(row: str) -> list[str]:
    """A table row's cells, split at the pipes outside code spans and not escaped."""
    cells, cell, code = [], "", ""
    for token in re.findall(r"\\.|`+|[^\\`|]+|\|", row):
        if token.startswith("`"):
            code = "" if token == code else code or token
        elif token == "|" and not code:
            cells.append(cell)
            cell = ""
            continue
        cell += token
    return [*cells, cell]


def test_every_table_row_has_as_many_cells_as_its_header() -> None:
    # Text past a row's last pipe is a cell the header has no column for: a renderer drops
    # it, and the sentence never shows.
    wrong = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        # Code blocks blanked, their lines kept: the numbers are the file's.
        text = re.sub(
            r"^```.*?^```",
            lambda block: "\n" * block.group().count("\n"),
            page.read_text(),
            flags=re.S | re.M,
        )
        width: int | None = None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.startswith("|"):
                width = None
            elif re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                width = line.strip().count("|") - 1
            elif width is not None:
                cells = _cells(line.strip())
                if cells[0] or cells[-1].strip() or len(cells) - 2 != width:
                    wrong.append(f"{page.name}:{number}: {line[-60:]}")
    assert wrong == []


def test_the_example_configuration_file_loads_with_the_sizes_the_text_gives() -> None:
    text = _doc("configuration.md")
    (toml,) = re.findall(r"^```toml\n(.*?)^```", text, re.S | re.M)
    config = CacheConfig.from_toml(toml)
    kib, mib, gib = 1 << 10, 1 << 20, 1 << 30
    figures = (
        f"{config.layout.token_nbytes // kib} KiB per token, "
        f"{config.page_nbytes // mib} MiB per {config.page_size}-token page, "
        f"{config.device_pages * config.page_nbytes // gib} GiB of device pool and "
        f"{config.resolved_host_pages * config.page_nbytes // gib} GiB of host pool"
    )
    assert figures in " ".join(text.split())
