"""`celery-dflock` command (placeholder until the demo lands)."""


def main() -> None:
    raise SystemExit("not yet")
