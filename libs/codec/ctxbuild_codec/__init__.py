"""Shared codec library: trim primitive, markers, codecs, policies, envelopes, tokens"""
