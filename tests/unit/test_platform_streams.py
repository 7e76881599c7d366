"""ensure_stream: create a missing stream, leave an existing one, accept another replica's create in between."""

from __future__ import annotations

import pytest
from ctxbuild_platform.streams import ensure_stream
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

CONFIG = StreamConfig(name="S", subjects=["s.>"])


class FakeJetStream:
    def __init__(self, *, exists: bool, raced: bool = False) -> None:
        self.exists, self.raced, self.added = exists, raced, []

    async def stream_info(self, name):
        if not self.exists:
            raise NotFoundError()
        return name

    async def add_stream(self, config):
        self.added.append(config)
        if self.raced:  # another replica created it with other settings meanwhile
            self.exists = True
            raise BadRequestError()
        self.exists = True


async def test_a_missing_stream_is_created():
    js = FakeJetStream(exists=False)
    assert await ensure_stream(js, CONFIG) is True
    assert js.added == [CONFIG]


async def test_an_existing_stream_is_left_alone():
    js = FakeJetStream(exists=True)
    assert await ensure_stream(js, CONFIG) is False
    assert js.added == []


async def test_another_replicas_create_in_between_is_fine():
    js = FakeJetStream(exists=False, raced=True)
    assert await ensure_stream(js, CONFIG) is False


async def test_a_refused_create_of_a_stream_that_still_does_not_exist_fails():
    class Refusing(FakeJetStream):
        async def add_stream(self, config):
            raise BadRequestError()

    with pytest.raises(NotFoundError):
        await ensure_stream(Refusing(exists=False), CONFIG)
