"""``dflockd``: run the lock server. Every setting is a flag and an environment variable;
the environment variable wins."""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.util
import ipaddress
import logging
import os
import resource  # Unix only, as fcntl (state.py), which the server needs too
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from dflockd_server import __version__, buildinfo, constants as c
from dflockd_server.config import Config, ConfigError, only_with
from dflockd_server.fence import FenceStateError, read_ceiling
from dflockd_server.loops import default_loop_factory, loop_name, uvloop_factory
from dflockd_server.metrics import MetricsError
from dflockd_server.net import Server
from dflockd_server.settings import BY_FIELD, SETTINGS, TOPICS, Setting, names
from dflockd_server.state import NO_STATE, resolve_state_dir
from dflockd_server.tls import build_ssl_context
from dflockd_server.values import check_readable_file, parse_bool

log = logging.getLogger("dflockd_server")

EXIT_USAGE = 2
EXIT_RUNTIME = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Each stops the server gracefully (dflockd reloads nothing on SIGHUP); a second, during the
drain, closes at once."""


class UsageError(Exception):
    """A setting cannot be used (the message names it)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see dflockd --help)")


def default_text(setting: Setting) -> str:
    """A setting's default as ``--help`` and the flags reference show it."""
    value = getattr(Config(), setting.field)
    if value is None:
        return setting.none_text
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _commands_text() -> str:
    lines = ["commands (dflockd COMMAND --cluster etcd://HOST:PORT[/PREFIX] ...):"]
    for name, (arguments, meaning) in c.CLUSTER_COMMAND_HELP.items():
        lines.append(f"  {f'{name} {arguments}'.rstrip():<36}{meaning}")
    lines.append("  (dflockd COMMAND --help: the command's own flags)")
    return "\n".join(lines) + "\n"


