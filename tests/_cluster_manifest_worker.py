"""Concurrent warmup-manifest appends on a Redis Cluster, compacting without scripting.

Run as `python3 _cluster_manifest_worker.py URL SECONDS` by tests/backends/test_redis_cluster.py,
in a process of its own: what it guards against froze the whole event loop, which no timeout
inside the process could end. Prints one JSON line: appends per appender, and failures that
were not StorageError.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from hicache_async import StorageError
from hicache_async.storage._manifest import ManifestLimits, chain_entry
from hicache_async.storage._manifest_redis import RedisManifest
from hicache_async.storage._redis import RedisStorage


async def main(url: str, seconds: float) -> dict[str, object]:
    limits = ManifestLimits(max_entries=16, max_entry_bytes=4096, max_bytes=1 << 20)
    async with RedisStorage.from_url(url) as storage:
        manifest = RedisManifest(
            storage._redis, prefix=storage.prefix, name=storage.name, scripting=False, limits=limits
        )
        stop = asyncio.Event()
        foreign: list[str] = []

        async def appender(seed: int) -> int:
            done = 0
            while not stop.is_set():
                namespace = bytes([(seed + done) % 6]) * 16
                keys = [os.urandom(32) for _ in range(2)]
                entries = [chain_entry(namespace, keys, 8, i, float(i)) for i in range(20)]
                try:
                    await manifest.append(entries)
                except StorageError:
                    pass  # a compaction overtaken or short of connections: reported, not lost
                except Exception as exc:
                    foreign.append(repr(exc))
                done += 1
            return done

        tasks = [asyncio.create_task(appender(seed)) for seed in range(3)]
        await asyncio.sleep(seconds)
        stop.set()
        appends = await asyncio.gather(*tasks)
        read = await manifest.read()
        return {"appends": appends, "foreign": foreign, "namespaces_read": len(read.entries) > 0}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], float(sys.argv[2])))))
