"""Blob-store naming and GC rules (pure): object keys, lock keys, transfer inboxes, orphan selection."""

from datetime import UTC, datetime, timedelta

import pytest
from ctxbuild_blobstore.domain.gcpolicy import StoredObject, cutoff, orphan_candidates
from ctxbuild_blobstore.domain.keys import INBOX, lock_key, object_key, sha_from_key, temp_key
from ctxbuild_platform import contracts
from ctxbuild_platform.errors import InvalidPayload

SHA = "ab" * 32


def test_keys():
    assert object_key(SHA) == "blobs/" + SHA and sha_from_key(object_key(SHA)) == SHA
    assert temp_key("u1") == "uploads/u1" and sha_from_key("uploads/u1") is None
    for stray in ("blobs/", "blobs/xyz", "blobs/" + SHA.upper(), "blobs/" + SHA + "/x", ".ready", "other/" + SHA):
        assert sha_from_key(stray) is None


def test_lock_key_is_a_signed_bigint_from_the_hash():
    assert lock_key("0" * 64) == 0
    assert lock_key("f" * 64) == -1
    assert lock_key("7fffffffffffffff" + "0" * 48) == 2**63 - 1
    assert -(2**63) <= lock_key("8000000000000000" + "1" * 48) < 0


@pytest.mark.parametrize("subject", ["_INBOX.abc", "_INBOX.Ab9_-.x.y"])
def test_inboxes_accepted(subject):
    assert INBOX.match(subject)
    contracts.validate("subjects/ctx.blob.get.request.json", {"conversationId": "c", "sink": subject, "sha256": SHA})


@pytest.mark.parametrize("subject", ["ctx.persist.append", "_INBOX.>", "_INBOX.*", "_INBOX.", "_INBOX.a b",
                                     "_INBOX..a", "inbox.x", "_INBOX.a\n"])
def test_service_subjects_and_wildcards_are_not_inboxes(subject):
    assert not INBOX.fullmatch(subject)
    with pytest.raises(InvalidPayload):
        contracts.validate("subjects/ctx.blob.upload.request.json",
                           {"conversationId": "c", "source": subject, "owner": {"kind": "turn", "id": "t"},
                            "role": "provisional"})


def test_upload_request_is_either_a_reference_or_an_attachment():
    base = {"conversationId": "c", "source": "_INBOX.x"}
    contracts.validate("subjects/ctx.blob.upload.request.json",
                       {**base, "owner": {"kind": "turn", "id": "t"}, "role": "provisional"})
    contracts.validate("subjects/ctx.blob.upload.request.json", {**base, "attachment": {"displayName": "a.txt"}})
    for bad in ({**base},
                {**base, "owner": {"kind": "turn", "id": "t"}},
                {**base, "attachment": {"displayName": "a"}, "owner": {"kind": "turn", "id": "t"},
                 "role": "attachment"},
                {**base, "attachment": {"displayName": "a"}, "sha256": "nothex"}):
        with pytest.raises(InvalidPayload):
            contracts.validate("subjects/ctx.blob.upload.request.json", bad)


def test_get_request_names_exactly_one_blob():
    base = {"conversationId": "c", "sink": "_INBOX.x"}
    for bad in (base, {**base, "sha256": SHA, "uri": "context://vfs/vfs_abababababababab.txt"},
                {**base, "sha256": SHA, "offset": -1}):
        with pytest.raises(InvalidPayload):
            contracts.validate("subjects/ctx.blob.get.request.json", bad)


def test_orphans_are_old_blob_objects_without_metadata():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    limit = cutoff(now, 3600)
    assert limit == now - timedelta(hours=1)
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    objs = [StoredObject(object_key(a), now - timedelta(hours=2)),  # old, no metadata: orphan
            StoredObject(object_key(b), now - timedelta(hours=2)),  # old, has metadata: kept
            StoredObject(object_key(c), now - timedelta(minutes=5)),  # young (a put may be in flight): kept
            StoredObject("blobs/not-a-hash", now - timedelta(days=9)),  # stray key: never touched
            StoredObject(".ready", now - timedelta(days=9))]
    assert orphan_candidates(objs, known={b}, cutoff=limit) == [a]
