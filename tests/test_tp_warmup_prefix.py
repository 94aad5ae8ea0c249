"""Tensor-parallel warmup over ranks whose manifests differ: the ranks load the longest prefix
they all hold of each entry, not only the chains every one of them recorded whole.

Two ranks share one event loop over the in-process group of `test_tp_warmup_cancel`, each on
a file store of its own.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import msgspec
import numpy as np
from test_tp_warmup_cancel import PAGE, _config, _pair, _Rank, _two_caches

from hicache_async import HiCache, WarmupResult
from hicache_async.storage import FileStorage
from hicache_async.storage._manifest import ManifestRead, chain_entry
from hicache_async.testing import KVGenerator, serve
from hicache_async.workers._warmup import _agreed_prefixes, _cut, _offers

_GENERATOR_SEED = 7


def _generator() -> KVGenerator:
    return KVGenerator(_config(0).layout, PAGE, seed=_GENERATOR_SEED)


async def _back_up(
    root: Path, rank: int, prompts: list[np.ndarray], *, pinned: int | None = None
) -> None:
    """Rank `rank` computes `prompts` in order (KV from the test's generator; prompt
    `pinned` at a higher priority) and backs them up to the store at `root`, one manifest
    record each."""
    generator = _generator()
    async with HiCache(_config(rank), storage=FileStorage(root)) as cache:
        for index, prompt in enumerate(prompts):
            with cache.request(prompt, priority=10 if index == pinned else 0) as request:
                await request.load()
                first = request.cached_tokens // PAGE
                pages = await request.allocate(len(prompt) - request.cached_tokens)
                for offset, page in enumerate(pages):
                    generator.fill_page(cache.device_pool, page, prompt, first + offset)
                request.commit()
            await cache.drain()


async def _warm_both(roots: list[Path], prompt: np.ndarray) -> tuple[list[WarmupResult], int]:
    """Warm both ranks up, then serve `prompt` on both: the results, and the tokens each
    rank took from its host pool (the same on both; every page checked against the KV)."""
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as caches:
        results = await asyncio.wait_for(
            asyncio.gather(*(cache.warmup(ratio=1.0) for cache in caches)), 30
        )
        host = [cache.match(prompt).host_tokens for cache in caches]
        assert host[0] == host[1]
        served = await asyncio.wait_for(
            asyncio.gather(
                *(serve(c, prompt, _generator(), prefetch=False, check="all") for c in caches)
            ),
            30,
        )
        assert [s.host_tokens for s in served] == host
        assert ranks[0].calls == ranks[1].calls
    return list(results), host[0]


def _prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=pages * PAGE)


async def test_ranks_load_the_turn_every_rank_backed_up(tmp_path: Path) -> None:
    """Both ranks backed up a conversation's 5-page turn, only rank 0 its 10-page turn: each
    rank's manifest keeps one entry (rank 0's longer chain covers its shorter one), and the
    ranks load the 5 pages they all hold."""
    prompt = _prompt(1, 10)
    roots = [tmp_path / "r0", tmp_path / "r1"]
    await _back_up(roots[0], 0, [prompt[: 5 * PAGE], prompt])
    await _back_up(roots[1], 1, [prompt[: 5 * PAGE]])
    results, host = await _warm_both(roots, prompt)
    assert host == 5 * PAGE
    for result in results:
        assert (result.status.value, result.entries_read) == ("complete", 1)
        assert (result.entries_agreed, result.entries_loaded, result.pages_loaded) == (1, 1, 5)


async def test_ranks_agree_on_a_prefix_after_a_compaction(tmp_path: Path) -> None:
    """Rank 0's manifest, compacted, no longer records the 5-page turn: the ranks still load
    the 5 pages they all hold (agreed on 4, the largest power of two, then searched on)."""
    prompt = _prompt(2, 10)
    roots = [tmp_path / "r0", tmp_path / "r1"]
    await _back_up(roots[0], 0, [prompt[: 5 * PAGE], prompt])
    await _back_up(roots[1], 1, [prompt[: 5 * PAGE]])
    manifest = FileStorage(roots[0]).manifest()
    await manifest.compact()
    read = await manifest.read()
    assert [len(e.keys) for e in read.entries] == [10]
    assert read.covered == {}
    results, host = await _warm_both(roots, prompt)
    assert host == 5 * PAGE
    for result in results:
        assert (result.status.value, result.entries_agreed, result.pages_loaded) == (
            "complete",
            1,
            5,
        )


async def test_ranks_load_only_what_their_chains_share(tmp_path: Path) -> None:
    """The ranks hold the same 3-page system prompt, each with a different question after it
    (and nothing else): they load the 3 pages their chains share, on both, and neither rank
    keeps a page of its own question."""
    system = _prompt(3, 3)
    questions = [np.concatenate([system, _prompt(4 + rank, 3)]) for rank in (0, 1)]
    roots = [tmp_path / "r0", tmp_path / "r1"]
    for rank in (0, 1):
        await _back_up(roots[rank], rank, [questions[rank]])
    results, host = await _warm_both(roots, system)
    assert host == 3 * PAGE
    for result in results:
        assert (result.entries_agreed, result.pages_loaded) == (1, 3)


async def test_a_pinned_prefix_is_loaded_first_on_its_own(tmp_path: Path) -> None:
    """Both ranks pinned a 3-page system prompt; rank 0 backed up a 9-page conversation on
    it, rank 1 only its 6-page first turn. The prompt ranks higher on rank 0, so it is an
    entry of its own, before the conversation's prefix the ranks share (6 pages, though rank
    0 recorded no 6-page chain)."""
    conversation = _prompt(20, 9)
    system = conversation[: 3 * PAGE]
    roots = [tmp_path / "r0", tmp_path / "r1"]
    await _back_up(roots[0], 0, [system, conversation], pinned=0)
    await _back_up(roots[1], 1, [system, conversation[: 6 * PAGE]], pinned=0)
    results, host = await _warm_both(roots, conversation)
    assert host == 6 * PAGE
    for result in results:
        assert (result.entries_read, result.entries_agreed) == (2, 2)
        assert (result.entries_loaded, result.pages_loaded) == (2, 6)


async def test_ranks_with_nothing_in_common_load_nothing(tmp_path: Path) -> None:
    roots = [tmp_path / "r0", tmp_path / "r1"]
    prompts = [_prompt(10 + rank, 6) for rank in (0, 1)]
    for rank in (0, 1):
        await _back_up(roots[rank], rank, [prompts[rank]])
    ranks = _pair(_Rank)
    async with _two_caches(ranks, roots) as caches:
        results = await asyncio.wait_for(
            asyncio.gather(*(cache.warmup(ratio=1.0) for cache in caches)), 30
        )
        for cache, result in zip(caches, results, strict=True):
            assert (result.status.value, result.entries_read) == ("complete", 1)
            assert (result.entries_agreed, result.pages_loaded) == (0, 0)
            assert all(cache.match(p).host_tokens == 0 for p in prompts)
        assert ranks[0].calls == ranks[1].calls == 1


async def test_a_read_names_the_chains_an_entry_covers(tmp_path: Path) -> None:
    """Records of shorter chains that a longer one continues are left out of the entries, and
    their lengths kept with the entry that covers them (the best-ranked one, reached through
    a covered chain that is itself covered); a pinned one stays an entry of its own."""
    keys = [f"{i:064x}" for i in range(1, 11)]
    other = [f"{i:064x}" for i in range(100, 104)]
    namespace = "ab" * 16
    manifest = FileStorage(tmp_path).manifest()
    await manifest.append(
        [
            chain_entry(bytes.fromhex(namespace), map(bytes.fromhex, ks), len(ks) * PAGE, pri, t)
            for ks, pri, t in [
                (keys[:2], 0, 1.0),
                (keys[:3], 5, 2.0),
                (keys[:5], 0, 3.0),
                (keys[:7], 0, 4.0),
                (keys, 0, 5.0),
                (other, 0, 6.0),
            ]
        ]
    )
    read = await manifest.read(namespace=namespace)
    assert [len(e.keys) for e in read.entries] == [3, 4, 10]
    assert read.covered == {f"{namespace}:{keys[-1]}": [5, 7], f"{namespace}:{keys[2]}": [2]}
    # The record encodes as JSON (`manifest show --json` prints it).
    assert msgspec.json.decode(msgspec.json.encode(read), type=ManifestRead) == read


async def test_a_prefix_a_lengthened_one_before_it_holds_is_left_out() -> None:
    """Once lengthened, an agreed prefix can hold a prefix agreed after it whole: loading the
    first loads the second, which is then no entry of its own; one reaching further stays."""
    keys = [f"{i:064x}" for i in range(1, 11)]
    entry = chain_entry(
        bytes.fromhex("ab" * 16), map(bytes.fromhex, keys), len(keys) * PAGE, 0, 1.0
    )
    chosen = [(entry, 4), (entry, 5), (entry, 8)]
    cut = await _cut(chosen, [6, 5, 9], PAGE)
    assert [(len(e.keys), e.num_tokens) for e in cut] == [(6, 6 * PAGE), (9, 9 * PAGE)]
    assert cut[1].keys == keys[:9]


async def test_mapping_a_large_agreement_lets_the_loop_run() -> None:
    """Offering 1,000 entries of 90 pages, mapping the agreed ids back to them and cutting
    them each take several steps of the loop, not one: at the manifest's limits each took
    up to 0.6 s in one go."""
    entries = [
        chain_entry(
            bytes(16),
            [i.to_bytes(4, "big") + bytes(28) for i in range(90 * n, 90 * (n + 1))],
            90 * PAGE,
            0,
            float(n),
        )
        for n in range(1000)
    ]
    turns = 0
    done = False

    async def count() -> None:
        nonlocal turns
        while not done:
            await asyncio.sleep(0)
            turns += 1

    counter = asyncio.create_task(count())
    await asyncio.sleep(0)
    seen = [turns]
    offered = await _offers(ManifestRead(entries=entries))
    seen.append(turns)
    chosen = await _agreed_prefixes(list(offered), offered)
    seen.append(turns)
    cut = await _cut(chosen, [pages for _, pages in chosen], PAGE)
    seen.append(turns)
    done = True
    await counter
    assert [len(e.keys) for e in cut] == [90] * 1000
    # The loop ran at least three times while each of them worked.
    assert min(b - a for a, b in itertools.pairwise(seen)) >= 3
