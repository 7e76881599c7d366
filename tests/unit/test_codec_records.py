"""The one reader of archived-blob provenance and usage (ctxbuild_codec.records)."""

from ctxbuild_codec.records import archived_blobs, archived_uris, usage_of, usage_tokens, vfs_uri_of

A, B, C = ("a" * 64, "b" * 64, "c" * 64)


def uri(sha: str) -> str:
    return f"context://vfs/vfs_{sha[:16]}.txt"


def test_every_blob_of_a_codec_offload_counts_not_only_the_single_uri():
    part = {"type": "tool-result", "toolCallId": "c1", "output": {"type": "json", "value": "{}"},
            "offload": {"mode": "offloaded", "totalChars": 9, "totalLines": 1,
                        "blobs": [{"key": "/0/content", "uri": uri(A), "sha256": A, "totalChars": 4, "totalLines": 1},
                                  {"key": "/1/content", "uri": uri(B), "sha256": B, "totalChars": 5, "totalLines": 1}],
                        "original": {"uri": uri(C), "sha256": C, "totalChars": 20, "of": "value", "type": "json"}}}
    blobs = archived_blobs(part)
    assert [b.uri for b in blobs] == [uri(A), uri(B), uri(C)]
    assert [b.sha256 for b in blobs] == [A, B, C] and {b.tool_call_id for b in blobs} == {"c1"}


def test_a_persisted_envelope_names_its_blob_refs_and_original():
    env = {"version": 2, "blobRefs": [{"vfsFilename": f"vfs_{A[:16]}.txt", "fileEntryId": A},
                                      {"vfsFilename": f"vfs_{B[:16]}.txt", "fileEntryId": B}]}
    part = {"type": "tool-result", "output": {"type": "persisted", "value": env}}
    assert [b.uri for b in archived_blobs(part)] == [uri(A), uri(B)]
    v1 = {"version": 1, "vfsFilename": f"vfs_{A[:16]}.txt", "fileEntryId": A,
          "original": {"vfsFilename": f"vfs_{C[:16]}.txt", "fileEntryId": C}}
    assert [b.uri for b in archived_blobs({"type": "tool-result", "output": {"type": "persisted", "value": v1}})] \
        == [uri(A), uri(C)]


def test_text_that_looks_like_a_marker_is_never_a_source():
    part = {"type": "tool-result", "output": {"type": "text", "value": f"see {uri(A)}"}}
    assert archived_blobs(part) == []
    assert archived_blobs({"type": "text", "text": uri(A)}) == []
    inline = {"type": "tool-result", "offload": {"mode": "inline", "uri": uri(A), "totalChars": 1, "totalLines": 1}}
    assert archived_blobs(inline) == []
    assert vfs_uri_of("vfs_zz.txt") is None and vfs_uri_of(f"vfs_{A[:16]}.txt") == uri(A)


def test_archived_uris_keep_first_appearance_order_without_repeats():
    p = {"type": "tool-result", "offload": {"mode": "offloaded", "uri": uri(B), "sha256": B}}
    q = {"type": "tool-result", "offload": {"mode": "offloaded", "uri": uri(A), "sha256": A}}
    assert archived_uris([{"parts": [p]}, {"parts": [q, p]}]) == [uri(B), uri(A)]


def test_usage_is_read_from_assistant_messages_only():
    assert usage_of({"role": "user", "usage": {"inputTokens": 1}}) is None
    usage = usage_of({"role": "assistant", "usage": {"inputTokens": 10, "outputTokens": 3}})
    assert usage is not None and usage_tokens(usage) == 13
