"""An ``on_text`` callback for provider tests: collects the text deltas a provider hands out, in order."""

from __future__ import annotations


class Deltas(list):
    async def __call__(self, text: str) -> None:
        self.append(text)
