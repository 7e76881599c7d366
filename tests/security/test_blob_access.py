"""The blob allow-list is the retained context of the history being served (SPEC §6, §15), attacked on the real
stack: another conversation's archived outputs and attachments, reads revoked by a clear-context marker or a
``maxMessages`` window, another branch's blob, forged scopes, envelopes, offload records and claims, and a put whose
declared digest lies. Every refusal of a model's read reads exactly like a missing blob (no oracle), and the
victim's secret marker appears nowhere in the reply or in what the attacker's turn stored."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import httpx
import pytest
from ctxbuild_blobclient import BlobClient
from ctxbuild_platform.errors import RemoteError
from security_support import (
    Edge,
    Turn,
    offloaded_uri,
    refusal,
    secret_lines,
    start_all,
    uid,
    victim_conversation,
)

from tests.support.auth import AUTH
from tests.support.persistence import append, event

pytestmark = [pytest.mark.security, pytest.mark.e2e]

PREFIX = re.compile(r"vfs_[0-9a-f]{16}")


def same_shape(a: str, b: str) -> bool:
    """Two not-found texts that differ only in the handle they name."""
    return PREFIX.sub("vfs_<h>", a) == PREFIX.sub("vfs_<h>", b)


@pytest.fixture(scope="module")
def edge(stack, start_service) -> Edge:
    return Edge(start_all(stack, start_service))


@pytest.fixture(scope="module")
def victim(edge) -> dict[str, Any]:
    return victim_conversation(edge)


# ---------------------------------------------------------------- another conversation's blobs, through a turn
CROSS = {  # name → the attacker model's call, built from what it knows about A
    "fs_read-archived-uri": lambda v: ("fs_read", {"uri": v["uri"]}),
    "fs_read-archived-bare-handle": lambda v: ("fs_read", {"uri": v["uri"].removeprefix("context://vfs/")}),
    "fs_read-archived-page-2": lambda v: ("fs_read", {"uri": v["uri"], "offset": 2, "limit": 5}),
    "fs_read-attachment-uri": lambda v: ("fs_read", {"uri": v["att_uri"]}),
    "read_file-handle": lambda v: ("read_file", {"filename": v["handle"]}),
    "read_file-display-name": lambda v: ("read_file", {"filename": "secretA.txt", "offset": 100}),
}


@pytest.fixture(scope="module")
def cross(edge, victim) -> dict[str, Any]:
    """Conversation B (a stranger with an attachment of its own) asks for A's blobs in one step, next to a URI and
    a file name that exist nowhere — the baseline every refusal must look like."""
    b = edge.conversation(contextWindow=16000)
    edge.attach(b, "mine.txt", "B's own notes\n")
    calls = [CROSS[k](victim) for k in CROSS]
    calls += [("fs_read", {"uri": f"context://vfs/vfs_{uid()[:16]}.txt"}), ("read_file", {"filename": "nowhere.txt"})]
    turn = edge.turn(b, [{"toolCalls": [{"toolName": n, "input": i} for n, i in calls]}, {"text": "done"}])
    assert turn.end["type"] == "TurnCompleted", turn.end
    outs = turn.outputs()
    return {"turn": turn, "outs": dict(zip([*CROSS, "missing-uri", "missing-file"], outs, strict=True)),
            "stored": edge.stored(turn)}


@pytest.mark.parametrize("attack", list(CROSS))
def test_another_conversations_blob_reads_like_a_missing_one(cross, victim, attack):
    text = refusal(cross["outs"][attack])
    assert text.startswith("[Error: not-found]"), text
    baseline = refusal(cross["outs"]["missing-uri" if attack.startswith("fs_read") else "missing-file"])
    if attack.startswith("fs_read"):
        assert same_shape(text, baseline), (text, baseline)
    else:  # the same sentence as for a name that exists nowhere, listing only B's own attachment
        name = CROSS[attack](victim)[1]["filename"]
        assert text.replace(repr(name), "'X'") == baseline.replace("'nowhere.txt'", "'X'"), (text, baseline)
        assert victim["handle"] not in text.replace(repr(name), "")
    assert victim["marker"] not in json.dumps(cross["outs"][attack])
    assert victim["marker"] not in cross["stored"]


# ---------------------------------------------------------------- revoked reads inside one conversation
def archived_attachment_read(edge: Edge, name: str, marker: str) -> tuple[str, dict[str, Any], Turn, str]:
    """A new conversation whose first turn reads its big attachment ``name`` (holding ``marker``) whole, so the
    read's output is archived: (conversation id, the attachment, that turn, the archived output's URI)."""
    cid = edge.conversation(contextWindow=16000)
    att = edge.attach(cid, name, secret_lines(marker))
    first = edge.turn(cid, [{"toolCalls": [{"toolName": "read_file", "input": {"filename": att["handle"],
                                                                                 "limit": 60000}}]}, {"text": "ok"}])
    return cid, att, first, offloaded_uri(first)


@pytest.fixture(scope="module")
def cleared(edge, rpc) -> dict[str, Any]:
    """Conversation C reads its own big attachment (archived), can read the archive back in a second turn, then a
    clear-context marker is added: the third turn may read neither the archive nor the attachment."""
    marker = "CLEARED-" + uid()
    cid, att, _, uri = archived_attachment_read(edge, "old.txt", marker)
    before = edge.turn(cid, [{"toolCalls": [{"toolName": "fs_read", "input": {"uri": uri, "limit": 2}}]},
                             {"text": "ok"}])
    assert marker in before.outputs()[0]["output"]["value"]  # in scope: readable (the control)
    return {"cid": cid, "marker": marker, "uri": uri, "handle": att["handle"], "edge": edge, "rpc": rpc}


def revoked_reads(uri: str, handle: str) -> list[dict[str, Any]]:
    """One step reading the archived output and the attachment, next to a URI that exists nowhere (the baseline
    an archived output's refusal must look like)."""
    return [{"toolCalls": [
        {"toolName": "fs_read", "input": {"uri": uri}},
        {"toolName": "read_file", "input": {"filename": handle}},
        {"toolName": "fs_read", "input": {"uri": f"context://vfs/vfs_{uid()[:16]}.txt"}}]}, {"text": "done"}]


def assert_revoked(outs: list[dict[str, Any]], which: str, marker: str, stored: str) -> None:
    text = refusal(outs[0 if which == "archived-output" else 1])
    assert text.startswith("[Error: not-found]"), text
    if which == "archived-output":
        assert same_shape(text, refusal(outs[2]))
    assert marker not in stored


async def add_clear_marker(rpc, edge: Edge, cid: str) -> None:
    last = edge.messages(cid)[-1]["id"]
    marker = {"id": f"msg_clear_{uid()[:12]}", "parentId": last, "role": "user",
              "parts": [{"type": "text", "text": "/clear"}], "clearContext": True}
    await append(rpc, f"conversation:{cid}", [event("UserMessageAdded", {"message": marker})])


@pytest.fixture(scope="module")
async def after_clear(cleared) -> dict[str, Any]:
    edge, cid = cleared["edge"], cleared["cid"]
    await add_clear_marker(cleared["rpc"], edge, cid)
    turn = edge.turn(cid, revoked_reads(cleared["uri"], cleared["handle"]))
    return {"turn": turn, "outs": turn.outputs(), "stored": edge.stored(turn)}


@pytest.mark.parametrize("which", ["archived-output", "attachment"])
def test_a_clear_context_marker_revokes_reads(after_clear, cleared, which):
    assert_revoked(after_clear["outs"], which, cleared["marker"], after_clear["stored"])


@pytest.fixture(scope="module")
def windowed(edge) -> dict[str, Any]:
    """Conversation D with ``maxMessages: 1``: its second turn serves only the new user message, so the first
    turn's archived output (a large recorded tool output) and the attachment are out of its window."""
    marker = "WINDOW-" + uid()
    cid = edge.conversation(contextWindow=16000, maxMessages=1)
    att = edge.attach(cid, "early.txt", secret_lines(marker))
    big = {"type": "text", "value": secret_lines(marker, 3000)}  # a script over 256 KiB travels as a blob
    first = edge.turn(cid, [{"toolCalls": [{"toolName": "shell", "input": {"cmd": "cat log"}, "output": big}]},
                            {"text": "ok"}], tools=[{"name": "shell", "description": "run a command"}])
    uri = offloaded_uri(first)
    second = edge.turn(cid, revoked_reads(uri, att["handle"]))
    return {"marker": marker, "outs": second.outputs(), "stored": edge.stored(second)}


@pytest.mark.parametrize("which", ["archived-output", "attachment"])
def test_a_max_messages_window_revokes_reads(windowed, which):
    assert_revoked(windowed["outs"], which, windowed["marker"], windowed["stored"])


@pytest.fixture(scope="module")
def branches(edge) -> dict[str, Any]:
    """Conversation E: the first answer archives a read; a regenerated answer (a sibling branch over the same
    user message) asks for that archive; a follow-up on the regenerated branch asks again."""
    marker = "BRANCH-" + uid()
    cid, _, first, uri = archived_attachment_read(edge, "shared.txt", marker)
    sibling = edge.regenerate(cid, first.id, [{"toolCalls": [{"toolName": "fs_read", "input": {"uri": uri}}]},
                                              {"text": "other branch"}])
    later = edge.turn(cid, [{"toolCalls": [{"toolName": "fs_read", "input": {"uri": uri, "limit": 3}}]},
                            {"text": "still the other branch"}])
    return {"marker": marker, "sibling": sibling, "later": later, "edge": edge}


@pytest.mark.parametrize("which", ["regenerated-turn", "follow-up-on-the-other-branch"])
def test_another_branchs_archive_is_not_readable(branches, which):
    turn: Turn = branches["sibling" if which == "regenerated-turn" else "later"]
    assert turn.end["type"] == "TurnCompleted", turn.end
    text = refusal(turn.outputs()[0])
    assert text.startswith("[Error: not-found]"), text
    assert branches["marker"] not in branches["edge"].stored(turn)


# ---------------------------------------------------------------- forged requests straight to the blob store
def forged_reads(v: dict[str, Any], attacker: str) -> dict[str, tuple[str, dict[str, Any]]]:
    widen = {"persistedUris": [v["uri"], v["att_uri"]],
             "fileAttachments": [{"sha256": v["att_sha"], "handle": v["handle"], "displayName": "secretA.txt"}]}
    return {
        # a scope naming A's URIs cannot widen B's reads: the conversation must reference the blob itself
        "fs_read-forged-retained": ("ctx.blob.fs_read", {"conversationId": attacker, "uri": v["uri"],
                                                         "retained": widen}),
        "fs_read-forged-turn-of-A": ("ctx.blob.fs_read", {"conversationId": attacker, "uri": v["uri"],
                                                          "turnId": v["turn"],
                                                          "retained": {"persistedUris": [], "fileAttachments": []}}),
        "read_file-forged-retained": ("ctx.blob.read_file", {"conversationId": attacker, "filename": v["handle"],
                                                             "retained": widen}),
    }


@pytest.mark.parametrize("attack", ["fs_read-forged-retained", "fs_read-forged-turn-of-A",
                                    "read_file-forged-retained"])
async def test_a_forged_scope_never_widens_a_read(victim, rpc, attack):
    attacker = "conv-attacker-" + uid()
    subject, req = forged_reads(victim, attacker)[attack]
    r = await rpc.call(subject, req)
    assert (r.get("code") or r.get("error", {}).get("code")) == "not-found", r
    assert victim["marker"] not in json.dumps(r)


async def test_a_forged_envelope_is_refused(victim, rpc):
    env = {"shape": "text", "fileEntryId": victim["att_sha"], "vfsFilename": f"vfs_{victim['att_sha'][:16]}.txt",
           "totalChars": 10, "totalLines": 1, "head": "", "tail": ""}
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.blob.get_result", {"conversationId": "conv-attacker-" + uid(), "envelope": env})
    assert err.value.code == "access-denied", err.value
    assert victim["marker"] not in str(err.value)


async def test_a_forged_offload_record_is_refused(victim, rpc):
    offload = {"mode": "offloaded", "totalChars": 10, "totalLines": 1,
               "original": {"uri": victim["att_uri"], "sha256": victim["att_sha"], "totalChars": 10, "of": "value",
                            "type": "json"}}
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.blob.get_result", {"conversationId": "conv-attacker-" + uid(), "offload": offload})
    assert err.value.code == "access-denied", err.value
    assert victim["marker"] not in str(err.value)


async def test_a_forged_claim_to_truncation_is_refused(victim, rpc):
    attacker = "conv-attacker-" + uid()
    req = {"conversationId": attacker, "turnId": "turn_" + uid()[:20], "settings": {"contextWindow": 16000},
           "parts": [{"type": "tool-result", "toolCallId": "c1", "toolName": "mcp__shell__run_0123",
                      "output": {"type": "text", "value": ""}}],
           "claims": [{"part": 0, "sha256": victim["att_sha"], "uri": victim["att_uri"]}]}
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.truncate.step", req, timeout=60)
    assert err.value.code == "access-denied", err.value
    assert victim["marker"] not in str(err.value)


async def test_minting_a_reference_to_anothers_blob_is_refused(victim, rpc):
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.blob.ref", {"sha256": victim["att_sha"], "conversationId": "conv-attacker-" + uid(),
                                        "owner": {"kind": "message", "id": uid()}, "role": "tool_output"})
    assert err.value.code == "access-denied", err.value


