"""Which tools a step offers (SPEC §6): pure functions of the retained context and the MCP catalog."""

from __future__ import annotations

from typing import Any

from ctxbuild_providers import ToolSpec

READ_FILE = ToolSpec(
    name="read_file",
    description="Read an attached file by its handle, in pages of characters.",
    input_schema={
        "type": "object",
        "properties": {
            "filename": {"type": "string", "description": "attachment handle"},
            "offset": {"type": "integer", "minimum": 0, "description": "character offset (default 0)"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 200000, "description": "chars (default 8000)"},
        },
        "required": ["filename"],
        "additionalProperties": False,
    },
)
FS_READ = ToolSpec(
    name="fs_read",
    description="Read archived full tool output (or a compaction's transcript) by its context://vfs/ URI, in pages "
                "of numbered lines; with `pattern`, only the lines matching a regular expression.",
    input_schema={
        "type": "object",
        "properties": {
            "uri": {"type": "string"},
            "offset": {"type": "integer", "minimum": 1, "description": "first line (default 1)"},
            "limit": {"type": "integer", "minimum": 1,
                      "description": "lines (default 2000; with a pattern: lines searched, default to the end)"},
            "column": {"type": "integer", "minimum": 1,
                       "description": "first character of line `offset` to show (default 1): continues a line "
                                      "too long for one page"},
            "pattern": {"type": "string", "minLength": 1,
                        "description": "a regular expression: return only the matching lines, with their numbers"},
        },
        "required": ["uri"],
        "additionalProperties": False,
    },
)
BUILTINS = {"read_file", "fs_read"}
WEB_TOOLS = {"web_fetch", "web_search"}
META_TOOLS = {"tool_search", "tool_inspect", "tool_invoke"}  # the catalog's stand-ins for deferred MCP tools


def offered_tools(retained: dict[str, Any], mcp_tools: list[dict[str, Any]], can_offload: bool,
                  others: list[ToolSpec] | None = None) -> list[ToolSpec]:
    """read_file only with attachments (from the authoritative list, finding #2); fs_read when something is
    archived or can be offloaded this turn, and never as the only tool with nothing to read. ``others``: tools
    already in wire form (web tools, recorded replay tools, the catalog's wire tools), offered after the builtins."""
    tools: list[ToolSpec] = []
    if retained.get("fileAttachments"):
        tools.append(READ_FILE)
    mcp = [ToolSpec(t["id"], t.get("description") or t["name"], t.get("inputSchema") or {"type": "object"})
           for t in mcp_tools]
    rest = [t for t in (others or []) if t.name not in BUILTINS]
    has_archive = bool(retained.get("persistedUris"))
    if has_archive or (can_offload and (tools or mcp or rest)):
        tools.append(FS_READ)
    return tools + rest + mcp
