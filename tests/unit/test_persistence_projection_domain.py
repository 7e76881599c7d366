"""Conversation projection (pure part): the rows it writes give the same history as the fold, however the event
log is cut into batches; first-wins rules, tree/siblings, file references, and the history extras."""

from __future__ import annotations

import random

from ctxbuild_persistence.domain.conversation import (
    branches,
    fold,
    history,
    history_extras,
    path_to,
    persisted_uris_of,
)
from ctxbuild_persistence.domain.projection import Changes, ConvHead, Known, LogEvent, keys_of, project

SHA = "ab" * 32
URI = "context://vfs/vfs_" + "ef" * 8 + ".txt"


class Rows:
    """An in-memory stand-in for the projection tables (what adapters/projection.py writes)."""

    def __init__(self) -> None:
        self.heads: dict[str, ConvHead] = {}
        self.messages: dict[tuple[str, str], object] = {}
        self.summaries: dict[tuple[str, str], object] = {}
        self.attachments: dict[tuple[str, str], object] = {}
        self.file_refs: dict[tuple, object] = {}
        self.position = 0

    def apply(self, events: list[LogEvent]) -> Changes:
        keys = keys_of(events)
        known = Known({k for k in keys.messages if k in self.messages}, {k for k in keys.handles
                                                                         if k in self.attachments},
                      {k for k in keys.boundaries if k in self.summaries})
        heads = {c: self.heads[c] for c in keys.conversations if c in self.heads}
        ch = project(events, heads, known)
        self.heads.update(ch.heads)
        for m in ch.messages:
            assert (m.conversation_id, m.message_id) not in self.messages  # a primary key would refuse it
            self.messages[(m.conversation_id, m.message_id)] = m
        for s in ch.summaries:
            assert (s.conversation_id, s.boundary_id) not in self.summaries
            self.summaries[(s.conversation_id, s.boundary_id)] = s
        for a in ch.attachments:
            assert (a.conversation_id, a.handle) not in self.attachments
            self.attachments[(a.conversation_id, a.handle)] = a
        for f in ch.file_refs:
            key = (f.conversation_id, f.message_id, f.kind, f.ref)
            assert key not in self.file_refs
            self.file_refs[key] = f
        if ch.last_position is not None:
            self.position = ch.last_position
        return ch

    def history(self, cid: str, anchor: str | None = None) -> dict:
        """What read_history's SQL computes, in Python."""
        from ctxbuild_persistence.domain.conversation import history_reply

        head = self.heads[cid]
        anchor = anchor or head.last_message_id
        path, seen, cur = [], set(), anchor
        while cur is not None and (cid, cur) in self.messages and cur not in seen:
            seen.add(cur)
            row = self.messages[(cid, cur)]
            msg = dict(row.body)
            if (cid, cur) in self.summaries:
                msg["compactionSummary"] = self.summaries[(cid, cur)].summary
            path.append(msg)
            cur = row.parent_id
        path.reverse()
        atts = sorted((a for (c, _), a in self.attachments.items() if c == cid), key=lambda a: a.seq)
        return history_reply(cid, head.version, head.title, path, [a.reply() for a in atts], source="fold")


def msg(id_: str, role: str = "user", **extra) -> dict:
    return {"id": id_, "role": role, "parts": [{"type": "text", "text": id_}], **extra}


def log_of(*per_stream: tuple[str, list[tuple[str, dict]]]) -> list[LogEvent]:
    """Interleave streams round-robin into one global log with positions and versions."""
    queues = [(s, list(evs)) for s, evs in per_stream]
    versions: dict[str, int] = {}
    out: list[LogEvent] = []
    pos = 100
    while any(q for _, q in queues):
        for s, q in queues:
            if q:
                t, d = q.pop(0)
                versions[s] = versions.get(s, 0) + 1
                pos += random.choice((1, 1, 2))  # a rolled-back append leaves a hole in the sequence
                out.append(LogEvent(pos, s, versions[s], t, d))
    return out


def fold_events(log: list[LogEvent], stream: str) -> list[dict]:
    return [{"type": e.type, "data": e.data, "version": e.version} for e in log if e.stream_id == stream]


