"""The runner's in-process degradation when compaction cannot answer (SPEC §15.4): the request still fits the
window. Pure: messages in, messages out, deterministic (the same input renders the same request bytes).

In order, each stage only while the messages are still over ``room`` tokens, oldest first:
1. **mask** archived tool outputs — an output already offloaded (a typed ``offload`` naming its blobs) or
   persisted (a v1/v2 envelope) becomes the codec's marker for the same blobs with the preview omitted (readable
   with fs_read; ``ctxbuild_codec.masking.masked_part``, as compaction's masking does);
2. **excerpt** other long text outputs (head and tail, ``inline_truncate``): the full text stays in the turn's
   events and the conversation, only this request shows less;
3. **drop** whole earlier exchanges before the turn's task (up to a user message, so no tool call loses its
   result), then the turn's oldest tool-call groups (an assistant message and its tool message), keeping the
   task and the newest group.
The system prompt and tools are outside ``messages`` (``room`` is the window minus them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ctxbuild_codec.masking import masked_part
from ctxbuild_codec.tokens import count_message
from ctxbuild_codec.trim import inline_truncate

Message = dict[str, Any]
EXCERPT_MIN_CHARS = 2_000  # shorter outputs are not worth an excerpt
EXCERPT_HEAD, EXCERPT_TAIL = 500, 300


@dataclass
class Fit:
    messages: list[Message]
    tokens: int
    before: int
    masked: int = 0
    excerpted: int = 0
    dropped: int = 0

    @property
    def stages(self) -> str:
        """What was done, for the CompactionDecided ``fallback`` field and the log."""
        done = [f"{k}={v}" for k, v in (("masked", self.masked), ("excerpted", self.excerpted),
                                         ("dropped", self.dropped)) if v]
        return "in-process:" + (",".join(done) or "none")


def excerpted_part(part: Mapping[str, Any]) -> dict[str, Any] | None:
    output = part.get("output") or {}
    value = output.get("value")
    if output.get("type") in ("text", "error-text") and isinstance(value, str) and len(value) > EXCERPT_MIN_CHARS:
        return {**part, "output": {**output, "value": inline_truncate(value, EXCERPT_HEAD, EXCERPT_TAIL)}}
    return None


def fit_window(messages: list[Message], room: int, task_id: str | None) -> Fit:
    """``messages`` cut to at most ``room`` tokens if the stages above can; ``task_id`` is the turn's user
    message (kept, like everything after it that the last stage does not drop)."""
    rows = list(messages)
    counts = [count_message(m) for m in rows]
    fit = Fit(rows, sum(counts), sum(counts))
    if fit.tokens <= room:
        return fit

    def rewrite(stage, attr: str) -> bool:
        for i, row in enumerate(rows):
            if row.get("role") != "tool":
                continue
            parts = list(row.get("parts") or [])
            changed = 0
            for j, part in enumerate(parts):
                if part.get("type") == "tool-result" and (new := stage(part)) is not None:
                    parts[j], changed = new, changed + 1
            if changed:
                rows[i] = {**row, "parts": parts}
                new_count = count_message(rows[i])
                fit.tokens += new_count - counts[i]
                counts[i] = new_count
                setattr(fit, attr, getattr(fit, attr) + changed)
                if fit.tokens <= room:
                    return True
        return False

    if rewrite(masked_part, "masked") or rewrite(excerpted_part, "excerpted"):
        fit.messages = rows
        return fit

    task = next((i for i, m in enumerate(rows) if m.get("id") == task_id), None)
    # earlier exchanges: drop up to the next user message, oldest first
    while task is not None and task > 0 and fit.tokens > room:
        cut = next((i for i in range(1, task + 1) if rows[i].get("role") == "user"), task)
        fit.tokens -= sum(counts[:cut])
        fit.dropped += cut
        del rows[:cut], counts[:cut]
        task -= cut
    # the turn's own oldest groups: assistant + its tool message, keeping the newest group
    start = (task + 1) if task is not None else 0
    while fit.tokens > room:
        if rows[start:start + 1] and rows[start].get("role") == "assistant":
            n = 2 if start + 1 < len(rows) and rows[start + 1].get("role") == "tool" else 1
        else:
            break
        if start + n >= len(rows):  # that is the newest group: the model must see what it just asked for
            break
        fit.tokens -= sum(counts[start:start + n])
        fit.dropped += n
        del rows[start:start + n], counts[start:start + n]
    fit.messages = rows
    return fit
