"""The runner's provider factory: each turn gets a provider for the model its command names, over one SDK client
per endpoint kind (its connection pool and TLS context are built once, not per turn)."""

import asyncio

from ctxbuild_orchestration.app.providers import provider_factory
from ctxbuild_orchestration.settings import Settings


def test_turns_share_one_sdk_client_per_endpoint_kind() -> None:
    settings = Settings(nats_url="nats://127.0.0.1:4222", openai_base_url="http://127.0.0.1:9/v1",
                        openai_api_key="sk-up", anthropic_base_url="http://127.0.0.1:8", anthropic_api_key="sk-ant")
    make = provider_factory(settings, backends=None)  # type: ignore[arg-type] - replay specs only need it

    async def providers():
        return await asyncio.gather(make({"kind": "openai", "model": "gpt-a"}, "conv_1", "turn_1"),
                                    make({"kind": "openai", "model": "gpt-b"}, "conv_2", "turn_2"),
                                    make({"kind": "anthropic", "model": "claude-a"}, "conv_1", "turn_3"),
                                    make({"kind": "anthropic", "model": "claude-b"}, "conv_3", "turn_4"))

    oa, ob, aa, ab = asyncio.run(providers())
    assert (oa.model, ob.model, aa.model, ab.model) == ("gpt-a", "gpt-b", "claude-a", "claude-b")
    assert oa.client is ob.client and aa.client is ab.client
    assert str(oa.client.base_url).startswith("http://127.0.0.1:9/v1") and oa.client.api_key == "sk-up"
    assert str(aa.client.base_url).startswith("http://127.0.0.1:8") and aa.client.api_key == "sk-ant"
