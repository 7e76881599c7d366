"""Orchestration service: HTTP/SSE edge and the turn runner"""
