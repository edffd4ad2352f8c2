"""Tensor-parallel state shared by the layers."""

from dormant.distributed.parallel_state import (
    DistributedTPGroup,
    SingleRankGroup,
    TPGroup,
    get_tp_group,
    init_tp_group,
    reset_tp_group,
    use_tp_group,
)

__all__ = [
    "DistributedTPGroup",
    "SingleRankGroup",
    "TPGroup",
    "get_tp_group",
    "init_tp_group",
    "reset_tp_group",
    "use_tp_group",
]