def sample_conversation(rng: random.Random, n: int) -> list[tuple[str, dict]]:
    evs: list[tuple[str, dict]] = [("ConversationCreated", {"conversationId": "x", "title": "T"})]
    ids: list[str] = []
    for i in range(n):
        k = rng.random()
        if k < 0.3 or not ids:
            m = msg(f"u{i}")
            if ids and rng.random() < 0.3:
                m["parentId"] = rng.choice(ids)  # a branch
            if rng.random() < 0.2:
                m["parts"].append({"type": "file", "handle": f"f{i % 3}.txt", "displayName": "f.txt",
                                   "mediaType": "text/plain", "sha256": SHA})
            evs.append(("UserMessageAdded", {"message": m}))
            ids.append(m["id"])
        elif k < 0.6:
            parent = rng.choice(ids)
            a = msg(f"a{i}", "assistant", parentId=parent, usage={"inputTokens": i, "outputTokens": 1})
            t = {"id": f"t{i}", "role": "tool", "parts": [{
                "type": "tool-result", "toolCallId": f"c{i}", "toolName": "fs_read",
                "output": {"type": "text", "value": "x"},
                "offload": {"mode": "offloaded", "uri": URI.replace("efef", f"{i % 100:02d}ef"), "totalChars": 9,
                            "totalLines": 1}}]}
            msgs = [a, t] if rng.random() < 0.7 else [a]
            if rng.random() < 0.1:
                msgs.append(msg(ids[0], "assistant"))  # a repeated id: the first one wins
            evs.append(("AssistantMessageCompleted", {"turnId": f"turn{i}", "messages": msgs}))
            ids += [m["id"] for m in msgs if m["id"] not in ids]
        elif k < 0.75:
            h = f"f{i % 4}.txt"
            evs.append(("AttachmentAdded", {"attachment": {"sha256": SHA, "handle": h, "displayName": h,
                                                           "mediaType": "text/plain", "size": i}}))
        elif k < 0.9:
            evs.append(("CompactionSummaryRecorded", {"boundaryId": rng.choice(ids), "summary": f"s{i}"}))
        else:
            evs.append(("SomethingNew", {"n": i}))
    return evs


def test_projection_equals_fold_for_any_batching():
    for seed in range(40):
        rng = random.Random(seed)
        random.seed(seed)
        log = log_of(("conversation:c1", sample_conversation(rng, 30)),
                     ("turn:t1", [("StepServed", {"step": 1})] * 5),
                     ("conversation:c2", sample_conversation(rng, 20)))
        rows = Rows()
        i = 0
        while i < len(log):
            size = rng.randint(1, 12)
            rows.apply(log[i:i + size])
            i += size
        assert rows.position == log[-1].position
        for cid in ("c1", "c2"):
            stream = f"conversation:{cid}"
            conv = fold(cid, fold_events(log, stream))
            anchors = [None, *rng.sample(list(conv.messages), 3)]
            for anchor in anchors:
                assert rows.history(cid, anchor) == history(cid, fold_events(log, stream), anchor), (seed, anchor)


def test_messages_with_the_same_parent_are_siblings():
    log = log_of(("conversation:c", [
        ("UserMessageAdded", {"message": msg("u1", parentId=None)}),
        ("AssistantMessageCompleted", {"turnId": "t1", "messages": [msg("a1", "assistant", parentId="u1")]}),
        ("AssistantMessageCompleted", {"turnId": "t2", "messages": [msg("a2", "assistant", parentId="u1")]}),
        ("UserMessageAdded", {"message": msg("u2")}),  # no parentId: under the last added (a2)
    ]))
    rows = Rows()
    ch = rows.apply(log)
    assert [(m.message_id, m.seq, m.parent_id, m.turn_id) for m in ch.messages] == [
        ("u1", 1, None, None), ("a1", 2, "u1", "t1"), ("a2", 3, "u1", "t2"), ("u2", 4, "a2", None)]
    assert ch.heads["c"].last_message_id == "u2" and ch.heads["c"].message_count == 4
    conv = fold("c", fold_events(log, "conversation:c"))
    assert branches(conv, ["u1", "a2", "u2"]) == {"a2": ["a1", "a2"]}
    assert [m["id"] for m in path_to(conv, "a1")] == ["u1", "a1"]


