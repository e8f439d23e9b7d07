"""Settings: every flag and environment variable of PROTOCOL.md's table, the environment
winning over the flag, and bad values failing start-up with a message that names them."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import Config, buildinfo, constants
from dflockd_server.cli import UsageError, load_config
from dflockd_server.settings import SETTINGS
from tests.support.servers import DflockdProcess, clean_env, dflockd_executable, run_dflockd
from tests.support.wire import Wire

# PROTOCOL.md's table: flag, environment variable(s), default.
TABLE: list[tuple[str, tuple[str, ...], str, Any]] = [
    ("--host", ("DFLOCKD_HOST",), "host", "0.0.0.0"),
    ("--port", ("DFLOCKD_PORT",), "port", 6388),
    ("--default-lease-ttl", ("DFLOCKD_DEFAULT_LEASE_TTL_S",), "default_lease_ttl_s", 33),
    ("--max-lease-ttl", ("DFLOCKD_MAX_LEASE_TTL_S",), "max_lease_ttl_s", 300),
    ("--restart-grace", ("DFLOCKD_RESTART_GRACE_S",), "restart_grace_s", None),
    ("--lease-sweep-interval", ("DFLOCKD_LEASE_SWEEP_INTERVAL_S",), "lease_sweep_interval_s", 1),
    ("--gc-interval", ("DFLOCKD_GC_LOOP_SLEEP", "DFLOCKD_GC_INTERVAL_S"), "gc_interval_s", 5),
    (
        "--gc-max-idle",
        ("DFLOCKD_GC_MAX_UNUSED_TIME", "DFLOCKD_GC_MAX_IDLE_S"),
        "gc_max_idle_s",
        60,
    ),
    ("--max-locks", ("DFLOCKD_MAX_LOCKS",), "max_locks", 1024),
    ("--read-timeout", ("DFLOCKD_READ_TIMEOUT_S",), "read_timeout_s", 23),
    (
        "--auto-release-on-disconnect",
        ("DFLOCKD_AUTO_RELEASE_ON_DISCONNECT",),
        "auto_release_on_disconnect",
        True,
    ),
    ("--session-ttl", ("DFLOCKD_SESSION_TTL_S",), "session_ttl_s", 3),
    ("--max-connections", ("DFLOCKD_MAX_CONNECTIONS",), "max_connections", 4096),
    ("--max-connections-per-ip", ("DFLOCKD_MAX_CONNECTIONS_PER_IP",), "max_connections_per_ip", 0),
    ("--max-waiters", ("DFLOCKD_MAX_WAITERS",), "max_waiters", 0),
    (
        "--max-locks-per-connection",
        ("DFLOCKD_MAX_LOCKS_PER_CONNECTION",),
        "max_locks_per_connection",
        64,
    ),
    ("--max-locks-per-ip", ("DFLOCKD_MAX_LOCKS_PER_IP",), "max_locks_per_ip", None),
    (
        "--max-waits-per-connection",
        ("DFLOCKD_MAX_WAITS_PER_CONNECTION",),
        "max_waits_per_connection",
        64,
    ),
    ("--write-timeout", ("DFLOCKD_WRITE_TIMEOUT_S",), "write_timeout_s", 5),
    ("--shutdown-timeout", ("DFLOCKD_SHUTDOWN_TIMEOUT_S",), "shutdown_timeout_s", 30),
    ("--auth-token", ("DFLOCKD_AUTH_TOKEN",), "auth_token", None),
    ("--auth-token-file", ("DFLOCKD_AUTH_TOKEN_FILE",), "auth_token_file", None),
    ("--tls-cert", ("DFLOCKD_TLS_CERT",), "tls_cert", None),
    ("--tls-key", ("DFLOCKD_TLS_KEY",), "tls_key", None),
    # Not in PROTOCOL.md's table: the TLS handshake's deadline and cap (bounded memory).
    (
        "--tls-handshake-timeout",
        ("DFLOCKD_TLS_HANDSHAKE_TIMEOUT_S",),
        "tls_handshake_timeout_s",
        10,
    ),
    ("--max-tls-handshakes", ("DFLOCKD_MAX_TLS_HANDSHAKES",), "max_tls_handshakes", 512),
    # Not in PROTOCOL.md's table: how often the certificate files are looked at.
    ("--tls-reload-interval", ("DFLOCKD_TLS_RELOAD_INTERVAL_S",), "tls_reload_interval_s", 10),
    ("--fence-state-file", ("DFLOCKD_FENCE_STATE_FILE",), "fence_state_file", None),
    # Not in PROTOCOL.md's table: durable leases (issue 26), the state dir and its fsync.
    ("--state-dir", ("DFLOCKD_STATE_DIR",), "state_dir", None),
    ("--journal-fsync", ("DFLOCKD_JOURNAL_FSYNC",), "journal_fsync", "everysec"),
    ("--log-level", ("DFLOCKD_LOG_LEVEL",), "log_level", "info"),
    # Not in PROTOCOL.md's table: which event loop runs the server.
    ("--event-loop", ("DFLOCKD_EVENT_LOOP",), "event_loop", "auto"),
    # Not in PROTOCOL.md's table: the optional Prometheus endpoint (the `metrics` extra).
    ("--metrics-port", ("DFLOCKD_METRICS_PORT",), "metrics_port", None),
    ("--metrics-host", ("DFLOCKD_METRICS_HOST",), "metrics_host", None),
    # Not in PROTOCOL.md's table: static members and cluster mode (issue 16).
    ("--members", ("DFLOCKD_MEMBERS",), "members", None),
    ("--advertise", ("DFLOCKD_ADVERTISE",), "advertise", None),
    ("--cluster", ("DFLOCKD_CLUSTER",), "cluster", None),
    ("--cluster-lease-ttl", ("DFLOCKD_CLUSTER_LEASE_TTL_S",), "cluster_lease_ttl_s", 5),
    # Not in PROTOCOL.md's table: TLS and authentication to the cluster's etcd (issue 27).
    ("--cluster-ca-file", ("DFLOCKD_CLUSTER_CA_FILE",), "cluster_ca_file", None),
    ("--cluster-cert", ("DFLOCKD_CLUSTER_CERT",), "cluster_cert", None),
    ("--cluster-key", ("DFLOCKD_CLUSTER_KEY",), "cluster_key", None),
    ("--cluster-user", ("DFLOCKD_CLUSTER_USER",), "cluster_user", None),
    ("--cluster-password", ("DFLOCKD_CLUSTER_PASSWORD",), "cluster_password", None),
    ("--cluster-password-file", ("DFLOCKD_CLUSTER_PASSWORD_FILE",), "cluster_password_file", None),
]


def test_settings_table_matches_protocol_md() -> None:
    assert [(s.flag, s.env, s.field) for s in SETTINGS] == [row[:3] for row in TABLE]
    defaults = Config()
    for _, _, field, default in TABLE:
        assert getattr(defaults, field) == default, field
    assert load_config([], {}) == Config()
    assert (defaults.host, defaults.port) == (constants.DEFAULT_HOST, constants.DEFAULT_PORT)


# field, flag value, env value, expected from flag, expected from env
FAMILIES = [
    pytest.param("host", "127.0.0.1", "::1", "127.0.0.1", "::1", id="bind"),
    pytest.param("port", "7000", "7001", 7000, 7001, id="port"),
    pytest.param("default_lease_ttl_s", "10", "20", 10, 20, id="lease"),
    pytest.param("lease_sweep_interval_s", "0.5", "2", 0.5, 2.0, id="sweep"),
    pytest.param("gc_interval_s", "3", "4", 3.0, 4.0, id="gc-interval"),
    pytest.param("gc_max_idle_s", "30", "40", 30.0, 40.0, id="gc-max-idle"),
    pytest.param("max_locks", "10", "20", 10, 20, id="max-locks"),
    pytest.param("read_timeout_s", "5", "6", 5.0, 6.0, id="read-timeout"),
    pytest.param("max_connections", "5", "6", 5, 6, id="max-connections"),
    pytest.param("max_connections_per_ip", "2", "3", 2, 3, id="max-connections-per-ip"),
    pytest.param("max_waiters", "7", "8", 7, 8, id="max-waiters"),
    pytest.param("max_locks_per_connection", "0", "9", 0, 9, id="max-locks-per-connection"),
    pytest.param("max_waits_per_connection", "3", "0", 3, 0, id="max-waits-per-connection"),
    pytest.param("max_locks_per_ip", "auto", "100", None, 100, id="max-locks-per-ip"),
    pytest.param("write_timeout_s", "1.5", "2.5", 1.5, 2.5, id="write-timeout"),
    pytest.param("shutdown_timeout_s", "1", "0", 1.0, 0.0, id="shutdown-timeout"),
    pytest.param("auth_token", "flag-secret", "env-secret", "flag-secret", "env-secret", id="auth"),
    pytest.param("log_level", "debug", "WARNING", "debug", "warning", id="log-level"),
    pytest.param("event_loop", "asyncio", "UVLOOP", "asyncio", "uvloop", id="event-loop"),
    pytest.param("tls_handshake_timeout_s", "2", "3.5", 2.0, 3.5, id="tls-handshake-timeout"),
    pytest.param("max_tls_handshakes", "64", "0", 64, 0, id="max-tls-handshakes"),
    pytest.param("tls_reload_interval_s", "0.5", "60", 0.5, 60.0, id="tls-reload-interval"),
    pytest.param("metrics_port", "9388", "0", 9388, 0, id="metrics-port"),
    pytest.param("metrics_host", "127.0.0.1", "::1", "127.0.0.1", "::1", id="metrics-host"),
]


def _row(field: str) -> tuple[str, tuple[str, ...]]:
    for flag, env, name, _ in TABLE:
        if name == field:
            return flag, env
    raise AssertionError(field)


@pytest.mark.parametrize(("field", "flag_raw", "env_raw", "from_flag", "from_env"), FAMILIES)
def test_flag_env_and_env_wins(
    field: str, flag_raw: str, env_raw: str, from_flag: object, from_env: object
) -> None:
    flag, envs = _row(field)
    base = {"DFLOCKD_METRICS_PORT": "0"} if field == "metrics_host" else {}  # needs it
    for env in envs:  # every variable name (and alias) works
        assert getattr(load_config([], {**base, env: env_raw}), field) == from_env
    assert getattr(load_config([flag, flag_raw], base), field) == from_flag
    assert getattr(load_config([flag, flag_raw], {**base, envs[0]: env_raw}), field) == from_env
    assert getattr(load_config([flag, flag_raw], {**base, envs[0]: ""}), field) == from_flag


def test_gc_variable_and_alias_agree_or_are_refused() -> None:
    """Both set: taken when they agree, refused naming both when not (the first won)."""
    env = {"DFLOCKD_GC_LOOP_SLEEP": "2", "DFLOCKD_GC_INTERVAL_S": "2"}
    assert load_config([], env).gc_interval_s == 2.0
    env["DFLOCKD_GC_INTERVAL_S"] = "9"
    with pytest.raises(UsageError, match="DFLOCKD_GC_LOOP_SLEEP='2' and DFLOCKD_GC_INTERVAL_S"):
        load_config([], env)


@pytest.mark.parametrize(
    ("word", "expected"),
    [(w, True) for w in ("1", "yes", "true", "TRUE")]
    + [(w, False) for w in ("0", "no", "false", "No")],
)
def test_auto_release_words(word: str, expected: bool) -> None:
    env = "DFLOCKD_AUTO_RELEASE_ON_DISCONNECT"
    assert load_config([], {env: word}).auto_release_on_disconnect is expected


def test_auto_release_flag_and_env_wins() -> None:
    env = "DFLOCKD_AUTO_RELEASE_ON_DISCONNECT"
    assert load_config(["--no-auto-release-on-disconnect"], {}).auto_release_on_disconnect is False
    assert load_config(["--auto-release-on-disconnect"], {}).auto_release_on_disconnect is True
    config = load_config(["--no-auto-release-on-disconnect"], {env: "yes"})
    assert config.auto_release_on_disconnect is True


def test_file_settings_flag_env_and_env_wins(tmp_path: Path, tls_files: tuple[Path, Path]) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_text("secret-one\n")
    two.write_text("secret-two\n")
    config = load_config(["--auth-token-file", str(one)], {"DFLOCKD_AUTH_TOKEN_FILE": str(two)})
    assert config.auth_token_file == str(two)
    assert config.resolve_auth_token() == "secret-two"
    assert load_config(["--auth-token-file", str(one)], {}).resolve_auth_token() == "secret-one"

    fence_a, fence_b = str(tmp_path / "a.fence"), str(tmp_path / "b.fence")
    assert load_config(["--fence-state-file", fence_a], {}).fence_state_file == fence_a
    config = load_config(["--fence-state-file", fence_a], {"DFLOCKD_FENCE_STATE_FILE": fence_b})
    assert config.fence_state_file == fence_b

    cert, key = tls_files
    config = load_config(["--tls-cert", str(cert), "--tls-key", str(key)], {})
    assert (config.tls_cert, config.tls_key) == (str(cert), str(key))
    config = load_config(
        ["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"],
        {"DFLOCKD_TLS_CERT": str(cert), "DFLOCKD_TLS_KEY": str(key)},
    )
    assert (config.tls_cert, config.tls_key) == (str(cert), str(key))


BAD = [
    ("DFLOCKD_PORT", "--port", "http"),
    ("DFLOCKD_PORT", "--port", "70000"),
    ("DFLOCKD_DEFAULT_LEASE_TTL_S", "--default-lease-ttl", "0"),
    ("DFLOCKD_DEFAULT_LEASE_TTL_S", "--default-lease-ttl", "2.5"),
    ("DFLOCKD_LEASE_SWEEP_INTERVAL_S", "--lease-sweep-interval", "0"),
    ("DFLOCKD_GC_LOOP_SLEEP", "--gc-interval", "soon"),
    ("DFLOCKD_GC_INTERVAL_S", "--gc-interval", "-1"),
    ("DFLOCKD_GC_MAX_UNUSED_TIME", "--gc-max-idle", "nan"),
    ("DFLOCKD_MAX_LOCKS", "--max-locks", "-1"),
    ("DFLOCKD_READ_TIMEOUT_S", "--read-timeout", "-5"),
    ("DFLOCKD_AUTO_RELEASE_ON_DISCONNECT", None, "maybe"),
    ("DFLOCKD_MAX_CONNECTIONS", "--max-connections", "lots"),
    ("DFLOCKD_MAX_CONNECTIONS_PER_IP", "--max-connections-per-ip", "-2"),
    ("DFLOCKD_MAX_WAITERS", "--max-waiters", "1e3"),
    ("DFLOCKD_WRITE_TIMEOUT_S", "--write-timeout", "0"),
    ("DFLOCKD_SHUTDOWN_TIMEOUT_S", "--shutdown-timeout", "inf"),
    ("DFLOCKD_AUTH_TOKEN_FILE", "--auth-token-file", "/nonexistent/secret"),
    ("DFLOCKD_LOG_LEVEL", "--log-level", "loud"),
    ("DFLOCKD_EVENT_LOOP", "--event-loop", "trio"),
    ("DFLOCKD_TLS_HANDSHAKE_TIMEOUT_S", "--tls-handshake-timeout", "0"),
    ("DFLOCKD_MAX_TLS_HANDSHAKES", "--max-tls-handshakes", "-1"),
    ("DFLOCKD_METRICS_PORT", "--metrics-port", "99999"),
    ("DFLOCKD_JOURNAL_FSYNC", "--journal-fsync", "sometimes"),
    # A number of seconds far past any lease was taken as given (a 300-digit wait in the log),
    # and an interval of a nanosecond as a timer that burns a core:
    ("DFLOCKD_SHUTDOWN_TIMEOUT_S", "--shutdown-timeout", "1e300"),
    ("DFLOCKD_READ_TIMEOUT_S", "--read-timeout", "1e300"),
    ("DFLOCKD_LEASE_SWEEP_INTERVAL_S", "--lease-sweep-interval", "1e-9"),
    ("DFLOCKD_GC_INTERVAL_S", "--gc-interval", "0.0001"),
    ("DFLOCKD_GC_MAX_IDLE_S", "--gc-max-idle", "1e10"),
]


@pytest.mark.parametrize(("env", "flag", "raw"), BAD)
def test_bad_value_is_a_start_up_error_naming_it(env: str, flag: str | None, raw: str) -> None:
    with pytest.raises(UsageError, match=re.escape(env)):
        load_config([], {env: raw})
    if flag is not None:
        with pytest.raises(UsageError, match=re.escape(flag)):
            load_config([flag, raw], {})


def test_bad_tls_and_fence_files_name_their_setting(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(UsageError, match="--tls-cert"):
        load_config(["--tls-cert", str(garbage), "--tls-key", str(garbage)], {})
    with pytest.raises(UsageError, match="must be given together"):
        load_config([], {"DFLOCKD_TLS_CERT": str(garbage)})
    fence = tmp_path / "fence"
    fence.write_text("twelve")
    with pytest.raises(UsageError, match="DFLOCKD_FENCE_STATE_FILE"):
        load_config([], {"DFLOCKD_FENCE_STATE_FILE": str(fence)})
    with pytest.raises(UsageError, match="not both"):
        load_config(["--auth-token", "a", "--auth-token-file", str(fence)], {})


def test_unknown_flag_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--frobnicate"):
        load_config(["--frobnicate"], {})


def test_config_dataclass_validates_too() -> None:
    with pytest.raises(ValueError, match="max_locks"):
        Config(max_locks=0)
    config = dataclasses.replace(Config(), auth_token="hunter2")
    assert config.effective_settings()["auth_token"] == "***"


# ------------------------------------------------------------------ the real entry point
def test_dflockd_bad_flag_exits_2_with_one_line() -> None:
    result = run_dflockd(["--port", "http"], {})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["dflockd: error: --port='http': not an integer"]


def test_dflockd_bad_env_exits_2_naming_the_variable() -> None:
    result = run_dflockd(["--max-locks", "10"], {"DFLOCKD_MAX_LOCKS": "-1"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "DFLOCKD_MAX_LOCKS" in lines[0]
    assert "Traceback" not in result.stderr


def test_dflockd_help_all_documents_every_setting() -> None:
    result = run_dflockd(["--help-all"], {})
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # undo argparse's line wrapping
    for flag, envs, _, _ in TABLE:
        assert flag in text
        for env in envs:
            assert env in text
    assert "--no-auto-release-on-disconnect" in text
    assert "default 6388" in text


def test_dflockd_help_lists_its_commands() -> None:
    """``dflockd --help`` names the cluster commands with what each does (issue 29: it listed
    40 flags and no command); each command's own ``--help`` works."""
    from dflockd_server.constants import CLUSTER_COMMAND_HELP

    result = run_dflockd(["--help"], {})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert "dflockd COMMAND --cluster URL" in result.stdout
    for command in ("rebalance", "pin", "unpin", "shards"):
        meaning = CLUSTER_COMMAND_HELP[command][1]
        assert any(
            line.strip().startswith(command) and line.rstrip().endswith(meaning) for line in lines
        ), command
        own = run_dflockd([command, "--help"], {})
        assert own.returncode == 0
        assert "--cluster" in own.stdout