# ---------------------------------------------------------------- a put whose declared digest lies
DIGESTS = {
    "another-contents-digest": lambda v: hashlib.sha256(b"something else").hexdigest(),
    "the-victims-blob-digest": lambda v: v["att_sha"],  # claiming A's content identity for other bytes
    "all-zero": lambda v: "0" * 64,
}


@pytest.mark.parametrize("attack", list(DIGESTS))
async def test_put_with_a_lying_digest_is_invalid_payload(victim, rpc, pg, attack):
    attacker, content = "conv-attacker-" + uid(), f"attacker bytes {uid()}\n"
    declared = DIGESTS[attack](victim)
    with pytest.raises(RemoteError) as err:
        await rpc.call("ctx.blob.put", {"content": content, "conversationId": attacker, "sha256": declared,
                                        "owner": {"kind": "message", "id": uid()}, "role": "tool_output"})
    assert err.value.code == "invalid-payload" and not err.value.retryable, err.value
    actual = hashlib.sha256(content.encode()).hexdigest()
    assert await pg.fetchval("SELECT count(*) FROM blobstore.blobs WHERE sha256 = $1", actual) == 0
    assert await pg.fetchval("SELECT count(*) FROM blobstore.refs WHERE conversation_id = $1", attacker) == 0
    r = await rpc.call("ctx.blob.fs_read", {"conversationId": attacker, "uri": victim["att_uri"],
                                            "retained": {"persistedUris": [victim["att_uri"]], "fileAttachments": []}})
    assert r["code"] == "not-found" and victim["marker"] not in json.dumps(r)


async def test_the_blob_client_passes_a_declared_digest_on_the_inline_path(rpc):
    with pytest.raises(RemoteError) as err:
        await BlobClient(rpc).put("small content", "conv-attacker-" + uid(), ("message", uid()), "tool_output",
                                  sha256=hashlib.sha256(b"other").hexdigest())
    assert err.value.code == "invalid-payload"
    ok = await BlobClient(rpc).put("small content", "conv-" + uid(), ("message", uid()), "tool_output",
                                   sha256=hashlib.sha256(b"small content").hexdigest())
    assert ok["sha256"] == hashlib.sha256(b"small content").hexdigest()


def test_the_http_edge_reads_back_nothing_of_another_conversation(edge, victim, cross):
    """The results endpoint of B with A's message and call ids finds nothing (the read-back is B's own history)."""
    msg = next(m for m in edge.messages(victim["cid"]) if m["role"] == "tool")
    call = next(p["toolCallId"] for p in msg["parts"] if p["type"] == "tool-result")
    r = httpx.get(f"{edge.base}/v1/conversations/{cross['turn'].conversation}/messages/{msg['id']}/results/{call}",
                  headers=AUTH, timeout=30)
    assert r.status_code == 404, r.text
    assert victim["marker"] not in r.text
