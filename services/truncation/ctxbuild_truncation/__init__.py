"""Truncation service: the in-flight lane"""