def test_dflockd_env_wins_at_start_up_and_masks_the_secret(dflockd_process: Any) -> None:
    # The flag's host is an address this machine does not have: if it won, binding would fail.
    proc: DflockdProcess = dflockd_process(
        "--host",
        "203.0.113.7",
        "--port",
        "1",
        "--auth-token",
        "flag-secret",
        env={"DFLOCKD_HOST": "127.0.0.1", "DFLOCKD_PORT": "0", "DFLOCKD_AUTH_TOKEN": "env-pw"},
    )
    host, port = proc.wait_listening()
    assert host == "127.0.0.1"
    assert port not in (0, 1)
    log = "\n".join(proc.lines)
    assert "auth_token=***" in log
    assert "env-pw" not in log and "flag-secret" not in log
    with Wire((host, port)) as w:
        assert w.req("auth", "_", "env-pw") == "ok"


def test_dflockd_warns_on_public_bind_without_auth(dflockd_process: Any) -> None:
    proc: DflockdProcess = dflockd_process("--host", "0.0.0.0", "--port", "0")
    proc.wait_listening()
    warning = proc.wait_for("without auth")  # among other start-up warnings (fence state)
    assert "WARNING" in warning
    # It points at the file, as the warning about --auth-token does: not at the flag that
    # shows the secret in the process list.
    assert "--auth-token-file" in warning
    assert "or --auth-token)" not in warning


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_dflockd_runs_on_the_event_loop_it_is_told(dflockd_process: Any, loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is optional and not installed here")
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--event-loop", loop
    )
    host, port = proc.wait_listening()
    assert f"loop {loop}, build {buildinfo.BUILD})" in "\n".join(proc.lines)
    with Wire((host, port)) as w:
        assert w.req("ping") == "ok"
        # hello and stats say which build and loop run (issue 52)
        hello = json.loads(w.req("hello").removeprefix("ok "))
        assert (hello["build"], hello["loop"]) == (buildinfo.BUILD, loop)
        stats = json.loads(w.req("stats").removeprefix("ok "))
        assert (stats["build"], stats["loop"]) == (buildinfo.BUILD, loop)