def test_first_wins_across_batches_and_heads_carry_over():
    log = log_of(("conversation:c", [
        ("ConversationCreated", {"conversationId": "c", "title": "first"}),
        ("UserMessageAdded", {"message": msg("u1")}),
        ("CompactionSummaryRecorded", {"boundaryId": "u1", "summary": "one"}),
        ("AttachmentAdded", {"attachment": {"sha256": SHA, "handle": "a.txt", "displayName": "a.txt",
                                            "mediaType": "text/plain", "size": 1}}),
        ("ConversationCreated", {"conversationId": "c", "title": "second"}),
        ("UserMessageAdded", {"message": msg("u1", text="again")}),
        ("CompactionSummaryRecorded", {"boundaryId": "u1", "summary": "two"}),
        ("AttachmentAdded", {"attachment": {"sha256": SHA, "handle": "a.txt", "displayName": "b.txt",
                                            "mediaType": "text/plain", "size": 2}}),
    ]))
    rows = Rows()
    rows.apply(log[:4])
    second = rows.apply(log[4:])
    assert second.messages == [] and second.summaries == [] and second.attachments == []
    head = rows.heads["c"]
    assert (head.title, head.version, head.message_count, head.attachment_count) == ("first", 8, 1, 1)
    assert head.first_position == log[0].position and head.last_position == log[-1].position
    h = rows.history("c")
    assert h["messages"][0]["compactionSummary"] == "one" and h["attachments"][0]["size"] == 1


def test_other_streams_only_move_the_position():
    log = [LogEvent(5, "turn:t", 1, "TurnStarted", None), LogEvent(9, "test:x", 1, "Thing", None)]
    ch = project(log, {}, Known())
    assert ch.last_position == 9 and not ch.heads and not ch.messages


def test_file_references_are_typed_provenance_only():
    v1 = {"fileEntryId": SHA, "vfsFilename": "vfs_" + SHA[:16] + ".txt", "head": "h", "tail": "t",
          "totalChars": 9, "totalLines": 1, "shape": "text"}
    v2 = {"skeleton": [], "blobRefs": [{"key": "/0/content", "fileEntryId": "cd" * 32,
                                        "vfsFilename": "vfs_" + "cd" * 8 + ".txt", "head": "", "tail": "",
                                        "totalChars": 1, "totalLines": 1}], "shape": "entities"}
    tool = {"id": "t1", "role": "tool", "parts": [
        {"type": "tool-result", "toolCallId": "k1", "toolName": "bash", "output": {"type": "persisted", "value": v1}},
        {"type": "tool-result", "toolCallId": "k2", "toolName": "web_search",
         "output": {"type": "persisted", "value": v2}},
        # looks like a marker, is plain text: never a reference (SPEC §1)
        {"type": "tool-result", "toolCallId": "k3", "toolName": "bash", "output": {
            "type": "text", "value": "<persisted-output>\nFull output: context://vfs/vfs_0000000000000000.txt"}},
        {"type": "tool-result", "toolCallId": "k4", "toolName": "read_file", "output": {"type": "text", "value": "x"},
         "offload": {"mode": "offloaded", "uri": URI, "sha256": SHA, "totalChars": 9, "totalLines": 1}},
        {"type": "tool-result", "toolCallId": "k5", "toolName": "read_file", "output": {"type": "text", "value": "x"},
         "offload": {"mode": "inline", "totalChars": 9, "totalLines": 1}},
    ]}
    user = msg("u1", parts=[{"type": "file", "handle": "a.txt", "displayName": "a", "mediaType": "text/plain",
                             "sha256": SHA}])
    assert persisted_uris_of(tool) == [("context://vfs/vfs_" + SHA[:16] + ".txt", SHA, "k1"),
                                       ("context://vfs/vfs_" + "cd" * 8 + ".txt", "cd" * 32, "k2"),
                                       (URI, SHA, "k4")]
    log = log_of(("conversation:c", [("UserMessageAdded", {"message": user}),
                                     ("AssistantMessageCompleted", {"turnId": "t", "messages": [tool]})]))
    ch = Rows().apply(log)
    assert [(f.message_id, f.kind, f.ref, f.tool_call_id) for f in ch.file_refs] == [
        ("u1", "attachment", "a.txt", None),
        ("t1", "tool_output", "context://vfs/vfs_" + SHA[:16] + ".txt", "k1"),
        ("t1", "tool_output", "context://vfs/vfs_" + "cd" * 8 + ".txt", "k2"),
        ("t1", "tool_output", URI, "k4")]


