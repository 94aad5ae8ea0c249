"""Credentials in storage URLs are masked in every message: when a password holds an unescaped
'/', '?', '#' or '@', where the userinfo ends is ambiguous, and the masking takes the wider
reading (up to the URL's last '@' that is not a query parameter's data)."""

from __future__ import annotations

from urllib.parse import unquote

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


# (URL, its userinfo): an '@' in a query's parameter after a host without userinfo is data;
# one in a fragment, a query that is not parameters, or an authority without a valid host,
# leaves the wider reading.
WHERE_THE_USERINFO_ENDS = [
    ("redis://host:6379/0?name=a@b", None),
    ("redis://host:6379/0?name=a@b&x=c@d", None),
    ("redis://[::1]:6379/0?name=a@b", None),
    ("redis://[fe80::1%25eth0]:6379?client_name=x@y", None),
    ("rediss://host?name=a@b;other=1", None),
    ("redis://host:6379/0#a@b", "host:6379/0#a"),
    ("redis://host?name=a@b#c@d", "host?name=a@b#c"),
    ("redis://u:p@host/0?name=a@b&x=1", "u:p"),
    ("redis://u:p@[::1]:6379/0?name=a@b", "u:p"),
    ("redis://:pw@host?name=a@b", ":pw"),
    ("redis://u:p@host/0#a@b", "u:p@host/0#a"),
    ("redis://host/a@b", "host/a"),
    ("redis://:pa?ss@host", ":pa?ss"),
    ("redis://:x?a=b@host", ":x?a=b"),
    ("redis://u:pw#x@host", "u:pw#x"),
    ("redis://u:p?x@host/0?name=a@b", "u:p?x@host/0?name=a"),
    ("redis://u:p@[::1]:6379/0", "u:p"),
    ("plug://host?password=s3cret@x&name=a", "host?password=s3cret"),
    ("plug://host?name=a@b&Token=s3cret@x", "host?name=a@b&Token=s3cret"),
    # A URL given as a parameter may carry credentials of its own: the wider reading.
    ("mooncake://m:50051?admin=http://u:s3cret@h:8080", "m:50051?admin=http://u:s3cret"),
    (
        "mooncake://m:50051?metadata=etcd://u:s3cret@h:2379&x=a@b",
        "m:50051?metadata=etcd://u:s3cret@h:2379&x=a",
    ),
]


@pytest.mark.parametrize(("url", "userinfo"), WHERE_THE_USERINFO_ENDS)
def test_an_at_sign_after_the_host_is_not_a_secret(url: str, userinfo: str | None) -> None:
    masked = mask_userinfo(url)
    if userinfo is None:
        assert masked == url
        assert url_secrets(url) == []
        assert scrub_secrets(f"cannot open {url}", url) == f"cannot open {url}"
    else:
        scheme, _, rest = url.partition("://")
        assert masked == f"{scheme}://***@{rest[len(userinfo) + 1 :]}"
        assert userinfo in url_secrets(url)
        if "s3cret" in userinfo:
            assert "s3cret" not in masked
            assert "s3cret" not in scrub_secrets(f"cannot open {url}", url)


# (URL, the password no message may quote): passwords that begin with '#' or '?' after a
# `user:` that reads as a host with an empty port, a '#' after a port-like password, a query
# that is not words, and credentials of a URL given as a parameter, percent-encoded or not.
LEAKY_AFTER_THE_HOST = [
    ("redis://user:#s3cretpw@host:6379/0", "#s3cretpw"),
    ("redis://default:?a=s3cretpw@host:6379", "?a=s3cretpw"),
    ("file://user:#s3cretpw@host/x", "#s3cretpw"),
    ("memory://user:#s3cretpw@host", "#s3cretpw"),
    ("mooncake://user:#s3cretpw@host:50051", "#s3cretpw"),
    ("nosuch://user:#s3cretpw@host", "#s3cretpw"),
    ("redis://u:4#s3cretpw@host", "4#s3cretpw"),
    ("redis://tok3n#s3cretpw@host", "tok3n#s3cretpw"),
    ("redis://user:1?x=$3cret pw@host", "1?x=$3cret pw"),
    ("mooncake://m:50051?metadata=Http%3A//u:s3cretpw@h:8080/m", "s3cretpw"),
    ("mooncake://m:50051?metadata=Http%3A%2F%2Fu%3As3cretpw%40h%3A8080%2Fm", "s3cretpw"),
    ("mooncake://m:50051?admin=http%3A%2F%2Fu%3As3cretpw%40h%3A8080", "s3cretpw"),
    ("nosuch://host?pass%77ord=s3cret@pw", "s3cret@pw"),
    ("nosuch://host?token=s3cretpw&x=1", "s3cretpw"),
]


@pytest.mark.parametrize(("url", "secret"), LEAKY_AFTER_THE_HOST)
def test_a_secret_after_the_host_is_never_quoted(url: str, secret: str) -> None:
    assert secret not in mask_userinfo(url)
    assert secret not in scrub_secrets(f"cannot open {unquote(url)}", url)
    with pytest.raises(StorageConfigError) as caught:
        open_storage(url)
    assert secret not in str(caught.value)
