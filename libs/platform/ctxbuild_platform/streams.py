"""JetStream streams a service creates at start when they are missing. Every replica does it, so two may race:
another replica's create of the same stream is fine."""

from __future__ import annotations

from nats.js.api import StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> bool:
    """Create ``config``'s stream unless it exists; True when it was missing (and is there now). Another replica's
    concurrent create is fine: an identical one is accepted by the server, a differing one is refused and the
    stream is looked up again (it must exist now)."""
    try:
        await js.stream_info(config.name)
        return False
    except NotFoundError:
        pass
    try:
        await js.add_stream(config)
        return True
    except BadRequestError:
        await js.stream_info(config.name)
        return False
