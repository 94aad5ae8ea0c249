"""What to install for an optional extra: one wording for every place that names one.

Imported by the lazy exports, the pytest plugin's import path and `--version`, so it imports
nothing itself.
"""

from __future__ import annotations

__all__ = ["failed_import", "install_hint", "missing_module", "missing_package"]


def install_hint(extra: str) -> str:
    """The command that installs `extra`, as pip takes it."""
    return f"pip install 'hicache-async[{extra}]'"


def missing_package(what: str, package: str, extra: str) -> str:
    """`what` needs `package`, which `extra` brings: the message users and docs quote."""
    return f"{what} needs the {package!r} package: {install_hint(extra)}"


def missing_module(what: str, exc: ModuleNotFoundError, extra: str) -> ModuleNotFoundError:
    """`exc` again, saying which extra brings the missing package.

    Still a `ModuleNotFoundError` with the same `name`, which is what `from ... import` callers
    catch; raise it `from exc`.
    """
    package = (exc.name or "?").split(".")[0]
    return ModuleNotFoundError(missing_package(what, package, extra), name=exc.name)


def failed_import(what: str, module: str, exc: AttributeError) -> ImportError:
    """An `ImportError` for a lazy export whose module raised `exc` while it imported (a
    dependency too old to have a name it uses): left an `AttributeError`, `from ... import`
    would report only that `what` cannot be imported. Raise it `from exc`."""
    return ImportError(f"cannot import {what!r}: importing {module} failed: {exc!r}", name=module)
