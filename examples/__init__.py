"""Runnable examples for celery-dflock (``examples.proj`` is the compose file's project)."""
