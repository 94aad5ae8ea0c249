"""`hicache-async demo`: a tiny transformer served through HiCache, measured against no cache.

The model (`TinyTransformer`) computes real attention over the cache's paged device pool; the
replay (`run_demo`) serves a multi-turn slice of the packaged chat trace twice on the same
arrival schedule, once computing every prompt from scratch and once through HiCache, and
reports where the tokens came from, time to first token, bytes moved and whether the cached
path's first-token logits match the baseline's. See docs/demo.md.
"""

from .._trace import TraceRequest
from ._model import (
    ContiguousKV,
    ForwardStopped,
    KVStore,
    ModelConfig,
    PagedKV,
    Prefill,
    TinyTransformer,
)
from ._replay import (
    DEFAULT_STORAGE,
    DemoOptions,
    ModelRunner,
    demo_storage_root,
    plan_demo,
    reuse_upper_bound,
    run_demo,
    select_requests,
)
from ._report import (
    BytesMoved,
    DemoSummary,
    LogitCheck,
    Progress,
    TierTokenCounts,
    TTFTStats,
    format_summary,
)

__all__ = [
    "DEFAULT_STORAGE",
    "BytesMoved",
    "ContiguousKV",
    "DemoOptions",
    "DemoSummary",
    "ForwardStopped",
    "KVStore",
    "LogitCheck",
    "ModelConfig",
    "ModelRunner",
    "PagedKV",
    "Prefill",
    "Progress",
    "TTFTStats",
    "TierTokenCounts",
    "TinyTransformer",
    "TraceRequest",
    "demo_storage_root",
    "format_summary",
    "plan_demo",
    "reuse_upper_bound",
    "run_demo",
    "select_requests",
]
