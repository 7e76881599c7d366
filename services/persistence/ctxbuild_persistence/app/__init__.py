"""The use cases of the persistence service: the only place that combines the domain and the adapters.

- ``events``: ``ctx.persist.append`` / ``read_stream`` / ``read_all`` (:class:`EventLog`);
- ``history``: ``ctx.persist.history``, from the projection or folded from the events (:class:`History`);
- ``persist_lane``: ``ctx.persist.complete_turn``, the persist lane (:class:`PersistLane`);
- ``models``: the generated contract models as these take and return them.
"""

from .events import EventLog, to_new_events
from .history import History
from .persist_lane import PersistLane

__all__ = ["EventLog", "History", "PersistLane", "to_new_events"]
