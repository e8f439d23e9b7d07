# pyright: reportMissingTypeStubs=false, reportArgumentType=false
# (Django is untyped: its fields' defaults read as types.)
"""The Django model of the fenced-write tests (app ``tests.fencing``, label ``fencing``)."""

from __future__ import annotations

from django.db import models

from celery_dflock.fencing.django import fence_field


class Account(models.Model):
    """One account: its balance and, as every fenced model, ``dflock_fence``."""

    id = models.IntegerField(primary_key=True)
    balance = models.BigIntegerField(default=0)
    dflock_fence = fence_field()

    class Meta:
        app_label = "fencing"