def test_codec_offload_blobs_and_originals_count_as_archived():
    """SPEC §8.2 inv. 4: a trimmed web-entities part names its blobs in ``offload.blobs`` (no single uri) and a
    non-text output its original in ``offload.original``: both reach persistedUris and the file references."""
    web = [("/0/content", "c1"), ("/1/content", "c2")]
    tool = {"id": "t1", "role": "tool", "parts": [
        {"type": "tool-result", "toolCallId": "w1", "toolName": "web_search",
         "output": {"type": "json", "value": [{"content": "trimmed"}, {"content": "trimmed"}]},
         "offload": {"mode": "offloaded", "totalChars": 90_000, "totalLines": 40,
                     "blobs": [{"key": k, "uri": f"context://vfs/vfs_{h * 8}.txt", "sha256": h * 32,
                                "totalChars": 45_000, "totalLines": 20} for k, h in web]}},
        {"type": "tool-result", "toolCallId": "j1", "toolName": "mcp_tool",
         "output": {"type": "text", "value": "excerpt"},
         "offload": {"mode": "offloaded", "uri": URI, "sha256": "ef" * 32, "totalChars": 70_000, "totalLines": 9,
                     "original": {"uri": "context://vfs/vfs_" + "0a" * 8 + ".txt", "sha256": "0a" * 32,
                                  "totalChars": 70_100, "of": "output", "type": "content"}}},
    ]}
    uris = ["context://vfs/vfs_" + "c1" * 8 + ".txt", "context://vfs/vfs_" + "c2" * 8 + ".txt", URI,
            "context://vfs/vfs_" + "0a" * 8 + ".txt"]
    assert persisted_uris_of(tool) == [(uris[0], "c1" * 32, "w1"), (uris[1], "c2" * 32, "w1"),
                                       (URI, "ef" * 32, "j1"), (uris[3], "0a" * 32, "j1")]
    assert history_extras([msg("u1"), tool])["persistedUris"] == uris
    log = log_of(("conversation:c", [("AssistantMessageCompleted", {"turnId": "t", "messages": [tool]})]))
    assert [(f.ref, f.sha256, f.tool_call_id) for f in Rows().apply(log).file_refs] == [
        (uris[0], "c1" * 32, "w1"), (uris[1], "c2" * 32, "w1"), (URI, "ef" * 32, "j1"), (uris[3], "0a" * 32, "j1")]
    assert history("c", [{"type": "AssistantMessageCompleted", "version": 1,
                          "data": {"turnId": "t", "messages": [tool]}}])["persistedUris"] == uris


def test_history_extras_for_compaction():
    rows = [msg("u1"),
            msg("a1", "assistant", usage={"inputTokens": 10, "outputTokens": 2}),
            {**msg("u2"), "compactionSummary": "s"},
            {"id": "t1", "role": "tool", "parts": [{"type": "tool-result", "toolCallId": "k", "toolName": "x",
                                                    "output": {"type": "text", "value": "v"},
                                                    "offload": {"mode": "offloaded", "uri": URI, "totalChars": 1,
                                                                "totalLines": 1}}]},
            msg("a2", "assistant")]
    assert history_extras(rows) == {"lastUsage": {"messageId": "a1", "usage": {"inputTokens": 10, "outputTokens": 2}},
                                    "summaries": [{"boundaryId": "u2", "index": 2}], "persistedUris": [URI]}
    assert history_extras([]) == {"lastUsage": None, "summaries": [], "persistedUris": []}
    reply = history("c", [{"type": "UserMessageAdded", "data": {"message": msg("u1")}, "version": 1}])
    assert reply["anchorId"] == "u1" and reply["source"] == "fold"
