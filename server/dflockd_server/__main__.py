"""``python -m dflockd_server``: the same as the ``dflockd`` command."""

from dflockd_server.cli import main

if __name__ == "__main__":
    main()
