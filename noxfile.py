"""Developer sessions: tests, lint, typecheck, bench."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests"]

# torch is pinned in the same install as the project so pip never pulls a CUDA build.
TORCH = "torch==2.13.0"


def _install(session: nox.Session, extras: str = "dev") -> None:
    session.install("-e", f".[{extras}]", TORCH, "numpy")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (needs redis-server on PATH for the Redis tests)."""
    _install(session, "dev,mooncake")
    session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, with the async rules on."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package."""
    _install(session)
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark, then docs/benchmarks.md regenerated from their JSON."""
    _install(session, "dev,mooncake")
    session.run("python", "-m", "hicache_async.bench.report", *session.posargs)


@nox.session
def reliability(session: nox.Session) -> None:
    """The reliability suites at full size (CI runs their short versions)."""
    _install(session, "dev,mooncake")
    session.run(
        "pytest", "-q", "tests/reliability", *session.posargs, env={"HICACHE_RELIABILITY": "full"}
    )
