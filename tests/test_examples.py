"""Every example runs, as a user would run it, and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

EXPECTED = {
    "quickstart.py": "attempt 2: 96 of 100 tokens came from the cache",
    "http_handler.py": "turn 1: {'tokens': 104, 'cached': 64",
    "attach_detach.py": "attached at the end: False",
    "fault_scenario.py": "0 failed",
    "cold_start_warmup.py": "all matched",
    "storage_plugin.py": "a fresh cache read 200 tokens back",
    "tensor_parallel.py": "ranks agree",
}


def test_every_example_is_covered() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} <= set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str, tmp_path: Path) -> None:
    path = EXAMPLES / name
    if not path.exists():
        pytest.fail(f"{name} is missing")
    result = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert EXPECTED[name] in result.stdout
