"""Credentials in storage URLs are masked in every message: when a password holds an unescaped
'/', '?', '#' or '@', where the userinfo ends is ambiguous, and the masking takes the wider
reading (up to the URL's last '@')."""

from __future__ import annotations

import pytest

from hicache_async.storage import StorageConfigError, open_storage
from hicache_async.storage._redact import mask_userinfo, scrub_secrets, url_secrets

# (URL, the secret parts no message may quote)
LEAKY = [
    ("redis://user:P@ss/w0rd@host:6379/0", ["P@ss/w0rd", "w0rd"]),
    ("redis://admin:2024/Secret@host:6379/0", ["2024/Secret", "Secret"]),
    ("redis://:p@ss#word@host", ["p@ss#word", "word"]),
    ("redis://tok3n/abcdef@host", ["tok3n/abcdef", "abcdef"]),
    ("redis://user:pass@host:6379/0", ["pass"]),
    ("redis://user:p%40ss%2Fword@host:6379/0", ["p%40ss%2Fword", "p@ss/word"]),
]


@pytest.mark.parametrize(("url", "secrets"), LEAKY)
def test_an_ambiguous_password_is_masked_whole(url: str, secrets: list[str]) -> None:
    masked = mask_userinfo(url)
    assert masked.startswith("redis://***@"), masked
    found = url_secrets(url)
    for secret in secrets:
        assert secret not in masked
        assert secret in found
        assert secret not in scrub_secrets(f"cannot open {url}: bad {secret}", url)


@pytest.mark.parametrize(
    "url",
    ["redis://user:P@ss/w0rd@127.0.0.1:1/0", "redis://admin:2024/Secret@127.0.0.1:1/0"],
)
def test_open_storage_errors_never_quote_the_password(url: str) -> None:
    with pytest.raises(StorageConfigError) as caught:
        open_storage(url)
    message = str(caught.value)
    for secret in ("w0rd", "Secret", "P@ss", "2024"):
        assert secret not in message


def test_a_url_without_userinfo_is_kept() -> None:
    for url in ("redis://host:6379/0", "file:///var/cache/pages", "memory://?capacity=1GiB"):
        assert mask_userinfo(url) == url
        assert url_secrets(url) == []
