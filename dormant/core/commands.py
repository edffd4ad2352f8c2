"""The typed commands an engine sends its workers, and the public RPC allowlist.

Workers dispatch on these enums through a table of bound methods: a string from outside never
reaches ``getattr``. ``collective_rpc`` accepts exactly the names in ``PUBLIC_RPC``.
"""

from __future__ import annotations

import enum


class Command(enum.Enum):
    LOAD_MODEL = "load_model"
    NUM_AVAILABLE_BLOCKS = "num_available_blocks"
    INIT_KV_CACHE = "init_kv_cache"
    EXECUTE = "execute"
    EXECUTE_MULTI_STEP = "execute_multi_step"
    SLEEP = "sleep"
    CHECK_RELEASE_CONTEXT = "check_release_context"  # can sleep(release_context=True) work?
    WAKE_UP = "wake_up"
    SLEEP_STATE = "sleep_state"
    RELOAD_WEIGHTS = "reload_weights"
    UPDATE_WEIGHTS = "update_weights"
    UPDATE_WEIGHTS_FROM_TENSOR = "update_weights_from_tensor"
    INIT_WEIGHTS_UPDATE_GROUP = "init_weights_update_group"
    UPDATE_WEIGHTS_FROM_DISTRIBUTED = "update_weights_from_distributed"
    DESTROY_WEIGHTS_UPDATE_GROUP = "destroy_weights_update_group"
    MEMORY_STATUS = "memory_status"
    KV_CACHE_SCALES = "kv_cache_scales"
    AUDIT = "audit"
    VERIFY_GUARDS = "verify_guards"
    CHECK_HEALTH = "check_health"
    CALL_EXTENSION = "call_extension"  # a worker extension's method, by name
    CALL_FUNCTION = "call_function"  # collective_rpc(fn): fn(worker, *args, **kwargs)
    SHUTDOWN = "shutdown"


# What ``collective_rpc(name)`` may call on every worker. Sleep, wake and weight updates are also
# reachable through it, but the engine routes them through its own methods so that its view of
# the workers' state stays right.
PUBLIC_RPC: dict[str, Command] = {
    command.value: command
    for command in (
        Command.SLEEP,
        Command.WAKE_UP,
        Command.SLEEP_STATE,
        Command.RELOAD_WEIGHTS,
        Command.UPDATE_WEIGHTS,
        Command.MEMORY_STATUS,
        Command.KV_CACHE_SCALES,
        Command.AUDIT,
        Command.VERIFY_GUARDS,
        Command.CHECK_HEALTH,
    )
}
