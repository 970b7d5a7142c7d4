"""Foundation: CLI surface, config validation, the embedded Redis and the project's client."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pipeline import cli
from pipeline.config import ConfigError, env_var_names, load_config
from pipeline.errors import StateUnavailable
from pipeline.redis_client import connect, ping, redact
from pipeline.redis_server import LocalRedis, free_port

JOB = {"job_id": "sft-1", "world_size": 2, "source": {"paths": ["data.jsonl"]}}


def test_help_lists_every_design_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True, text=True,
        check=True,
    ).stdout
    for name in ("serve", "plan", "status", "demo", "inspect"):
        assert name in out


def test_every_command_module_registers_arguments():
    """Each command of the CLI has a module that registers its arguments (shown in its help)
    and runs the parsed result."""
    parser = cli.build_parser(load_commands=True)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == set(cli.COMMANDS)
    for name, sub in commands.choices.items():
        options = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        assert options, f"`{name}` registers no argument"
        shown = sub.format_help()
        assert all(a.dest in shown or any(o in shown for o in a.option_strings)
                   for a in options), name
        assert callable(cli._module(name).run), name
    args = parser.parse_args(["plan", "--lengths", "lengths.txt"])
    assert (args.command, args.lengths) == ("plan", "lengths.txt")


def test_negative_budget_names_field_and_value():
    job = {**JOB, "batching": {"token_budget": -5}}
    with pytest.raises(ConfigError) as err:
        load_config(environ={}, overrides={"jobs": [job]})
    assert "jobs[0].batching.token_budget = -5" in str(err.value)


def test_env_overrides_file_and_flags_override_env(tmp_path):
    path = tmp_path / "odb.yaml"
    path.write_text("grpc:\n  port: 6000\nlog_format: text\njobs: []\n")
    cfg = load_config(path, environ={"ODB_GRPC__PORT": "7000", "ODB_LOG_FORMAT": "json"})
    assert cfg.grpc.port == 7000 and cfg.log_format == "json"
    cfg = load_config(path, environ={"ODB_GRPC__PORT": "7000"}, overrides={"grpc": {"port": 8}})
    assert cfg.grpc.port == 8


def test_bad_env_value_is_named():
    with pytest.raises(ConfigError, match=r"grpc.port = 'abc'"):
        load_config(environ={"ODB_GRPC__PORT": "abc"})


def test_unknown_key_and_duplicate_jobs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="tokn_budget"):
        load_config(environ={}, overrides={"jobs": [{**JOB, "batching": {"tokn_budget": 1}}]})
    with pytest.raises(ConfigError, match="duplicate job_id"):
        load_config(environ={}, overrides={"jobs": [JOB, JOB]})
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found"):
        load_config(missing, environ={})


def test_env_var_names_are_derived_from_the_model():
    names = env_var_names()
    assert "ODB_REDIS_URL" in names and "ODB_GRPC__PORT" in names
    assert not any(n.startswith("ODB_JOBS") for n in names)


def test_an_env_variable_naming_no_setting_is_refused_or_warned_about(caplog):
    """#42: `ODB_GRPC_PORT` (for `ODB_GRPC__PORT`) was ignored without a word, so a second
    `serve` took the default port. A misspelt setting is refused naming the setting meant; any
    other `ODB_*` name the config does not read is warned about; a token the config names is
    neither."""
    for typo, meant in (("ODB_GRPC_PORT", "ODB_GRPC__PORT"), ("ODB_REDIS__URL", "ODB_REDIS_URL"),
                        ("ODB_LEASE_SECOND", "ODB_LEASE_SECONDS")):
        with pytest.raises(ConfigError, match=f"{typo} \\(did you mean {meant}\\?\\)"):
            load_config(environ={typo: "1"})
    with caplog.at_level("WARNING", logger="pipeline.config"):
        load_config(environ={"ODB_TOKEN": "x", "ODB_SFT_TOKEN": "s3cret"},
                    overrides={"jobs": [{**JOB, "token_env": "ODB_SFT_TOKEN"}]})
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "ODB_TOKEN names no setting" in warned[0], warned


def test_job_token_comes_from_named_env():
    cfg = load_config(environ={}, overrides={"jobs": [{**JOB, "token_env": "SFT_TOKEN"}]})
    assert cfg.job("sft-1").token({"SFT_TOKEN": "s3cret"}) == "s3cret"
    with pytest.raises(ConfigError, match="SFT_TOKEN"):
        cfg.job("sft-1").token({})


def test_redis_set_get_through_project_client(redis_client):
    redis_client.set("odb:test", b"\x00\x01payload")
    assert redis_client.get("odb:test") == b"\x00\x01payload"


def test_redis_password_from_url():
    with LocalRedis(password="pw-123") as server:
        client = connect(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert "pw-123" not in redact(server.url)


def test_unreachable_redis_is_a_clear_error():
    client = connect(f"redis://127.0.0.1:{free_port()}/0", retries=1, socket_timeout=0.5)
    with pytest.raises(StateUnavailable, match="Redis unreachable"):
        ping(client, f"redis://127.0.0.1:{free_port()}/0")
