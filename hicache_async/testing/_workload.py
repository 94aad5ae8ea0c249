"""A request handler as a serving engine would write one, with the KV generator as the model.

`serve()` drives one prompt through the whole cache path — prefetch, match, layer-by-layer
load, allocate, "compute" (the generator writes the KV), commit, release — and checks every
page it reads against the generator, so scenarios and tests verify bytes from every tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

import msgspec

if TYPE_CHECKING:
    from .._cache import HiCache
    from .._keys import TokenIds
    from ._kvgen import KVGenerator
else:
    # Not imported at run time (they bring numpy and torch, which the pytest plugin must not
    # import): tools that read hints at run time (typing.get_type_hints, beartype, sphinx)
    # see a cache, a prompt and a generator as Any rather than fail.
    HiCache = TokenIds = KVGenerator = Any

__all__ = ["ServedRequest", "serve"]

Check = Literal["none", "loaded", "all"]
_CHECKS: tuple[str, ...] = get_args(Check)


class ServedRequest(msgspec.Struct, frozen=True):
    """Where one request's tokens came from, and how many pages were checked."""

    request_id: str | None
    num_tokens: int
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    computed_tokens: int
    checked_pages: int


async def serve(
    cache: HiCache,
    tokens: TokenIds,
    generator: KVGenerator,
    *,
    request_id: str | None = None,
    prefetch: bool = True,
    check: Check = "loaded",
    layerwise: bool = True,
) -> ServedRequest:
    """Serve one prompt the way an engine would, checking pages against `generator`.

    With a tensor-parallel rank group it uses only the prefix every rank holds (the
    prefetch's `agreed_tokens`, or `agree_cached_tokens` without a prefetch): every rank must
    serve the same prompts in the same order.

    `check="loaded"` verifies the pages copied from the host (and so from storage);
    `check="all"` also the device prefix that was already there; `check="none"` nothing.
    Any other `check` raises ValueError (a typo must not silently check nothing).
    """
    if check not in _CHECKS:
        raise ValueError(f"check must be one of {', '.join(map(repr, _CHECKS))}, got {check!r}")
    # Imported here: the pytest plugin imports this package in every test run of the
    # environment, and `_keys` brings numpy.
    from .._keys import as_token_array

    array = as_token_array(tokens)
    size = cache.config.page_size
    storage_tokens = 0
    group = cache.rank_group
    tp = group is not None and group.size > 1
    # With tensor parallelism every rank uses the prefix all of them hold, as an engine must;
    # and every rank prefetches (so agrees) whatever its own storage, since the ranks must
    # enter the same agreement (a prefetch without storage still agrees).
    cap: int | None = None
    if prefetch and (tp or cache.storage_status().attached):
        result = await cache.prefetch(array, request_id=request_id)
        storage_tokens = result.storage_tokens
        if tp:
            cap = result.agreed_tokens
    elif tp:
        cap = await cache.agree_cached_tokens(array)
    with cache.request(array, request_id=request_id, max_cached_tokens=cap) as req:
        device_tokens = req.device_tokens
        load = await req.load()
        if layerwise:
            for layer in range(cache.config.layout.num_layers):
                # A model would run layer `layer` here while later layers are still copying.
                await load.layer(layer)
        else:
            await load
        cached_pages = req.cached_tokens // size
        table = req.page_table
        first = 0 if check == "all" else device_tokens // size
        checked = 0
        if check != "none":
            for index in range(first, cached_pages):
                generator.check_page(cache.device_pool, table[index], array, index)
                checked += 1
        new_pages = await req.allocate(len(array) - req.cached_tokens)
        full_pages = len(array) // size
        for offset, page in enumerate(new_pages):
            index = cached_pages + offset
            if index < full_pages:  # the tail page is recomputed next time, never committed
                generator.fill_page(cache.device_pool, page, array, index)
        computed = len(array) - req.cached_tokens
        host_tokens = req.cached_tokens - device_tokens
        req.commit()
    return ServedRequest(
        request_id=request_id,
        num_tokens=len(array),
        device_tokens=device_tokens,
        host_tokens=max(0, host_tokens - storage_tokens),
        storage_tokens=min(storage_tokens, host_tokens),
        computed_tokens=computed,
        checked_pages=checked,
    )
