"""The runner's in-process window fit masks with compaction's masking (``ctxbuild_codec.masking.masked_part``):
since they share it, trimmed web entities and outputs with a non-text original are masked too — the request
still fits the room without dropping anything, and every masked output still names every blob it was kept in."""

from __future__ import annotations

import json

from ctxbuild_codec.records import archived_uris
from ctxbuild_codec.tokens import count_messages
from ctxbuild_orchestration.domain.window_fit import fit_window

from tests.support.compaction import trim_as_truncation
from tests.unit.test_compaction_masking import T, entities, image, store


def exchange(n: int, part: dict) -> list[dict]:
    call = {"type": "tool-call", "toolCallId": part["toolCallId"], "toolName": part["toolName"], "input": {"n": n}}
    return [{"id": f"a{n}", "role": "assistant", "parts": [call]}, {"id": f"t{n}", "role": "tool", "parts": [part]}]


def test_entities_and_non_text_originals_are_masked_recoverably_within_the_room():
    parts = [trim_as_truncation({**make(), "toolCallId": f"c{n}"}, T, store)
             for n, make in enumerate([entities, image, entities, image], start=1)]
    msgs = [{"id": "u", "role": "user", "parts": [{"type": "text", "text": "find the failing export"}]}]
    for n, part in enumerate(parts, start=1):
        msgs += exchange(n, part)
    masked_size = count_messages(fit_window(msgs, 0, None).messages)  # the most the mask stage can do
    room = (masked_size + count_messages(msgs)) // 2
    fit = fit_window(msgs, room, "u")
    assert fit.tokens <= room and fit.dropped == 0 and fit.excerpted == 0 and fit.masked >= 1
    assert [m["id"] for m in fit.messages] == [m["id"] for m in msgs]
    for before, after in zip(msgs, fit.messages, strict=True):
        if before is after:
            continue
        part, masked = before["parts"][0], after["parts"][0]
        assert masked["offload"] == part["offload"]  # the record: every blob stays retained
        uris = archived_uris([before])
        assert uris and all(uri in json.dumps(masked["output"]) for uri in uris)  # and named to the model
