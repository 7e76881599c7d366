"""Tool policies, looked up by the tool that really ran (`effectiveToolName`, SPEC §1, §4).

Skeleton depth: only the in-flight `truncatable` flag. Codecs and defer modes join this table later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    truncatable: bool = True


DEFAULT_POLICY = ToolPolicy()
POLICIES: dict[str, ToolPolicy] = {
    # must not truncate its own read-back and loop (its codec still applies at persist time)
    "fs_read": ToolPolicy(truncatable=False),
}


def tool_name_of(part: dict[str, Any]) -> str:
    """effectiveToolName, falling back to toolName — never the outer name when an inner one is known."""
    return part.get("effectiveToolName") or part.get("toolName") or ""


def policy_for(part: dict[str, Any]) -> ToolPolicy:
    return POLICIES.get(tool_name_of(part), DEFAULT_POLICY)
