"""Tags, policies and sleep levels (DESIGN §2.2).

A *tag* says what lives in an allocation; a *policy* says what a sleep does to it. A *level* is a
preset mapping of tags to policies. ``sleep(tags={tag: policy})`` is the general form.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import TypeVar

from dormant.memory.errors import UnknownPolicyError

E = TypeVar("E", bound=enum.Enum)


class Policy(enum.Enum):
    """What a sleep does to the memory of a tag.

    ==========  ================================================  ==========================
    policy      on sleep                                          on wake
    ==========  ================================================  ==========================
    KEEP        nothing: the memory stays mapped (residual)        nothing
    HOST        copy to the host arena, then unmap + release       map, copy back; bit-exact
    DISCARD     unmap + release; contents dropped                  map; contents undefined
    ==========  ================================================  ==========================
    """

    KEEP = "keep"
    HOST = "host"
    DISCARD = "discard"

    @classmethod
    def parse(cls, value: Policy | str) -> Policy:
        """Accepts a Policy or its name (case-insensitive); raises UnknownPolicyError otherwise."""
        member = member_named(cls, value)
        if member is not None:
            return member
        names = ", ".join(p.name for p in cls)
        raise UnknownPolicyError(f"unknown policy {value!r}; use one of {names}")


def member_named(kind: type[E], value: object) -> E | None:
    """The member of the string enum ``kind`` that ``value`` is or names (case-insensitive),
    or None."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        return next((member for member in kind if member.value == value.lower()), None)
    return None


WEIGHTS = "weights"
KV_CACHE = "kv_cache"
RUNTIME = "runtime"
CUDA_GRAPH = "cuda_graph"
WORKSPACE = "workspace"

BUILTIN_TAGS: tuple[str, ...] = (WEIGHTS, KV_CACHE, RUNTIME, CUDA_GRAPH, WORKSPACE)

# What each level does to each built-in tag. Runtime state and graph pools are preserved at both
# levels: they hold graph-visible constants that must never be re-created (DESIGN §2.5).
LEVELS: dict[int, dict[str, Policy]] = {
    0: {tag: Policy.KEEP for tag in BUILTIN_TAGS},
    1: {
        WEIGHTS: Policy.HOST,
        KV_CACHE: Policy.DISCARD,
        RUNTIME: Policy.HOST,
        CUDA_GRAPH: Policy.HOST,
        WORKSPACE: Policy.DISCARD,
    },
    2: {
        WEIGHTS: Policy.DISCARD,
        KV_CACHE: Policy.DISCARD,
        RUNTIME: Policy.HOST,
        CUDA_GRAPH: Policy.HOST,
        WORKSPACE: Policy.DISCARD,
    },
}

# A user tag that did not say otherwise is preserved at every level: never lose data by default.
DEFAULT_USER_LEVEL_POLICY = {0: Policy.KEEP, 1: Policy.HOST, 2: Policy.HOST}


def level_policies(level: int, user_tags: Mapping[str, Mapping[int, Policy]]) -> dict[str, Policy]:
    """The tag → policy mapping of ``level`` over the built-in tags and ``user_tags``."""
    if level not in LEVELS:
        raise ValueError(f"unknown sleep level {level!r}; levels are {sorted(LEVELS)}")
    policies = dict(LEVELS[level])
    for tag, per_level in user_tags.items():
        policies[tag] = per_level.get(level, DEFAULT_USER_LEVEL_POLICY[level])
    return policies


def is_discardable(tag: str, user_tags: Mapping[str, Mapping[int, Policy]]) -> bool:
    """True when some level discards ``tag``: its allocations are what the scope audit watches."""
    per_level = user_tags.get(tag)
    if per_level is not None:
        return Policy.DISCARD in per_level.values()
    return any(LEVELS[level].get(tag) is Policy.DISCARD for level in LEVELS)


def sleep_request(
    level: int | None,
    tags: Mapping[str, Policy | str] | None,
    user_tags: Mapping[str, Mapping[int, Policy]],
) -> dict[str, Policy]:
    """The tag → policy request of ``sleep(level=...)`` or ``sleep(tags=...)`` (exactly one)."""
    if tags is not None and level is None:
        return parse_policies(tags)
    if level is not None and tags is None:
        return level_policies(level, user_tags)
    raise TypeError("sleep() takes exactly one of level=... or tags={tag: policy}")


def audited_tags(
    tags: Iterable[str] | None, user_tags: Mapping[str, Mapping[int, Policy]], known: Iterable[str]
) -> set[str]:
    """The tags an audit lists: ``tags``, or by default every discardable tag of ``known``."""
    if tags is None:
        return {t for t in known if is_discardable(t, user_tags)}
    return set(tags)


def parse_policies(tags: Mapping[str, Policy | str]) -> dict[str, Policy]:
    """Normalises a ``{tag: policy}`` request; raises UnknownPolicyError on a bad policy."""
    return {tag: Policy.parse(policy) for tag, policy in tags.items()}


def as_tag_list(tags: str | Iterable[str]) -> list[str]:
    """Accepts one tag or an iterable of tags (a lone string is one tag, not its characters)."""
    return [tags] if isinstance(tags, str) else list(tags)
