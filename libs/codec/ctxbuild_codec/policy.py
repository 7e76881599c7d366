"""Tool policies (SPEC §1, §4, §11), looked up by the tool that really ran (``effectiveToolName``).

A tool run through ``tool_invoke`` gets its own policy: the outer name never decides when an inner one is known.
One table for both lanes and for deferral.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .codecs import ENTITIES, TEXT_FIELD

Defer = Literal["never", "always", "auto"]
MCP_PREFIX = "mcp__"


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    codec: str | None = None   # a codec name from ctxbuild_codec.codecs.CODECS, or None (opaque lane)
    truncatable: bool = True   # in-flight only; the persist lane still applies the codec
    defer: Defer = "never"


DEFAULT_POLICY = ToolPolicy()
MCP_POLICY = ToolPolicy(defer="auto")
MCP_GATED_POLICY = ToolPolicy(defer="never")

POLICIES: dict[str, ToolPolicy] = {
    "web_search": ToolPolicy(codec=ENTITIES, defer="auto"),
    "web_fetch": ToolPolicy(codec=ENTITIES, defer="auto"),
    "kb_search": ToolPolicy(codec=ENTITIES, defer="never"),
    # fs_read must not truncate its own read-back and loop; its codec still applies at persist time
    "fs_read": ToolPolicy(codec=TEXT_FIELD, truncatable=False, defer="never"),
    "read_file": ToolPolicy(codec=TEXT_FIELD, defer="never"),
    # the deferral meta-tools are what stands in for deferred tools: never deferred themselves
    "tool_search": ToolPolicy(defer="never"),
    "tool_inspect": ToolPolicy(defer="never"),
    "tool_invoke": ToolPolicy(defer="never"),
}


def effective_tool_name(part: Mapping[str, Any]) -> str:
    """``effectiveToolName``, falling back to ``toolName`` — never the outer name when an inner one is known."""
    return part.get("effectiveToolName") or part.get("toolName") or ""


def is_mcp_tool(name: str) -> bool:
    return name.startswith(MCP_PREFIX)


def policy_for(tool: Mapping[str, Any] | str, *, approval_gated: bool = False) -> ToolPolicy:
    """The policy of a tool-result/tool-call part (by its effective name) or of a tool name.

    MCP tools defer ``auto``, or ``never`` when the user must approve each call (an approval cannot be asked
    for a tool the model has not been shown).
    """
    name = tool if isinstance(tool, str) else effective_tool_name(tool)
    policy = POLICIES.get(name)
    if policy is not None:
        return policy
    if is_mcp_tool(name):
        return MCP_GATED_POLICY if approval_gated else MCP_POLICY
    return DEFAULT_POLICY
