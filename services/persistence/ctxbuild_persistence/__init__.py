"""Persistence service: event store, outbox relay, projections, history"""