def test_the_start_up_line_names_the_state_dir_in_use(dflockd_process: Any, tmp_path: Path) -> None:
    """It printed ``state_dir=None`` while the server used its address's default directory
    (issue 50); it names the directory in use, or ``none``."""
    from tests.support.ports import free_port

    port = free_port()
    env = {"XDG_STATE_HOME": str(tmp_path)}
    proc: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", str(port), env=env)
    proc.wait_listening()
    line = next(line for line in proc.lines if "listening on" in line)
    assert f" state_dir={tmp_path / 'dflockd' / f'127.0.0.1-{port}'} " in line
    assert (tmp_path / "dflockd" / f"127.0.0.1-{port}" / "journal").exists()
    none: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", "0", env=env)
    none.wait_listening()
    assert " state_dir=none " in next(line for line in none.lines if "listening on" in line)


def test_a_second_dflockd_on_one_port_names_the_port(dflockd_process: Any, tmp_path: Path) -> None:
    """Two servers on one address share its default state directory, which the second finds
    locked before it binds: the error pointed at --state-dir (issue 50); it names the port."""
    from tests.support.ports import free_port

    port = free_port()
    env = {"XDG_STATE_HOME": str(tmp_path)}
    first: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", str(port), env=env)
    first.wait_listening()
    second: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", str(port), env=env)
    assert second.wait_exit() != 0
    said = "\n".join(second.lines)
    assert f"another dflockd (pid {first.proc.pid}) already runs on 127.0.0.1:{port}" in said
    assert "another --port" in said
    assert "give this one its own --state-dir" not in said


