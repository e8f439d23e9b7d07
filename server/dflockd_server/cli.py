"""Command line entry point (placeholder until the server lands)."""


def main() -> None:
    raise SystemExit("not yet")
