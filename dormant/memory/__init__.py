"""``dormant.memory``: tagged virtual-memory pools that sleep and wake bit-exact, in place.

Works for any PyTorch engine; never imports the engine. See DESIGN §2.
"""

from dormant.memory.audit import AuditRecord, AuditReport
from dormant.memory.copy_path import CopyMode, CopyPath, CopyPathPolicy
from dormant.memory.errors import (
    CopyPolicyError,
    DriverError,
    HostArenaError,
    ManagerClosedError,
    ManagerExistsError,
    MemoryLayerError,
    OutOfMemoryError,
    PointerGuardError,
    SleepConflictError,
    SleepFailedError,
    StrictModeError,
    TagAsleepError,
    TransitionFailedError,
    UnknownDiscardOrderError,
    UnknownPolicyError,
    UnknownTagError,
    WakeFailedError,
    WakeOutOfMemoryError,
)
from dormant.memory.manager import MemoryManager
from dormant.memory.offload import DiscardOrder
from dormant.memory.policy import (
    BUILTIN_TAGS,
    CUDA_GRAPH,
    KV_CACHE,
    LEVELS,
    RUNTIME,
    WEIGHTS,
    WORKSPACE,
    Policy,
)
from dormant.memory.process_checkpoint import (
    CheckpointFailedError,
    CheckpointTimeoutError,
    CheckpointUnsupportedError,
    CommunicatorActiveError,
    ContextReleasedError,
    ContextReleaseError,
    ProcessCheckpoint,
    ProcessState,
)
from dormant.memory.slab_rules import LONG_LIVED, InvalidSlabRuleError, SlabRule
from dormant.memory.states import State, TagState
from dormant.memory.status import (
    ContextReport,
    MemoryStatus,
    ResidualItem,
    SleepReport,
    TagStatus,
    WakeReport,
)

__all__ = [
    "BUILTIN_TAGS",
    "CUDA_GRAPH",
    "KV_CACHE",
    "LEVELS",
    "LONG_LIVED",
    "RUNTIME",
    "WEIGHTS",
    "WORKSPACE",
    "AuditRecord",
    "AuditReport",
    "CheckpointFailedError",
    "CheckpointTimeoutError",
    "CheckpointUnsupportedError",
    "CommunicatorActiveError",
    "ContextReleaseError",
    "ContextReleasedError",
    "ContextReport",
    "CopyMode",
    "CopyPath",
    "CopyPathPolicy",
    "CopyPolicyError",
    "DiscardOrder",
    "DriverError",
    "HostArenaError",
    "InvalidSlabRuleError",
    "ManagerClosedError",
    "ManagerExistsError",
    "MemoryLayerError",
    "MemoryManager",
    "MemoryStatus",
    "OutOfMemoryError",
    "PointerGuardError",
    "Policy",
    "ProcessCheckpoint",
    "ProcessState",
    "ResidualItem",
    "SlabRule",
    "SleepConflictError",
    "SleepFailedError",
    "SleepReport",
    "State",
    "StrictModeError",
    "TagAsleepError",
    "TagState",
    "TagStatus",
    "TransitionFailedError",
    "UnknownDiscardOrderError",
    "UnknownPolicyError",
    "UnknownTagError",
    "WakeFailedError",
    "WakeOutOfMemoryError",
    "WakeReport",
]
