"""The package imports torch only when something that needs it is used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hicache_async


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_every_public_name_resolves_to_its_module() -> None:
    exports = hicache_async._EXPORTS
    assert set(exports) | {"__version__"} == set(hicache_async.__all__)
    for name, module in exports.items():
        value = getattr(hicache_async, name)
        assert value.__module__.startswith(f"hicache_async{module}"), (name, value.__module__)
    assert set(hicache_async.__all__) <= set(dir(hicache_async))


def test_an_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        hicache_async.NoSuchThing  # noqa: B018


# A module that fails while it imports as one built against a newer dependency would: it
# reads an attribute the installed version lacks.
_PLANT = """
import importlib.abc, importlib.util, sys, types

class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        types.TooNewForThisPython

sys.meta_path.insert(0, Broken())
"""


@pytest.mark.parametrize(
    ("package", "name", "module"),
    [
        ("hicache_async", "CacheConfig", "hicache_async._config"),
        ("hicache_async.storage", "RedisStorage", "hicache_async.storage._redis"),
        ("hicache_async.testing", "KVGenerator", "hicache_async.testing._kvgen"),
    ],
)
def test_a_module_failing_as_it_imports_is_named_with_its_error(
    package: str, name: str, module: str
) -> None:
    # Left an AttributeError, `from ... import` would say only that the name cannot be
    # imported, and `hasattr` would answer False.
    done = _run(
        _PLANT.format(module=module)
        + f"import {package}\n"
        + f"assert {module!r} not in sys.modules\n"
        + "try:\n"
        + f"    from {package} import {name}\n"
        + "except ImportError as exc:\n"
        + "    assert isinstance(exc.__cause__, AttributeError), repr(exc.__cause__)\n"
        + f"    assert exc.name == {module!r}, exc.name\n"
        + "    print(exc)\n"
        + "else:\n"
        + "    raise AssertionError('imported')\n"
        + "try:\n"
        + f"    {package}.NoSuchThing\n"
        + "except AttributeError as exc:\n"
        + f"    assert str(exc) == \"module '{package}' has no attribute 'NoSuchThing'\", exc\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"cannot import {name!r}: importing {module} failed: "
        "AttributeError(\"module 'types' has no attribute 'TooNewForThisPython'\")"
    )


def test_storage_and_errors_do_not_import_torch() -> None:
    done = _run(
        "import sys, hicache_async, hicache_async.storage, hicache_async._errors\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "hicache_async.StorageError\n"
        "assert 'torch' not in sys.modules, 'torch imported by an error class'\n"
        "hicache_async.HiCache\n"
        "assert 'torch' in sys.modules\n"
    )
    assert done.returncode == 0, done.stderr


def test_a_storage_command_does_not_import_torch(tmp_path: Path) -> None:
    root = tmp_path / "store"
    done = _run(
        "import asyncio, json, sys\n"
        "from hicache_async.storage import FileStorage\n"
        "from hicache_async.cli import main\n"
        "async def create():\n"
        f"    async with FileStorage({str(root)!r}) as storage:\n"
        "        assert await storage.exists([]) == 0\n"
        "asyncio.run(create())\n"
        f"code = main(['storage', 'stats', '--json', 'file://{root}'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "sys.exit(code)\n"
    )
    assert done.returncode == 0, done.stderr
    assert '"pages": 0' in done.stdout or '"pages":0' in done.stdout, done.stdout


@pytest.mark.parametrize("argv", [["--version", "demo"], ["--vers", "example"]])
def test_version_before_a_command_does_not_load_the_command(argv: list[str]) -> None:
    # argparse prints the version before the command parses its own options, so the
    # command's module (torch, seconds of start-up) has nothing to add.
    done = _run(
        "import sys\n"
        "from hicache_async.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as ended:\n"
        "    assert ended.code == 0, ended.code\n"
        "else:\n"
        "    raise AssertionError('--version did not exit')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"hicache-async {hicache_async.__version__}"


def test_the_chosen_benchmark_parses_its_own_options() -> None:
    done = _run(
        "import sys\nfrom hicache_async.cli import main\nmain(['bench', 'storage', '--help'])\n"
    )
    assert done.returncode == 0, done.stderr
    assert "--backend" in done.stdout
    bad = _run("from hicache_async.cli import main\nmain(['bench', 'storage', '--no-such'])\n")
    assert bad.returncode == 2
    assert "unrecognized arguments: --no-such" in bad.stderr


def test_the_pytest_plugin_does_not_import_numpy() -> None:
    # Nor numpy (about 0.2 s cold, in every pytest run of the environment): the plugin's
    # fixtures and `serve` import what they need when they run.
    done = _run(
        "import sys, hicache_async.testing.pytest_plugin\n"
        "from hicache_async.testing import ServedRequest, assert_drained, serve\n"
        "assert 'numpy' not in sys.modules, 'numpy imported'\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_pytest_plugin_does_not_import_torch() -> None:
    # pytest loads the plugin in every run of an environment that has the package: a project
    # whose tests never touch the cache must not pay for torch.
    done = _run(
        "import sys, hicache_async.testing.pytest_plugin\n"
        "from hicache_async.testing import assert_drained, serve\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import hicache_async.testing as testing\n"
        "assert set(testing.__all__) <= set(dir(testing)), 'lazy names not listed'\n"
        "from hicache_async.testing import KVGenerator\n"
        "assert KVGenerator.__module__ == 'hicache_async.testing._kvgen'\n"
        "assert 'torch' in sys.modules\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_install_command_of_an_extra_is_worded_in_one_place() -> None:
    # Every message naming an extra builds its command with `_extras`, so they cannot drift.
    package = Path(hicache_async.__file__).parent
    wording = "hicache-async" + "["
    found = sorted(
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if wording in path.read_text(encoding="utf-8")
    )
    assert found == ["_extras.py"]


def test_the_install_hint_module_imports_nothing() -> None:
    # The lazy exports and the pytest plugin's import path use it: it must stay light.
    done = _run(
        "import sys, hicache_async\n"
        "before = set(sys.modules)\n"
        "import hicache_async._extras\n"
        "added = set(sys.modules) - before - {'hicache_async._extras'}\n"
        "assert not added, sorted(added)\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_hints_of_the_methods_taking_token_ids_resolve_at_run_time() -> None:
    # Tools that read hints at run time (beartype, typeguard, sphinx) resolve them in the
    # package's modules, where torch is a name for type checkers only.
    done = _run(
        "import typing\n"
        "from hicache_async import HiCache, page_keys\n"
        "for f in (HiCache.match, HiCache.request, HiCache.keys_for, HiCache.start_prefetch,\n"
        "          HiCache.prefetch, HiCache.agree_cached_tokens, page_keys):\n"
        "    typing.get_type_hints(f)\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_hints_of_the_testing_helpers_resolve_without_torch() -> None:
    # `serve` and `assert_drained` are imported by the pytest plugin's users without torch
    # (or numpy): their hints name the cache, the prompt and the generator all the same.
    done = _run(
        "import sys, typing\n"
        "from hicache_async.testing import assert_drained, serve\n"
        "assert typing.get_type_hints(serve)['return'].__name__ == 'ServedRequest'\n"
        "typing.get_type_hints(assert_drained)\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_hints_of_every_public_function_and_method_resolve_at_run_time() -> None:
    done = _run(
        "import importlib, inspect, typing\n"
        "failed = []\n"
        "for module in ('hicache_async', 'hicache_async.testing', 'hicache_async.storage'):\n"
        "    m = importlib.import_module(module)\n"
        "    for name in m.__all__:\n"
        "        obj = getattr(m, name)\n"
        "        found = [(name, obj)] if inspect.isfunction(obj) else []\n"
        "        if inspect.isclass(obj):\n"
        "            for attr, member in vars(obj).items():\n"
        "                if attr.startswith('_') and attr != '__init__':\n"
        "                    continue\n"
        "                member = getattr(member, '__func__', member)\n"
        "                member = getattr(member, 'fget', member)\n"
        "                if inspect.isfunction(member):\n"
        "                    found.append((f'{name}.{attr}', member))\n"
        "        for label, function in found:\n"
        "            try:\n"
        "                typing.get_type_hints(function)\n"
        "            except NameError as exc:\n"
        "                failed.append(f'{module}.{label}: {exc}')\n"
        "assert not failed, failed\n"
    )
    assert done.returncode == 0, done.stderr
