"""Promises about the project itself: CI runs README's test command."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _quickstart() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README's Quickstart has no fenced bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_has_two_commands_demo_then_tests() -> None:
    commands = _quickstart()
    assert len(commands) == 2
    assert "hicache_async demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_exactly_readmes_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == _quickstart()[1]


def test_the_package_calls_nothing_newer_than_its_oldest_python() -> None:
    # pyproject says >=3.10, CI runs 3.11: these would pass every test here and fail there.
    assert 'requires-python = ">=3.10"' in (ROOT / "pyproject.toml").read_text()
    newer = re.compile(
        r"asyncio\.Runner\b|asyncio\.timeout\b|asyncio\.TaskGroup\b|rmtree\([^)]*dir_fd"
    )
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "hicache_async").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if newer.search(line)
    ]
    assert found == []


def test_every_extra_is_named_for_users_and_every_named_extra_exists() -> None:
    # A user learns an extra from an install command in the docs or in an error message; one
    # named there but missing from pyproject makes pip warn and install nothing.
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as f:
        defined = set(tomllib.load(f)["project"]["optional-dependencies"])
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts += sorted((ROOT / "hicache_async").rglob("*.py"))
    texts += [ROOT / "scripts" / "setup.sh", ROOT / "noxfile.py"]
    named: dict[str, str] = {}
    for path in texts:
        for match in re.finditer(r"(?:hicache-async|\.)\[([a-z,{}]+)\]", path.read_text()):
            for extra in match.group(1).split(","):
                if not extra.startswith("{"):  # a placeholder filled from pyproject's names
                    named.setdefault(extra, str(path.relative_to(ROOT)))
    assert {e: p for e, p in named.items() if e not in defined} == {}
    assert sorted(defined - set(named)) == []


def _project() -> dict[str, Any]:
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


#: Calls the package makes that its dependencies' older releases lack, with the first release
#: of each that has them: pip keeps an installed release that meets the declared bound.
_FIRST_RELEASE_WITH = [
    (r"structs\.force_setattr\(", "msgspec", "0.18.5"),
    (r"json\.encode\([^)]*\border=", "msgspec", "0.18.6"),
    (r"\bpool\.get_connection\(\)", "redis", "5.3"),  # without a command name
    (r"super\(\)\.__init__\(client, transaction\)", "redis", "6.2"),  # a cluster pipeline's
    (r"\babandon_on_cancel=", "anyio", "4.1"),
]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_lower_bounds_admit_no_release_without_a_call_the_package_makes() -> None:
    project = _project()
    bounds: dict[str, str] = {}
    for requirement in [*project["dependencies"], *project["optional-dependencies"].values()]:
        for line in requirement if isinstance(requirement, list) else [requirement]:
            if found := re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", line):
                bounds[found.group(1).lower()] = found.group(2)
    source = "\n".join(p.read_text() for p in sorted((ROOT / "hicache_async").rglob("*.py")))
    too_low = {}
    for call, distribution, first in _FIRST_RELEASE_WITH:
        assert re.search(call, source), f"{call} is no longer called: drop it from the table"
        if _version(bounds[distribution]) < _version(first):
            too_low[call] = f"{distribution}>={bounds[distribution]}, first in {first}"
    assert too_low == {}


def test_uvloop_comes_with_the_bench_and_testing_extras_only() -> None:
    # Only `hicache-async bench` and the tests (every async test under both loops) use it.
    project = _project()
    assert [d for d in project["dependencies"] if d.startswith("uvloop")] == []
    extras = project["optional-dependencies"]
    for extra in ("bench", "testing"):
        assert any(d.startswith("uvloop") for d in extras[extra]), extra
    assert "bench" in re.search(r"hicache-async\[([a-z,]+)\]", " ".join(extras["dev"])).group(1)


def test_the_suite_collects_without_uvloop_and_names_only_loops_it_runs_under() -> None:
    # uvloop left the dependencies: an unguarded import stopped the whole run at collection,
    # and suites named "uvloop" ran under asyncio's loop still called so.
    import os
    import subprocess

    without = "import sys; sys.modules['uvloop'] = None; import pytest; sys.exit(pytest.main())"
    files = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("*.py")
        if "uvloop" in path.read_text()
        and path.name.startswith("test_")
        and path.name not in {"test_project.py", "test_bench.py"}
    )
    assert "tests/test_embedding.py" in files
    done = subprocess.run(
        [sys.executable, "-c", without, "--co", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    tests = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(tests) > 100
    assert [test for test in tests if "uvloop" in test] == []


def test_the_classifiers_say_what_the_package_supports() -> None:
    import tomllib

    project = _project()
    classifiers: list[str] = project["classifiers"]
    versions = [
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    # A lower bound only, so that a newer interpreter installs it (CI runs whichever `python3`
    # the machine has): the classifiers list the versions from that bound on, none skipped,
    # whatever interpreter runs this test.
    oldest = re.fullmatch(r">=3\.(\d+)", project["requires-python"])
    assert oldest is not None
    minors = [int(v.split(".")[1]) for v in versions]
    first = int(oldest.group(1))
    assert minors == list(range(first, first + len(minors))), versions
    # The type check holds the package to the oldest, which the classifiers begin with.
    with (ROOT / "pyproject.toml").open("rb") as f:
        assert tomllib.load(f)["tool"]["mypy"]["python_version"] == versions[0]
    assert "Framework :: AsyncIO" in classifiers
    # Typed only while the marker ships.
    assert "Typing :: Typed" in classifiers
    assert (ROOT / "hicache_async" / "py.typed").is_file()
    assert "py.typed" in (ROOT / "pyproject.toml").read_text().split("package-data]", 1)[1]
    # The license is the `license` expression; setuptools refuses a License classifier too.
    assert project["license"] == "Apache-2.0"
    assert [c for c in classifiers if c.startswith("License ::")] == []


def test_the_package_lets_the_loop_run_once_in_one_way() -> None:
    # anyio's checkpoint honours anyio's cancel scopes. The one sleep(0) left is the file
    # store's lookup, where the backend lookup behind anyio's costs a measurable share.
    other = re.compile(r"asyncio\.sleep\(0\)|def _turn\b|await _turn\(")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "hicache_async").rglob("*.py"))
        if path.name != "_conformance.py"  # its sleeps let the tests' own tasks start
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if other.search(line)
    ]
    assert [f.rsplit(":", 1)[0] for f in found] == ["hicache_async/storage/_file.py"], found
