"""Tensor-parallel agreement: rank groups and helpers that keep ranks' collectives in step.

With tensor parallelism each rank runs its own cache over its shard of the KV, and the ranks
must agree on how many pages a prefetch hit, how many pages arrived before scheduling, and
which warmup entries to load. See docs/tensor-parallel.md.
"""

from ._agree import agree_entries, agree_min, run_uncancelled
from ._errors import AgreementMismatch, CollectiveError, CollectiveTimeout, GroupBrokenError
from ._group import GroupStatistics, RankGroup, SingleRank, agreement_tag
from ._order import BackgroundAgreements
from ._torch import TorchRankGroup

__all__ = [
    "AgreementMismatch",
    "BackgroundAgreements",
    "CollectiveError",
    "CollectiveTimeout",
    "GroupBrokenError",
    "GroupStatistics",
    "RankGroup",
    "SingleRank",
    "TorchRankGroup",
    "agree_entries",
    "agree_min",
    "agreement_tag",
    "run_uncancelled",
]