class _ShowAndExit(argparse.Action):
    """Print ``show()`` and exit (``--version``, ``--help-all``)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, show: Callable[[], str], help: str
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)
        self.show = show

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        sys.stdout.write(self.show())
        parser.exit()


def build_parser(*, every: bool = False) -> argparse.ArgumentParser:
    """The ``dflockd`` parser, by topic; ``--help`` shows the common settings, ``every`` all."""
    shown = "every setting, by topic" if every else "the common settings (--help-all: every one)"
    parser = _Parser(
        prog="dflockd",
        description=(
            "A dflockd-compatible distributed lock server. Every setting can be given as a\n"
            "flag or as an environment variable; the environment variable wins. Empty\n"
            f"environment variables count as unset. Below: {shown}.\n\n"
            f"{_commands_text()}"
        ),
        usage=(
            "dflockd [FLAG ...]                       serve locks (the flags below)\n"
            "       dflockd COMMAND --cluster URL [ARG ...]  operate a cluster (the commands below)"
        ),
        epilog=(
            f"The wire protocol:\n  {c.PROTOCOL_DOCS_URL}\n"
            f"Every flag and environment variable:\n  {c.FLAGS_DOCS_URL}\n"
            "Example: dflockd --port 7000"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action=_ShowAndExit,
        show=lambda: f"dflockd {__version__} ({buildinfo.describe(buildinfo.auto_loop_name())})\n",
        help="show the version, the build (compiled or pure Python) and the event loop that "
        "--event-loop auto runs, and exit",
    )
    parser.add_argument(
        "--help-all",
        action=_ShowAndExit,
        show=lambda: build_parser(every=True).format_help(),
        help="show every setting, by topic, and exit",
    )
    for title, fields in TOPICS:
        group = parser.add_argument_group(title)
        for field in fields:
            _add_setting(group, BY_FIELD[field], shown=every or BY_FIELD[field].common)
    return parser


def _add_setting(group: Any, setting: Setting, *, shown: bool) -> None:
    env = " (alias ".join(setting.env) + (")" if len(setting.env) > 1 else "")
    help_text = f"{setting.help} [env {env}; default {default_text(setting)}]"
    if setting.parse is parse_bool:
        how: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
    else:
        how = {"metavar": "SECONDS" if setting.field.endswith("_s") else setting.metavar}
    group.add_argument(
        setting.flag,
        dest=setting.field,
        default=None,
        help=help_text if shown else argparse.SUPPRESS,
        **how,
    )


def load_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Config:
    """Parse flags and environment into a ``Config``; ``UsageError`` names an unusable value
    (unreadable files included)."""
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    try:
        for setting in SETTINGS:
            raw_env = setting.in_environment(environ)
            flag_value = args.get(setting.field)
            if raw_env is not None:
                values[setting.field] = setting.take(raw_env[1], raw_env[0])
            elif isinstance(flag_value, bool):
                values[setting.field] = flag_value
            elif isinstance(flag_value, str):
                values[setting.field] = setting.take(flag_value, setting.flag)
        config = Config(**values)
        _check_given(values, config, environ)
        _check_files(config)
    except ValueError as exc:  # a value refused, ``ConfigError`` included
        raise UsageError(str(exc)) from None
    return config


def _check_given(given: Mapping[str, Any], config: Config, environ: Mapping[str, str]) -> None:
    """A setting given (flag or variable) where it has no effect is refused, naming what it
    needs (``Config`` cannot tell a default from a setting given)."""
    if "journal_fsync" in given and resolve_state_dir(config, environ) is None:
        why = "is none" if config.state_dir is not None else "is not given, and the port is 0"
        raise UsageError(
            f"{names('journal_fsync')} is only used with a state directory (its lease journal), "
            f"but {names('state_dir')} {why}: give --state-dir a directory, or drop "
            "--journal-fsync"
        )
    if "cluster_lease_ttl_s" in given and config.cluster is None:
        raise only_with("cluster_lease_ttl_s", names("cluster"))


def _check_files(config: Config) -> None:
    """Open what the server will need, so a bad path is a start-up error naming its setting
    (the secrets' ``ConfigError`` names it)."""
    config.resolve_auth_token()
    if config.state_dir is not None and (path := resolve_state_dir(config)) is not None:
        while not os.path.lexists(path):  # the nearest part of it that exists: a directory?
            path = os.path.dirname(path)
        if not os.path.isdir(path):
            raise UsageError(
                f"{names('state_dir')}={config.state_dir!r}: {path} is no directory: give a "
                "directory (it is made if missing), or none to keep no state"
            )
    for field in ("tls_cert", "tls_key", "fence_state_file"):  # (no fence file yet: made now)
        path = getattr(config, field)
        given = path and (field != "fence_state_file" or os.path.exists(path))
        if given and (problem := check_readable_file(path)) is not None:
            raise UsageError(f"{names(field)}={path!r}: {problem}")
    if config.tls_cert and config.tls_key:
        try:
            build_ssl_context(config.tls_cert, config.tls_key)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise UsageError(
                f"{names('tls_cert')}={config.tls_cert!r} / {names('tls_key')}="
                f"{config.tls_key!r}: cannot load certificate and key: {exc}"
            ) from None
    config.resolve_cluster_password()
    if config.fence_state_file:
        try:
            read_ceiling(config.fence_state_file)
        except FenceStateError as exc:
            raise UsageError(f"{names('fence_state_file')}: {exc}") from None
        directory = os.path.dirname(os.path.abspath(config.fence_state_file))
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise UsageError(
                f"{names('fence_state_file')}={config.fence_state_file!r}: {directory} is no "
                "directory this user can write, so no fence ceiling could be stored there: "
                "give a path in one"
            )
    if config.metrics_port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise UsageError(
            f"{names('metrics_port')} needs prometheus_client, which is not installed: "
            "pip install 'dflockd-server[metrics]' (or unset it)"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loop_factory(event_loop: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if event_loop == "asyncio":
        return asyncio.new_event_loop
    factory = default_loop_factory() if event_loop == "auto" else uvloop_factory()
    if factory is None:
        raise UsageError(
            f"{names('event_loop')}=uvloop, but uvloop is not installed: pip install "
            "uvloop (a dependency of dflockd-server where it exists), or use auto or asyncio"
        )
    return factory


def make_room_for_connections(max_connections: int) -> str | None:
    """Raise the soft open-file limit to what ``max_connections`` needs (as far as the hard
    limit allows); a warning when it falls short."""
    if not max_connections:
        return None
    needed = max_connections + c.FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
    if target >= needed:
        return None
    return (
        f"the open-file limit ({target}) is below what {names('max_connections')}="
        f"{max_connections} needs ({needed}): connections past it fail to be accepted. Raise "
        "the limit (ulimit -n, or the container's nofile limit) or lower max_connections"
    )


def _start_up_warnings(
    config: Config, environ: Mapping[str, str], argv: Sequence[str]
) -> Iterator[str]:
    # (even where DFLOCKD_AUTH_TOKEN wins over it: the flag's secret is still on show)
    if any(arg == "--auth-token" or arg.startswith("--auth-token=") for arg in argv):
        yield (
            "the auth token was given with --auth-token, so every local user can read it in "
            "the process list: use --auth-token-file or DFLOCKD_AUTH_TOKEN instead"
        )
    yield from _overridden(argv, environ)
    state = config.fence_state_file
    if state is None and resolve_state_dir(config, environ) is None and config.port != 0:
        yield (
            "no state directory (--state-dir none): a restart forgets every lock (the next "
            "start grants nothing for max_lease_ttl_s, so that no key is granted twice) and "
            "fencing tokens start from the wall clock, so a clock set back between two runs "
            "hands out smaller fences than before; give --state-dir a directory on a "
            "persistent volume"
        )
    elif state is not None and config.cluster:
        yield (
            f"{names('fence_state_file')} with {names('cluster')}: a cluster member keeps its "
            f"fence ceiling in etcd and never writes {state!r}; give --state-dir instead (the "
            "directory that keeps what a member must outlive)"
        )
    elif state is not None and not os.path.exists(state):
        yield (
            f"fence state file {state!r} does not exist yet; it is created now. If this server "
            "ran before with another file (or a lost volume), fences may be smaller than those "
            "it handed out then"
        )
    if (room := make_room_for_connections(config.max_connections)) is not None:
        yield room  # after raising the open-file limit as far as it goes


def _overridden(argv: Sequence[str], environ: Mapping[str, str]) -> Iterator[str]:
    """A flag given another value by its environment variable, which wins (the image sets
    ``DFLOCKD_HOST``, ``DFLOCKD_PORT`` and ``DFLOCKD_STATE_DIR``)."""
    args = vars(build_parser().parse_args(argv))
    for setting in SETTINGS:
        given, raw_env = args.get(setting.field), setting.in_environment(environ)
        if given is None or raw_env is None:
            continue
        name, text = raw_env
        if isinstance(given, bool):  # a switch (--auto-release-on-disconnect, its --no- form)
            flag = setting.flag if given else setting.flag.replace("--", "--no-", 1)
            differs = given != setting.take(text, name)
        else:
            flag = f"{setting.flag} {given!r}"
            try:
                differs = setting.take(given, setting.flag) != setting.take(text, name)
            except ValueError:  # the flag's value is refused: unused all the same
                differs = True
        if differs:
            yield (
                f"{flag} is not used: the environment variable "
                f"{name}={text!r} wins over the flag; unset it, or give the value there"
            )


async def serve(config: Config, environ: Mapping[str, str], argv: Sequence[str]) -> None:
    """Run until SIGTERM, SIGINT or SIGHUP, then shut down gracefully (a second one ends the
    drain at once)."""
    warnings = list(_start_up_warnings(config, environ, argv))  # before the state file is written
    server = Server(config)
    await server.start()
    host, port = server.sockname
    shown = config.effective_settings()
    shown["state_dir"] = server.state.path if server.state is not None else NO_STATE
    log.info(
        "dflockd listening on %s:%d (tls %s, auth %s, loop %s, build %s); settings: %s",
        host,
        port,
        "on" if config.tls_cert else "off",
        "on" if server.secret is not None else "off",
        loop_name(asyncio.get_running_loop()),
        buildinfo.BUILD,
        " ".join(f"{k}={v}" for k, v in shown.items()),
    )
    if server.metrics_address is not None:
        log.info("metrics on http://%s:%d/metrics", *server.metrics_address)
    if environ.get("KUBERNETES_SERVICE_HOST") and is_loopback(config.host):
        log.warning(
            "running in a Kubernetes pod and bound to %s: only this pod can reach this lock "
            "server. Locks exclude nothing between pods that use different lock servers: run "
            "one dflockd behind a Service for every worker and beat (deploy/kubernetes/)",
            config.host,
        )
    for warning in warnings:
        log.warning("%s", warning)
    if server.secret is None and not is_loopback(config.host):
        log.warning(
            "bound to non-loopback address %s without auth: anyone who can reach port %d can "
            "take and release locks (set --auth-token-file or DFLOCKD_AUTH_TOKEN_FILE)",
            config.host,
            port,
        )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.ensure_future(server.serve_forever())
    waiting = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        if server.journal is not None and server.node is None:
            log.info(
                "signal received: stopping; the lease journal keeps every lease held for the "
                "next start (their holders reconnect to it)"
            )
        else:
            log.info(
                "signal received: draining (up to %.0f s for holders to release)",
                config.shutdown_timeout_s,
            )
    waiting.cancel()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, _cut_drain, server)
    await server.stop()
    await serving
    log.info("dflockd stopped")


def _cut_drain(server: Server) -> None:
    log.warning(
        "second signal received: closing every connection now, without waiting for releases"
    )
    server.cut_drain()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> None:
    """``dflockd [flags]`` serves; ``dflockd COMMAND --cluster URL ...`` operates a cluster."""
    env = os.environ if environ is None else environ
    words = sys.argv[1:] if argv is None else list(argv)
    if words and words[0] in c.CLUSTER_COMMAND_HELP:
        # Imported here: a serving dflockd does not load the etcd client (http.client).
        from dflockd_server.cluster.ops import cluster_command

        raise SystemExit(cluster_command(words))
    try:
        config = load_config(argv, env)
        loop_factory = _loop_factory(config.event_loop)
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config, env, words))
    except (FenceStateError, MetricsError, ConfigError) as exc:
        _fail(str(exc), EXIT_RUNTIME)
    except OSError as exc:
        _fail(cannot_serve(config.host, config.port, exc), EXIT_RUNTIME)
    except KeyboardInterrupt:
        pass


def cannot_serve(host: str, port: int, exc: OSError) -> str:
    """The error of a server that cannot listen on ``host:port``, naming the setting to change
    where the error tells which (an address in use: the port; no such address: the host)."""
    where = f"cannot serve on {host}:{port}: {exc}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: another process listens there: choose another {names('port')}"
    if exc.errno == errno.EACCES and 0 < port < 1024:
        return f"{where}: a port below 1024 needs privileges: choose another {names('port')}"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        hint = (
            " (write an IPv6 address without brackets: --host ::1)"
            if host.startswith("[") and host.endswith("]")
            else ""
        )
        return f"{where}: {names('host')} is no address of this machine{hint}: give one of them"
    return where


def _fail(message: str, code: int) -> NoReturn:
    """Print ``message`` as dflockd's error and exit with ``code``."""
    print(f"dflockd: error: {message}", file=sys.stderr)
    raise SystemExit(code) from None


__all__ = ["UsageError", "build_parser", "load_config", "main"]
