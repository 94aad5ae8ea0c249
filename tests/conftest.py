"""Shared fixtures; every async test runs under the default loop and under uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency everywhere but Windows
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


# Bugs the reliability suite pins and that are not fixed yet: the tests stay as they are and
# run; a known bug is reported as xfail (an unexpected pass shows as XPASS). Each entry says
# what is wrong; the open issue lists them too.
KNOWN_BUGS: dict[str, str] = {
    "tests/reliability/test_hostile_input.py::test_pool_sizes_no_machine_can_hold": (
        "pool sizes are not checked against the machine's memory before allocating"
    ),
    "tests/reliability/test_hostile_input.py::test_opening_with_an_overflowing_pool": (
        "an overflowing pool size surfaces as a torch error, not ConfigError"
    ),
    "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error": (
        "the registry lets some malformed URLs through as other exception types"
    ),
    "tests/reliability/test_hostile_input.py::test_bad_storage_when_opening": (
        "some bad backends fail with their own exception type when opened"
    ),
    "tests/reliability/test_hostile_input.py::test_unsafe_storage_roots_are_refused[symlink": (
        "a root that is itself a symlink is followed instead of refused"
    ),
    "tests/reliability/test_crash_consistency.py::test_verify_reports_the_leftovers": (
        "verify keeps temp files younger than its age limit, so a fresh kill's leftovers stay"
    ),
    "tests/reliability/test_fuzz_decoders.py::test_an_accepted_entry_fits_the_page_header": (
        "the manifest accepts entries whose token count exceeds their pages"
    ),
    "tests/reliability/test_no_blocking.py::test_closing_caches_does_not_join_threads": (
        "closing joins worker threads on the event loop's thread"
    ),
}


#: Cases of the tests above that already pass (their bug does not apply to them).
NOT_AFFECTED: frozenset[str] = frozenset(
    {
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error[''-'non-empty string']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['   '-'non-empty string']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error[None-'non-empty string']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error[3-'non-empty string']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error[b'file:///x'-'non-empty string']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['nope://x'-\"unknown storage scheme 'nope'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['http://example.com/'-\"unknown storage scheme 'http'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:relative'-'start with file://']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file://relative/path'-'absolute path']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?capacity=lots'-\"capacity='lots'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?capacity=-1'-\"capacity='-1'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?capacity=0'-'capacity']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?capacity=1e400'-\"capacity='1e400'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?capacity=1&capacity=2'-'given twice']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?bogus=1'-\"unknown parameter 'bogus'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?a'-'malformed query']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?fsync=maybe'-\"fsync='maybe'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?io_threads=0'-'io_threads']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?io_threads=-1'-\"io_threads='-1'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['file:///x?shared=maybe'-\"shared='maybe'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['memory://host'-'take no host']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['memory://?capacity=nan'-\"capacity='nan'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['memory://?capacity=0'-'capacity']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['mooncake://'-'host:port']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['redis://h?bogus=1'-\"unknown parameter 'bogus'\"]",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['no_such_module_xyz.sub:factory'-'cannot import storage plugin module']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['os:sep'-'is not callable']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_url_is_a_storage_config_error['os:no_such_attribute'-'not found']",
        "tests/reliability/test_hostile_input.py::test_bad_storage_when_opening_is_a_storage_config_error[dev-null]",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in NOT_AFFECTED:
            continue
        for prefix, reason in KNOWN_BUGS.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xfail(reason=f"known bug: {reason}", strict=False))
