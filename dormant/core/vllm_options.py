"""vLLM ``LLM(...)`` options that have no ``EngineConfig`` field of their own: each is checked
against what dormant can honour, and mapped onto dormant's options where it has a meaning.

| option                      | accepted                         | dormant                       |
|-----------------------------|----------------------------------|-------------------------------|
| quantization                | None                             | weights as in the checkpoint  |
| pipeline_parallel_size      | 1                                | tensor parallelism only       |
| enable_expert_parallel      | False                            | MoE experts split by TP       |
| model_impl                  | "auto", "vllm"                   | dormant's own models          |
| scheduling_policy           | "fcfs"                           | first come, first served      |
| swap_space                  | any GiB >= 0                     | never swaps (recompute)       |
| disable_custom_all_reduce   | True or False                    | uses torch's all-reduce only  |
| compilation_config          | dict or JSON: ``cudagraph_mode``, | ``enforce_eager``,            |
|                             | ``cudagraph_capture_sizes``      | ``cuda_graph_batch_sizes``    |
| hf_overrides                | None or {} (verl passes {})      | config.json as it is          |

Any other value raises ``UnsupportedOptionError`` naming the option, the value and what is
supported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from dormant.core.errors import UnsupportedOptionError

_ONLY_VALUE: dict[str, tuple[object | tuple[object, ...], str]] = {
    "quantization": (None, "dormant runs the checkpoint's own dtype; no quantization methods"),
    "pipeline_parallel_size": (1, "dormant splits models by tensor parallelism only"),
    "enable_expert_parallel": (
        False,
        "dormant splits MoE experts by tensor parallelism (every rank holds a slice of every "
        "expert), never by expert",
    ),
    # "vllm" (vLLM's native models, TRL's default) is what dormant's own models are.
    "model_impl": (("auto", "vllm"), "dormant always runs its own model implementations"),
    "scheduling_policy": ("fcfs", "dormant schedules first come, first served"),
}
# vLLM's cudagraph modes. dormant captures full graphs of decode steps and runs prefills
# eagerly, whatever the mode asks of prefills; "NONE" runs everything eagerly.
_CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_COMPILATION_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes")
WEIGHT_TRANSFER_BACKENDS = ("nccl",)


def engine_args_fields(engine_args: Any) -> dict[str, Any]:
    """The options in vLLM's ``EngineArgs``/``AsyncEngineArgs`` (or a mapping, or any object
    whose attributes are options); None gives none."""
    if engine_args is None:
        return {}
    if isinstance(engine_args, Mapping):
        return dict(engine_args)
    if dataclasses.is_dataclass(engine_args) and not isinstance(engine_args, type):
        return dataclasses.asdict(engine_args)
    return dict(vars(engine_args))


def resolve_vllm_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without the vLLM-only names, mapped to dormant's (a new dict). Raises
    ``UnsupportedOptionError`` for a value dormant cannot honour; changes nothing else."""
    resolved = dict(options)
    for name, (value, reason) in _ONLY_VALUE.items():
        allowed = value if isinstance(value, tuple) else (value,)
        if name in resolved and resolved.pop(name) not in allowed:
            raise UnsupportedOptionError(
                f"{name}={options[name]!r} is not supported: {reason}. Supported: "
                + " or ".join(repr(v) for v in allowed)
            )
    if "swap_space" in resolved:
        swap = resolved.pop("swap_space")
        if isinstance(swap, bool) or not isinstance(swap, int | float) or swap < 0:
            raise UnsupportedOptionError(
                f"swap_space={swap!r}: expected GiB >= 0 (dormant never swaps: a preempted "
                "request recomputes its KV)"
            )
    if "disable_custom_all_reduce" in resolved:
        value = resolved.pop("disable_custom_all_reduce")
        if not isinstance(value, bool):
            raise UnsupportedOptionError(f"disable_custom_all_reduce must be a bool, got {value!r}")
    if "compilation_config" in resolved:
        _apply_compilation_config(resolved, resolved.pop("compilation_config"))
    if resolved.pop("hf_overrides", None):
        raise UnsupportedOptionError(
            f"hf_overrides={options['hf_overrides']!r} is not supported: dormant reads "
            "config.json as it is; edit the checkpoint's config.json, or pass None or {}"
        )
    return resolved


def json_option(name: str, value: Any) -> Any:
    """A vLLM option given as its JSON text (its command line's form) as what that text
    spells; any other value as it is. Raises ``UnsupportedOptionError`` for text that is not
    JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise UnsupportedOptionError(f"{name}={value!r} is not JSON: {error}") from error


def _apply_compilation_config(options: dict[str, Any], config: Any) -> None:
    if config is None:
        return
    config = json_option("compilation_config", config)
    if not isinstance(config, dict):
        raise UnsupportedOptionError(
            f"compilation_config={config!r} is not supported: pass a dict (or its JSON) with "
            f"the keys {_COMPILATION_KEYS}"
        )
    unknown = sorted(set(config) - set(_COMPILATION_KEYS))
    if unknown:
        raise UnsupportedOptionError(
            f"compilation_config keys {unknown} are not supported; dormant supports "
            f"{_COMPILATION_KEYS} (it compiles nothing; it captures decode CUDA graphs)"
        )
    mode = config.get("cudagraph_mode")
    if mode is not None:
        name = str(getattr(mode, "name", mode)).upper()
        if name not in _CUDAGRAPH_MODES:
            raise UnsupportedOptionError(
                f"compilation_config cudagraph_mode={mode!r} is not one of {_CUDAGRAPH_MODES}"
            )
        if name == "NONE":
            options["enforce_eager"] = True
    sizes = config.get("cudagraph_capture_sizes")
    if sizes is not None:
        graph_sizes = tuple(sorted({int(size) for size in sizes}))
        given = options.get("cuda_graph_batch_sizes")
        if given is not None and tuple(given) != graph_sizes:
            raise UnsupportedOptionError(
                f"compilation_config cudagraph_capture_sizes={list(sizes)} conflicts with "
                f"cuda_graph_batch_sizes={given}; give one of them"
            )
        options["cuda_graph_batch_sizes"] = graph_sizes


def parse_weight_transfer_config(value: Any) -> dict[str, Any] | None:
    """vLLM's ``weight_transfer_config``: None, a dict or its JSON, ``{"backend": "nccl"}``."""
    if value is None:
        return None
    value = json_option("weight_transfer_config", value)
    fields = value if isinstance(value, Mapping) else getattr(value, "__dict__", None)
    config = dict(fields) if fields is not None else {"backend": value}
    if config.get("backend", "nccl") not in WEIGHT_TRANSFER_BACKENDS or set(config) - {"backend"}:
        raise UnsupportedOptionError(
            f"weight_transfer_config={value!r} is not supported: dormant's is "
            '{"backend": "nccl"} (NCCL on GPUs, gloo on the CPU); for CUDA IPC handles use '
            "update_weights_from_tensor (SGLang's) or a worker extension"
        )
    return {"backend": config.get("backend", "nccl")}