COMMON = {setting.field for setting in SETTINGS if setting.common}


def test_every_setting_has_one_topic() -> None:
    from dflockd_server.settings import TOPICS

    placed = [field for _, fields in TOPICS for field in fields]
    assert sorted(placed) == sorted(setting.field for setting in SETTINGS)
    assert set(placed) >= COMMON


def test_dflockd_help_is_short_and_grouped_and_help_all_shows_every_flag_by_topic() -> None:
    """``dflockd --help`` was 185 lines of every flag in one list (issue 50): it shows the
    common settings by topic and points at ``--help-all``, which shows every one by topic."""
    from dflockd_server.settings import TOPICS

    short = run_dflockd(["--help"], {})
    full = run_dflockd(["--help-all"], {})
    assert short.returncode == full.returncode == 0
    assert "--help-all" in short.stdout
    assert len(short.stdout.splitlines()) * 2 < len(full.stdout.splitlines())
    by_field = {setting.field: setting.flag for setting in SETTINGS}
    shown = set(re.findall(r"^  (--[a-z-]+)", short.stdout, re.M))
    assert {by_field[field] for field in COMMON} <= shown
    assert "--max-tls-handshakes" not in shown
    for help_text, fields in ((full.stdout, [f for _, fs in TOPICS for f in fs]),):
        lines = help_text.splitlines()
        for title, topic_fields in TOPICS:
            start = lines.index(f"{title}:")
            end = next((i for i in range(start + 1, len(lines)) if lines[i].endswith(":")
                        and not lines[i].startswith(" ")), len(lines))  # fmt: skip
            section = "\n".join(lines[start:end])
            for field in topic_fields:
                assert re.search(rf"^  {re.escape(by_field[field])}\b", section, re.M), field
        assert len(fields) == len(SETTINGS)
    # Both parse every flag: the short help only hides them.
    assert load_config(["--max-tls-handshakes", "7"], {}).max_tls_handshakes == 7


