"""Persistence domain: append planning (concurrency + idempotency) and folding conversation events."""

import pytest
from ctxbuild_persistence.domain.append import NewEvent, StoredRef, plan_append
from ctxbuild_persistence.domain.conversation import conversation_stream, fold, history, path_to
from ctxbuild_platform.errors import Conflict, NotFound

SHA = "ab" * 32


def ev(i: int, type_: str = "Thing") -> NewEvent:
    return NewEvent(event_id=f"00000000-0000-0000-0000-{i:012d}", type=type_, data={"i": i})


def msg(id_: str, role: str = "user", text: str | None = None, **extra) -> dict:
    return {"id": id_, "role": role, "parts": [{"type": "text", "text": text or id_}], **extra}


def e(type_: str, data: dict, version: int | None = None) -> dict:
    out = {"type": type_, "data": data}
    if version is not None:
        out["version"] = version
    return out


# ---------------------------------------------------------------- append planning

def test_new_stream_gets_versions_from_one():
    plan = plan_append("s", 0, [ev(1), ev(2)], current_version=0, existing={})
    assert [v for v, _ in plan.to_insert] == [1, 2]
    assert plan.result([10, 11]) == {"streamId": "s", "fromVersion": 1, "toVersion": 2, "positions": [10, 11],
                                     "duplicates": 0}


def test_expected_version_must_match_current():
    plan_append("s", 3, [ev(1)], current_version=3, existing={})
    with pytest.raises(Conflict) as exc:
        plan_append("s", 2, [ev(1)], current_version=3, existing={})
    assert exc.value.code == "version-conflict"
    assert exc.value.details == {"streamId": "s", "expectedVersion": 2, "actualVersion": 3}
    with pytest.raises(Conflict):
        plan_append("s", 0, [ev(1)], current_version=1, existing={})  # 0 = must be new


def test_any_version_appends_after_current():
    plan = plan_append("s", None, [ev(1)], current_version=7, existing={})
    assert plan.to_insert[0][0] == 8


def test_retry_of_acknowledged_append_succeeds_without_version_check():
    existing = {ev(1).event_id: StoredRef("s", 1, 40), ev(2).event_id: StoredRef("s", 2, 41)}
    # the stream has moved on since (current 5): expectedVersion 0 would conflict for new events
    plan = plan_append("s", 0, [ev(1), ev(2)], current_version=5, existing=existing)
    assert plan.to_insert == []
    assert plan.result([]) == {"streamId": "s", "fromVersion": 1, "toVersion": 2, "positions": [40, 41],
                               "duplicates": 2}


def test_partial_duplicates_store_only_new_events_and_check_version():
    existing = {ev(1).event_id: StoredRef("s", 1, 40)}
    plan = plan_append("s", 1, [ev(1), ev(2)], current_version=1, existing=existing)
    assert [(v, x.event_id) for v, x in plan.to_insert] == [(2, ev(2).event_id)]
    assert plan.result([50]) == {"streamId": "s", "fromVersion": 1, "toVersion": 2, "positions": [40, 50],
                                 "duplicates": 1}
    with pytest.raises(Conflict):
        plan_append("s", 0, [ev(1), ev(2)], current_version=1, existing=existing)


def test_same_id_twice_in_one_request_is_stored_once():
    plan = plan_append("s", None, [ev(1), ev(1)], current_version=0, existing={})
    assert len(plan.to_insert) == 1
    assert plan.result([9])["positions"] == [9, 9]
    assert plan.duplicates == 1


def test_event_id_of_another_stream_is_a_conflict_not_a_duplicate():
    with pytest.raises(Conflict) as exc:
        plan_append("s", None, [ev(1)], current_version=0, existing={ev(1).event_id: StoredRef("other", 1, 3)})
    assert exc.value.code == "event-id-conflict"


# ---------------------------------------------------------------- conversation folding

def test_linear_conversation_path_and_resolved_parents():
    events = [
        e("ConversationCreated", {"conversationId": "c1", "title": "T"}, 1),
        e("UserMessageAdded", {"message": msg("u1")}, 2),
        e("AssistantMessageCompleted", {"turnId": "t1", "messages": [
            msg("a1", "assistant", parts=[{"type": "tool-call", "toolCallId": "k", "toolName": "x", "input": {}}]),
            msg("tool1", "tool"), msg("a2", "assistant")]}, 3),
        e("UserMessageAdded", {"message": msg("u2")}, 4),
    ]
    reply = history("c1", events)
    assert [m["id"] for m in reply["messages"]] == ["u1", "a1", "tool1", "a2", "u2"]
    assert [m["parentId"] for m in reply["messages"]] == [None, "u1", "a1", "tool1", "a2"]
    assert [m.get("turnId") for m in reply["messages"]] == [None, "t1", "t1", "t1", None]
    assert reply["version"] == 4 and reply["title"] == "T" and reply["conversationId"] == "c1"


