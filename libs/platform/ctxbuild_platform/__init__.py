"""Shared platform code: settings, broker, telemetry, logging, typed errors, contract validation, service runner."""
