"""A dflockd-compatible distributed lock server (asyncio, standard library only)."""

from dflockd_server import constants
from dflockd_server.config import Config, ConfigError
from dflockd_server.net import Server

__all__ = ["Config", "ConfigError", "Server", "constants"]
