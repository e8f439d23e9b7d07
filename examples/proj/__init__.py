"""The example project: ``celery -A examples.proj worker`` / ``beat``."""

from examples.proj.app import app

__all__ = ["app"]
