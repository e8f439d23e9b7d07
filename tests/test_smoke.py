"""The packages import (replaced by real suites as they land)."""

import celery_dflock
import dflockd_server


def test_packages_import() -> None:
    assert celery_dflock.__doc__
    assert dflockd_server.__doc__
