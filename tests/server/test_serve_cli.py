"""`dspark serve`'s options: flags over the --config YAML file over defaults, checked."""

from __future__ import annotations

import pytest

from dspark.cli import build_parser, main
from dspark.server.cli import build_configs, resolve_options


def _options(tmp_path, yaml_text: str, *flags: str) -> dict:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml_text)
    return resolve_options(build_parser().parse_args(["serve", "--config", str(path), *flags]))


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path):
    options = _options(
        tmp_path,
        "model: some/model\nmax-model-len: 4096\nport: 9000\napi_key: from-file\n"
        "speculative-config: {method: dspark, num_speculative_tokens: 3}\n",
        "--port", "9100",
    )  # fmt: skip
    assert options["model"] == "some/model" and options["max_model_len"] == 4096
    assert options["port"] == 9100 and options["api_key"] == "from-file"
    assert options["speculative_config"] == {"method": "dspark", "num_speculative_tokens": 3}
    assert options["host"] == "127.0.0.1" and options["max_num_seqs"] == 256  # defaults
    engine, server = build_configs(options)
    assert engine.max_model_len == 4096 and server.served_model_name == "some/model"


def test_bad_files_and_values_are_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_len'\]; allowed: \["):
        _options(tmp_path, "max_len: 10\n")
    with pytest.raises(ValueError, match="max_model_len: expected int, got '4096'"):
        _options(tmp_path, "max-model-len: '4096'\n")
    with pytest.raises(ValueError, match="expected a mapping of options"):
        _options(tmp_path, "- model\n")
    with pytest.raises(ValueError, match="max_queued_requests must be >= 1, got 0"):
        build_configs(_options(tmp_path, "max-queued-requests: 0\n"))
    assert main(["serve", "--port", "70000"]) == 2
    assert "port must be in 0..65535, got 70000" in capsys.readouterr().err


def test_the_stream_budget_flows_from_flag_or_file_and_is_checked(tmp_path):
    assert build_configs(_options(tmp_path, "model: m\n"))[1].stream_budget == 0.1  # default
    _, server = build_configs(_options(tmp_path, "stream-budget: 1\n", "--stream-budget", "0.05"))
    assert server.stream_budget == 0.05
    assert build_configs(_options(tmp_path, "stream_budget: 1\n"))[1].stream_budget == 1.0
    with pytest.raises(ValueError, match=r"stream_budget must be in \(0, 1\] or None, got 2.0"):
        build_configs(_options(tmp_path, "stream-budget: 2.0\n"))


def test_the_api_server_count_flows_from_flag_or_file_and_is_checked(tmp_path):
    assert build_configs(_options(tmp_path, "model: m\n"))[1].api_server_count == 1  # default
    options = _options(tmp_path, "api-server-count: 4\n", "--api-server-count", "2")
    _, server = build_configs(options)
    assert server.api_server_count == 2
    assert build_configs(_options(tmp_path, "api_server_count: 3\n"))[1].api_server_count == 3
    with pytest.raises(ValueError, match=r"api_server_count must be in 1\.\.64, got 0"):
        build_configs(_options(tmp_path, "api-server-count: 0\n"))
    with pytest.raises(ValueError, match="api_server_count: expected int, got 'two'"):
        _options(tmp_path, "api-server-count: two\n")


def test_a_deleted_setting_is_refused_by_name(tmp_path):
    """burst_requests became a rule (engine/burst.py), no longer a setting: a file naming it
    is refused with the allowed options."""
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['burst_requests'\]"):
        _options(tmp_path, "burst-requests: 64\n")


def test_prefix_caching_is_on_by_default_and_switched_by_flag_or_file(tmp_path):
    assert build_configs(_options(tmp_path, "model: m\n"))[0].enable_prefix_caching
    off = _options(tmp_path, "model: m\n", "--no-enable-prefix-caching")
    assert not build_configs(off)[0].enable_prefix_caching
    from_file = _options(tmp_path, "enable-prefix-caching: false\n")
    assert not build_configs(from_file)[0].enable_prefix_caching
    flag_wins = _options(tmp_path, "enable-prefix-caching: false\n", "--enable-prefix-caching")
    assert build_configs(flag_wins)[0].enable_prefix_caching
    with pytest.raises(ValueError, match="enable_prefix_caching: expected bool, got 'no'"):
        _options(tmp_path, "enable-prefix-caching: 'no'\n")
    generate = build_parser().parse_args(["generate", "hi", "--no-enable-prefix-caching"])
    assert generate.enable_prefix_caching is False
    assert build_parser().parse_args(["generate", "hi"]).enable_prefix_caching is True


def test_cors_options_flow_from_flags_or_file_with_vllms_defaults(tmp_path):
    _, server = build_configs(_options(tmp_path, "model: m\n"))
    assert server.allowed_origins == server.allowed_methods == server.allowed_headers == ("*",)
    assert server.allow_credentials is False
    options = _options(
        tmp_path,
        "allowed-origins: [https://a.example, https://b.example]\nallow_credentials: true\n"
        "allowed-methods: [GET]\n",
        "--allowed-methods", '["POST", "OPTIONS"]',
    )  # fmt: skip
    _, server = build_configs(options)
    assert server.allowed_origins == ("https://a.example", "https://b.example")
    assert server.allowed_methods == ("POST", "OPTIONS") and server.allow_credentials is True
    with pytest.raises(ValueError, match="allowed_origins: expected list, got 'https://a'"):
        _options(tmp_path, "allowed-origins: https://a\n")
    with pytest.raises(ValueError, match="allowed_headers must be a JSON list of strings"):
        build_configs(_options(tmp_path, "model: m\n", "--allowed-headers", '"X-Key"'))
    with pytest.raises(ValueError, match="allowed_origins must be a list of non-empty strings"):
        build_configs(_options(tmp_path, "allowed-origins: ['']\n"))
