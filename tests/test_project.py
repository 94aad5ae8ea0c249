"""Promises about the project itself: CI runs README's test command."""

from __future__ import annotations

import re
from pathlib import Path

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
