"""Compaction service: turn-start and in-loop compaction"""