def test_anchor_follows_parent_ids_of_a_branch():
    events = [
        e("UserMessageAdded", {"message": msg("u1", parentId=None)}),
        e("AssistantMessageCompleted", {"turnId": "t1", "messages": [msg("a1", "assistant", parentId="u1")]}),
        # regenerate: a sibling of a1
        e("AssistantMessageCompleted", {"turnId": "t2", "messages": [msg("a1b", "assistant", parentId="u1")]}),
        e("UserMessageAdded", {"message": msg("u2", parentId="a1")}),
    ]
    conv = fold("c", events)
    assert [m["id"] for m in path_to(conv)] == ["u1", "a1", "u2"]  # default anchor: the last message
    assert [m["id"] for m in path_to(conv, "a1b")] == ["u1", "a1b"]
    assert [m["id"] for m in path_to(conv, "u1")] == ["u1"]
    with pytest.raises(NotFound):
        path_to(conv, "nope")


def test_explicit_null_parent_starts_a_new_root():
    conv = fold("c", [e("UserMessageAdded", {"message": msg("u1")}),
                      e("UserMessageAdded", {"message": msg("u2", parentId=None)})])
    assert [m["id"] for m in path_to(conv)] == ["u2"]


def test_compaction_summary_lands_on_its_boundary_once():
    events = [
        e("UserMessageAdded", {"message": msg("u1")}),
        e("AssistantMessageCompleted", {"turnId": "t1", "messages": [msg("a1", "assistant")]}),
        e("UserMessageAdded", {"message": msg("u2")}),
        e("CompactionSummaryRecorded", {"boundaryId": "u2", "summary": "first"}),
        e("CompactionSummaryRecorded", {"boundaryId": "u2", "summary": "second"}),
    ]
    out = path_to(fold("c", events))
    assert [m.get("compactionSummary") for m in out] == [None, None, "first"]


def test_attachments_in_order_first_per_handle_without_uri():
    att = {"sha256": SHA, "handle": "a.txt", "displayName": "a.txt", "mediaType": "text/plain", "size": 3,
           "uri": "s3://x"}
    att2 = {**att, "handle": "a (2).txt", "sha256": "cd" * 32}
    reply = history("c", [e("AttachmentAdded", {"attachment": att}), e("AttachmentAdded", {"attachment": att2}),
                          e("AttachmentAdded", {"attachment": {**att, "size": 99}})])
    assert reply["attachments"] == [
        {"sha256": SHA, "handle": "a.txt", "displayName": "a.txt", "mediaType": "text/plain", "size": 3},
        {"sha256": "cd" * 32, "handle": "a (2).txt", "displayName": "a.txt", "mediaType": "text/plain", "size": 3},
    ]
    assert reply["messages"] == []


def test_duplicate_message_id_keeps_the_first_and_unknown_events_are_ignored():
    events = [e("UserMessageAdded", {"message": msg("u1", text="one")}),
              e("SomethingNew", {"whatever": 1}),
              e("UserMessageAdded", {"message": msg("u1", text="two")})]
    out = path_to(fold("c", events))
    assert len(out) == 1 and out[0]["parts"][0]["text"] == "one"


def test_fold_does_not_mutate_the_events():
    m = msg("u1")
    events = [e("UserMessageAdded", {"message": m}), e("CompactionSummaryRecorded", {"boundaryId": "u1",
                                                                                        "summary": "s"})]
    history("c", events)
    assert m == msg("u1")


def test_unknown_conversation_is_not_found():
    with pytest.raises(NotFound):
        history("c", [])
    assert conversation_stream("c") == "conversation:c"


def test_parent_cycle_or_dangling_parent_ends_the_walk():
    conv = fold("c", [e("UserMessageAdded", {"message": msg("x", parentId="y")}),
                      e("UserMessageAdded", {"message": msg("y", parentId="x")}),
                      e("UserMessageAdded", {"message": msg("z", parentId="gone")})])
    assert [m["id"] for m in path_to(conv, "y")] == ["x", "y"]
    assert [m["id"] for m in path_to(conv)] == ["z"]
