"""LLM provider adapters (replay for offline runs; real SDK adapters later)"""