@pytest.mark.parametrize(
    "argv, environ", [(["--restart-grace", "auto"], {}), ([], {"DFLOCKD_RESTART_GRACE_S": "auto"})]
)
def test_restart_grace_auto_is_accepted_as_its_help_says(
    argv: list[str], environ: dict[str, str]
) -> None:
    """``--restart-grace auto`` is the documented default's name: it was refused with a
    TypeError (its check compared ``None`` with 0)."""
    assert load_config(argv, environ).restart_grace_s is None


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"members": ("a:1", "b:1"), "cluster": "etcd://e:2379"}, "members"),
        ({"members": ("a:1", "b:1")}, "advertise"),
        ({"advertise": "a:1"}, "advertise"),
        ({"cluster_user": "u"}, "cluster_user"),
        ({"cluster": "etcd://e:2379", "advertise": "a:1", "cluster_user": "u"}, "cluster_user"),
        ({"cluster": "etcd://e:2379", "advertise": "a:1", "cluster_password": "p"}, "cluster_user"),
        ({"default_lease_ttl_s": 60, "max_lease_ttl_s": 30}, "default_lease_ttl_s"),
    ],
)
def test_config_errors_name_a_setting_one_way(kwargs: dict[str, Any], named: str) -> None:
    """Every error names a setting as ``--flag / ENV`` (``settings.names``): some wrote
    ``--flag (ENV)``, others only the flag."""
    from dflockd_server.settings import names

    with pytest.raises(ValueError) as exc:
        Config(**kwargs)
    assert names(named) in str(exc.value)
    assert "(DFLOCKD_" not in str(exc.value)


