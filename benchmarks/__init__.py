"""Side-by-side benchmarks of the lock server and the Celery integration (see README.md)."""
