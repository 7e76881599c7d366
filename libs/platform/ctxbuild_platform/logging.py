"""structlog JSON logs carrying the current trace and span ids."""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace


def _add_trace_ids(_logger, _name, event_dict):
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
        event_dict["span_id"] = format(ctx.span_id, "016x")
    return event_dict


CHATTY_HTTP_LOGGERS = ("httpx", "httpx2")  # httpx2: the OpenAI SDK's HTTP client


def configure_logging(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_ids,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (PrintLogger's print() writes the line and its newline apart on unbuffered stderr)
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # stdlib loggers (faststream, uvicorn) go through the same JSON renderer
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.JSONRenderer()],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    # the HTTP clients' line per request ("HTTP Request: POST …") repeats what the turn's events and spans hold
    for chatty in CHATTY_HTTP_LOGGERS:
        logging.getLogger(chatty).setLevel(lvl if lvl <= logging.DEBUG else max(lvl, logging.WARNING))
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger(service)
