"""Calls to other services over the app's own broker."""
