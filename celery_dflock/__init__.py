"""celery-dflock: distributed locks for Celery."""
