"""A dflockd-compatible distributed lock server (asyncio, standard library only)."""

from dflockd_server import constants
from dflockd_server.config import Config, ConfigError
from dflockd_server.net import Server

__version__ = constants.SERVER_VERSION
"""This release; ``celery-dflock`` of the same version depends on exactly this one."""

__all__ = ["Config", "ConfigError", "Server", "__version__", "constants"]
