"""`celery_dflock.fencing` costs nothing until a store's module is used: ``import
celery_dflock`` and ``import celery_dflock.fencing`` load no store client (a project that
writes to Redis alone never imports SQLAlchemy or Django)."""

from __future__ import annotations

import json
import subprocess
import sys

STORE_CLIENTS = ("sqlalchemy", "django", "redis", "psycopg")


def loaded_after(statement: str) -> list[str]:
    code = (
        f"import json, sys\n{statement}\n"
        "tops = {m.split('.')[0] for m in sys.modules}\n"
        f"print(json.dumps(sorted(tops & set({STORE_CLIENTS!r}))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_importing_the_plugin_and_the_fencing_package_loads_no_store_client() -> None:
    assert loaded_after("import celery_dflock, celery_dflock.fencing") == []
    assert loaded_after("from celery_dflock.fencing import StaleFence, FenceMissing") == []


def test_each_stores_module_loads_its_own_client_only() -> None:
    assert loaded_after("import celery_dflock.fencing.redis") == ["redis"]
    assert loaded_after("import celery_dflock.fencing.sqlalchemy") == ["sqlalchemy"]
    assert loaded_after("import celery_dflock.fencing.redis_aio") == ["redis"]
    assert loaded_after("import celery_dflock.fencing.sqlalchemy_aio") == ["sqlalchemy"]
    assert "sqlalchemy" not in loaded_after("import celery_dflock.fencing.django")
