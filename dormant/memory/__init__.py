"""``dormant.memory``: tagged virtual-memory pools that sleep and wake bit-exact, in place.

Works for any PyTorch engine; never imports the engine. See DESIGN §2.
"""

from dormant.memory.audit import AuditRecord, AuditReport
from dormant.memory.errors import (
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
    UnknownPolicyError,
    UnknownTagError,
    WakeFailedError,
    WakeOutOfMemoryError,
)
from dormant.memory.manager import MemoryManager
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
from dormant.memory.states import State, TagState
from dormant.memory.status import MemoryStatus, SleepReport, TagStatus, WakeReport

__all__ = [
    "BUILTIN_TAGS",
    "CUDA_GRAPH",
    "KV_CACHE",
    "LEVELS",
    "RUNTIME",
    "WEIGHTS",
    "WORKSPACE",
    "AuditRecord",
    "AuditReport",
    "DriverError",
    "HostArenaError",
    "ManagerClosedError",
    "ManagerExistsError",
    "MemoryLayerError",
    "MemoryManager",
    "MemoryStatus",
    "OutOfMemoryError",
    "PointerGuardError",
    "Policy",
    "SleepConflictError",
    "SleepFailedError",
    "SleepReport",
    "State",
    "StrictModeError",
    "TagAsleepError",
    "TagState",
    "TagStatus",
    "TransitionFailedError",
    "UnknownPolicyError",
    "UnknownTagError",
    "WakeFailedError",
    "WakeOutOfMemoryError",
    "WakeReport",
]
