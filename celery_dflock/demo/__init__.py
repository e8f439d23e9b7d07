"""The demo behind ``celery-dflock demo``: real workers, a lock server, a timeline."""
