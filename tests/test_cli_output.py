"""A command whose stdout cannot take its output ends with exit status 1 and one line on
stderr, as `hicache-async storage` does (tests/test_storage_cli.py), not with a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = {
    "example": ["example", "--requests", "1", "--storage", "none"],
    "demo": [
        *("demo", "--requests", "1", "--max-prompt-tokens", "1024", "--storage", "none"),
        *("--device-pages", "64", "--host-pages", "128", "--time-compression", "1000"),
    ],
    "bench": ["bench", "tree", "--requests", "5"],
}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_full_stdout_is_a_one_line_error(name: str, tmp_path: Path) -> None:
    argv = list(COMMANDS[name])
    records = tmp_path / "records.json"
    if name == "bench":
        argv += ["--json", str(records)]
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "hicache_async", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=300,
        )
    assert result.returncode == 1, result.stderr
    assert f"hicache-async {' '.join(argv[:2]) if name == 'bench' else name}: error: cannot " in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    if name == "bench":
        # The table could not be shown; the records of the run are still written.
        assert json.loads(records.read_text())


def test_version_prints_the_installed_distribution_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.metadata

    import hicache_async
    from hicache_async.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    # The package's version is the distribution's: pyproject.toml reads it from the package.
    installed = importlib.metadata.version("hicache-async")
    assert capsys.readouterr().out.strip() == f"hicache-async {hicache_async.__version__}"
    assert hicache_async.__version__ == installed
