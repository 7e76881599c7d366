"""The context inspector (issue #20): ``/ui`` pages of the edge — conversations, a turn's timeline chart, each
step's exact request — behind the API's keys. See :mod:`.routes`."""

from .routes import COOKIE, build_inspector

__all__ = ["COOKIE", "build_inspector"]
