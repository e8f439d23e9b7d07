"""Celery apps the worker subprocesses of tests/celery load (``-A apps.<module>``)."""