def test_an_unreadable_auth_token_file_is_named_as_the_user_gives_it(tmp_path: Path) -> None:
    from dflockd_server.settings import names

    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=re.escape(f"{names('auth_token_file')} {str(empty)!r}")):
        Config(auth_token_file=str(empty)).resolve_auth_token()
    with pytest.raises(UsageError) as exc:
        load_config(["--auth-token-file", str(empty)], {})
    assert str(exc.value).count("--auth-token-file") == 1, exc.value


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--state-dir", "None"], {}),
        (["--state-dir", "NONE"], {}),
        ([], {"DFLOCKD_STATE_DIR": "None"}),
    ],
)
def test_state_dir_none_in_any_case_keeps_no_state_and_makes_no_directory(
    argv: list[str],
    environ: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--state-dir None`` (or the variable set to the string ``None``) made a directory named
    ``None`` in the working directory: ``none`` was matched in lower case only."""
    from dflockd_server.state import resolve_state_dir
    from dflockd_server.testing import ServerThread

    monkeypatch.chdir(tmp_path)
    config = dataclasses.replace(
        load_config([*argv, "--host", "127.0.0.1", "--port", "6388"], environ), port=0
    )
    assert resolve_state_dir(dataclasses.replace(config, port=6388)) is None
    with ServerThread(config) as server:
        assert server.server.state is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("given", "said"),
    [
        # the first thing wrong is the missing --cluster, not the missing --cluster-key
        ({"cluster_cert": "/etc/hosts"}, "--cluster-cert / DFLOCKD_CLUSTER_CERT is only used with"),
        (
            {"cluster_password": "x", "cluster_password_file": "/etc/hosts"},
            "DFLOCKD_CLUSTER_PASSWORD_FILE is only used with --cluster",
        ),
        # a TLS file on a plain etcd:// URL: write etcds://, not "add --cluster-key"
        (
            {
                "cluster": "etcd://127.0.0.1:2379/p",
                "advertise": "127.0.0.1:6388",
                "cluster_cert": "/etc/hosts",
            },
            "is plain: write it etcds://",
        ),
        # a server without --cluster: its own lease settings' mistake first
        ({"cluster_cert": "/etc/hosts", "default_lease_ttl_s": 500}, "exceeds --max-lease-ttl"),
    ],
)
def test_etcd_access_mistakes_are_named_in_the_order_they_are_checked(
    given: dict[str, Any], said: str
) -> None:
    """The etcd access pairs (cert and key, password or its file) are checked with the rest of
    etcd's access, after ``--cluster`` itself: a pair rule checked first named a second setting
    to add to one that was of no use without ``--cluster`` (or on a plain ``etcd://``)."""
    from dflockd_server.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(said)):
        Config(**given)


def test_a_metrics_host_without_its_port_says_the_endpoint_is_off() -> None:
    """``--metrics-host`` alone: the error says why it is of no use (the metrics endpoint is off
    without ``--metrics-port``), as it did before its wording was shared with the other
    settings that need another."""
    from dflockd_server.config import ConfigError

    with pytest.raises(ConfigError) as raised:
        Config(metrics_host="127.0.0.1")
    said = str(raised.value)
    assert said.startswith("--metrics-host / DFLOCKD_METRICS_HOST is only used with --metrics-port")
    assert "the metrics endpoint is off without it" in said


def test_dflockd_refuses_a_restart_grace_it_cannot_count_down() -> None:
    """A ``--restart-grace`` past what a clock can show (1e17 s and more) was taken: the server
    started, and every ``stats``, ``celery dflock status`` and status page failed on it (its
    end is shown as a time of day), for as long as the grace, which the state dir kept for the
    next start too. It is refused as a lease that long is."""
    for args, env in (
        (["--restart-grace", "1e300"], {}),
        ([], {"DFLOCKD_RESTART_GRACE_S": "1e17"}),
    ):
        result = run_dflockd(["--port", "0", "--state-dir", "none", *args], env, timeout=10)
        assert result.returncode == 2, result.stderr
        named = "--restart-grace='1e300'" if args else "DFLOCKD_RESTART_GRACE_S='1e17'"
        assert result.stderr.strip().splitlines() == [
            f"dflockd: error: {named}: must be 0..9000000000 or auto"
        ]


_ETCDS = ["--cluster", "etcds://127.0.0.1:1", "--cluster-cert", "CERT", "--cluster-key", "KEY"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "0", "--tls-cert", "CERT", "--tls-key", "KEY"], "--tls-key"),
        (
            ["--port", "0", "--state-dir", "none", "--advertise", "127.0.0.1:7000", *_ETCDS],
            "--cluster-key",
        ),
        (["shards", *_ETCDS], "--cluster-key"),
    ],
    ids=["tls", "cluster", "cluster-command"],
)
def test_an_encrypted_key_stops_the_start_saying_so(
    tmp_path: Path, tls_files: tuple[Path, Path], args: list[str], named: str
) -> None:
    """A key encrypted with a passphrase (no setting gives one) made OpenSSL ask for it: at a
    terminal the start stopped at "Enter PEM pass phrase:" (twice for --tls-key: the check,
    then the server), and without one (a container, systemd) it failed with "[Errno 22]
    Invalid argument"."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to encrypt a key")
    cert, key = tls_files
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(
        [openssl, "pkey", "-in", str(key), "-aes256", "-passout", "pass:x", "-out", str(encrypted)],
        check=True,
        capture_output=True,
    )
    given = {"CERT": str(cert), "KEY": str(encrypted)}
    result = subprocess.run(
        [dflockd_executable(), *(given.get(arg, arg) for arg in args)],
        env=clean_env({}),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        start_new_session=True,  # no terminal to ask on, as in a container
    )
    assert result.returncode != 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0]
    assert "is encrypted" in lines[0]
    assert "pass phrase" not in result.stderr


def test_a_secret_no_client_can_send_stops_the_start(tmp_path: Path) -> None:
    """A secret of two lines (the file ``openssl rand -base64 64`` writes) or past the auth
    line's 64 KiB was taken, and the server refused every client's ``auth`` (the clients refuse
    such a secret themselves: the protocol cannot carry it), saying nothing of why."""
    two_lines = tmp_path / "token"
    two_lines.write_text("c2VjcmV0LXBhcnQtb25l\nc2VjcmV0LXBhcnQtdHdv\n")
    long = "x" * (constants.MAX_AUTH_LINE_BYTES + 1)
    for args, env, named, why in (
        (["--auth-token-file", str(two_lines)], {}, "--auth-token-file", "line break"),
        ([], {"DFLOCKD_AUTH_TOKEN": "one\rtwo"}, "--auth-token", "line break"),
        ([], {"DFLOCKD_AUTH_TOKEN": long}, "--auth-token", "65536 bytes"),
    ):
        result = run_dflockd(["--port", "0", *args], env, timeout=10)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert named in lines[0]
        assert why in lines[0]


def test_a_cluster_lease_longer_than_etcd_grants_stops_the_start_naming_it() -> None:
    """``--cluster-lease-ttl`` had no upper bound: 10,000,000,000 (past etcd's own longest
    lease, 9,000,000,000 s) ended the start in a traceback (``OverflowError`` from a socket
    timeout of a fifth of it)."""
    result = run_dflockd(
        [
            "--port", "0", "--state-dir", "none", "--cluster", "etcd://127.0.0.1:1",
            "--advertise", "127.0.0.1:7000", "--cluster-lease-ttl", "10000000000",
        ],
        {},
        timeout=30,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "dflockd: error: --cluster-lease-ttl='10000000000': must be 1..9000000000"
    ]


def test_a_fence_state_file_in_no_writable_directory_stops_the_start(tmp_path: Path) -> None:
    """A ``--fence-state-file`` whose directory is missing (``~/fence`` from docker-compose,
    systemd or Kubernetes, which do not expand ``~``; a typo) was taken: the server started,
    said the file "is created now", and answered every acquire ``error_read_only`` for as long
    as it ran, since it could store no fence ceiling there."""
    for given, env in (
        (["--fence-state-file", str(tmp_path / "missing" / "fence")], {}),
        ([], {"DFLOCKD_FENCE_STATE_FILE": "~/fence", "HOME": str(tmp_path)}),
    ):
        result = run_dflockd(["--port", "0", "--state-dir", "none", *given], env, timeout=10)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert "--fence-state-file" in lines[0]
        assert "no directory" in lines[0]
