from pathlib import Path

import pytest

from inferd.gateway.config import (
    ConfigError,
    GatewayConfig,
    HealthConfig,
    ModelConfig,
    RoutingConfig,
    load_config,
)
from inferd.gateway.ratelimit import RateLimits

EXAMPLE = Path(__file__).parents[2] / "examples/gateway.yaml"

# A model section that is valid on its own, for files about other settings.
MODEL = "models:\n  - name: a\n    upstreams: [http://x]\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value)


# The example file


def test_example_config_loads_with_its_values():
    config = load_config(EXAMPLE)

    assert isinstance(config, GatewayConfig)
    assert (config.host, config.port) == ("127.0.0.1", 8080)
    assert (config.auth.enabled, config.auth.public_metrics) == (True, True)
    assert isinstance(config.limits, RateLimits)
    assert config.limits == RateLimits(rpm=600, tpm=200000, max_concurrent=64)
    assert config.routing == RoutingConfig(policy="prefix_affinity", prefix_chars=256)
    assert config.health == HealthConfig(interval_s=2.0, failure_threshold=3, cooldown_s=10.0, retries=2)
    (model,) = config.models
    assert model.name == "smollm2"
    assert model.command == [
        "inferd", "serve", "--port", "{port}", "--served-model-name", "smollm2", "--kv-cache-memory-gb", "1",
    ]
    assert model.upstreams == []
    assert model.local is True
    assert (model.min_replicas, model.max_replicas, model.target_concurrency) == (1, 2, 16)
    assert model.idle_timeout_s == 300.0
    assert (model.max_tokens, model.max_prompt_tokens, model.tokenizer) == (2048, 8192, "default")
    assert config.model("smollm2") is model
    assert config.model("other") is None


def test_overrides_replace_given_fields_and_skip_none():
    config = load_config(EXAMPLE, port=9999, host=None)

    assert config.port == 9999
    assert config.host == "127.0.0.1"


# Conversions


def test_int_is_accepted_where_a_float_is_expected(tmp_path):
    path = write(tmp_path, "models:\n  - name: a\n    command: [x, \"{port}\"]\n    idle_timeout_s: 5\n")

    value = load_config(path).models[0].idle_timeout_s

    assert value == 5.0
    assert type(value) is float


def test_number_in_a_command_becomes_a_string(tmp_path):
    path = write(tmp_path, 'models:\n  - name: a\n    command: [inferd, serve, --port, "{port}", --threads, 1]\n')

    command = load_config(path).models[0].command

    assert command == ["inferd", "serve", "--port", "{port}", "--threads", "1"]


def test_upstreams_lose_trailing_slash_and_v1(tmp_path):
    path = write(tmp_path, "models:\n  - name: a\n    upstreams: [http://h:8000/v1/, https://b.example/, http://c/v1]\n")

    upstreams = load_config(path).models[0].upstreams

    assert upstreams == ["http://h:8000", "https://b.example", "http://c"]
    assert load_config(path).models[0].local is False


# Errors: file, exact line, field path once


def test_unknown_top_level_setting(tmp_path):
    path = write(tmp_path, "port: 8080\nbogus: 1\n" + MODEL)

    message = load_error(path)

    assert message.startswith(f"{path}:2: bogus: unknown setting (expected one of models, host, port, ")


def test_unknown_setting_inside_a_model(tmp_path):
    path = write(tmp_path, MODEL + "  - name: b\n    upstreams: [http://y]\n    colour: red\n")

    message = load_error(path)

    assert message.startswith(f"{path}:6: models[1].colour: unknown setting (expected one of name, command, ")
    assert message.removeprefix(str(path)).count("models[1]") == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('port: "abc"\n' + MODEL, "1: port: expected an integer, got str 'abc'"),
        ("models:\n  - name: a\n    upstreams: http://x\n", "3: models[0].upstreams: expected a list, got str 'http://x'"),
        ('auth:\n  enabled: "yes"\n' + MODEL, "2: auth.enabled: expected true or false, got str 'yes'"),
        ("models:\n  - name: a\n    idle_timeout_s: true\n", "3: models[0].idle_timeout_s: expected a number, got a boolean (True)"),
        ("models:\n", "1: models: expected a list, got nothing (null)"),
        ("models:\n  - a\n", "2: models[0]: expected a mapping, got str 'a'"),
    ],
    ids=["port-string", "upstreams-string", "auth-enabled-string", "float-boolean", "models-null", "model-scalar"],
)
def test_wrong_type_names_line_and_field(tmp_path, text, expected):
    path = write(tmp_path, text)

    assert load_error(path) == f"{path}:{expected}"


def test_command_without_port_placeholder(tmp_path):
    path = write(tmp_path, "models:\n  - name: a\n    command: [inferd, serve]\n")

    message = load_error(path)

    assert message == f"{path}:3: models[0].command: must contain {{port}} where the replica's port goes"
    assert message.removeprefix(str(path)).count("command") == 1


@pytest.mark.parametrize(
    "text",
    [
        'models:\n  - name: a\n    command: [x, "{port}"]\n    upstreams: [http://x]\n',
        "models:\n  - name: a\n    max_tokens: 5\n",
    ],
    ids=["both", "neither"],
)
def test_command_and_upstreams_exclusive_is_an_error_naming_the_model_once(tmp_path, text):
    path = write(tmp_path, text)

    message = load_error(path)

    assert message.startswith(f"{path}:")
    assert message.removeprefix(str(path)).count("models[0]") == 1
    assert "give exactly one (a local replica command, or upstream URLs)" in message


def test_neither_command_nor_upstreams_points_at_the_model(tmp_path):
    path = write(tmp_path, "models:\n  - name: a\n    max_tokens: 5\n")

    assert load_error(path).startswith(f"{path}:2: models[0]")


@pytest.mark.parametrize(
    "text",
    [
        'models:\n  - name: a\n    command: [x, "{port}"]\n    upstreams: [http://x]\n',
        "models:\n  - name: a\n    max_tokens: 5\n",
    ],
    ids=["both", "neither"],
)
def test_command_and_upstreams_message_keeps_its_subject(tmp_path, text):
    path = write(tmp_path, text)

    assert load_error(path) == (
        f"{path}:2: models[0]: command or upstreams: give exactly one (a local replica command, or upstream URLs)"
    )


def test_tls_cert_without_key_message_keeps_its_subject(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("")
    path = write(tmp_path, f"tls_cert: {cert}\n" + MODEL)

    assert "tls_cert and tls_key go together: give both or neither" in load_error(path)


def test_max_replicas_below_min_replicas(tmp_path):
    path = write(tmp_path, 'models:\n  - name: a\n    command: [x, "{port}"]\n    min_replicas: 3\n    max_replicas: 2\n')

    assert load_error(path) == f"{path}:5: models[0].max_replicas: must be >= max(1, min_replicas=3), got 2"


def test_negative_min_replicas(tmp_path):
    path = write(tmp_path, 'models:\n  - name: a\n    command: [x, "{port}"]\n    min_replicas: -1\n')

    assert load_error(path) == f"{path}:4: models[0].min_replicas: must be an integer >= 0, got -1"


def test_duplicate_model_names_point_at_the_models_list(tmp_path):
    path = write(tmp_path, "port: 1\nmodels:\n  - name: a\n    upstreams: [http://x]\n  - name: a\n    upstreams: [http://y]\n")

    assert load_error(path) == f"{path}:3: models: must have distinct names, 'a' repeats"


def test_missing_models_and_missing_name_are_required(tmp_path):
    assert load_error(write(tmp_path, "port: 1\n")).endswith(": models: required")
    path = write(tmp_path, "models:\n  - upstreams: [http://x]\n")
    assert load_error(path) == f"{path}:2: models[0].name: required"


def test_limits_error_names_the_limit(tmp_path):
    path = write(tmp_path, "limits:\n  rpm: 0\n" + MODEL)

    assert load_error(path) == f"{path}:2: limits.rpm: must be None or an integer >= 1, got 0"


def test_invalid_yaml_names_the_line_of_the_problem(tmp_path):
    path = write(tmp_path, "port: 1\nmodels:\n  - name: a\n   upstreams: [http://x]\n")

    message = load_error(path)

    assert message == f"{path}:4: not valid YAML: expected <block end>, but found '<block mapping start>'"


@pytest.mark.parametrize("text", ["", "# only a comment\n"], ids=["empty", "comment"])
def test_empty_file(tmp_path, text):
    path = write(tmp_path, text)

    assert load_error(path) == f"{path}: the file is empty"


def test_top_level_list(tmp_path):
    path = write(tmp_path, "\n- a\n- b\n")

    assert load_error(path) == f"{path}:2: the top level must be a mapping of settings"


def test_missing_file(tmp_path):
    path = tmp_path / "missing.yaml"

    assert load_error(path) == f"{path}: cannot read the config: No such file or directory"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# Direct construction


def model(**settings) -> ModelConfig:  # noqa: ANN003
    return ModelConfig(name="a", upstreams=["http://x"], **settings)


def test_tls_cert_without_key(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("")

    with pytest.raises(ValueError) as e:
        GatewayConfig(models=[model()], tls_cert=str(cert))

    assert str(e.value) == "tls_cert and tls_key go together: give both or neither"


def test_tls_file_missing(tmp_path):
    key = tmp_path / "key.pem"
    key.write_text("")
    cert = tmp_path / "cert.pem"

    with pytest.raises(ValueError) as e:
        GatewayConfig(models=[model()], tls_cert=str(cert), tls_key=str(key))

    assert str(e.value) == f"tls_cert: no such file {str(cert)!r}"


def test_routing_policy_unknown():
    with pytest.raises(ValueError) as e:
        RoutingConfig(policy="random")

    assert str(e.value) == "policy must be one of prefix_affinity, least_loaded, round_robin, got 'random'"


def test_routing_overload_factor_below_one():
    with pytest.raises(ValueError) as e:
        RoutingConfig(overload_factor=0.5)

    assert str(e.value) == "overload_factor must be >= 1, got 0.5"


def test_health_retries_negative():
    with pytest.raises(ValueError) as e:
        HealthConfig(retries=-1)

    assert str(e.value) == "retries must be >= 0, got -1"


def test_model_upstream_must_be_http():
    with pytest.raises(ValueError) as e:
        ModelConfig(name="a", upstreams=["ftp://x"])

    assert str(e.value) == "upstreams must be http:// or https:// URLs, got 'ftp://x'"


def test_model_replica_model_defaults_to_name():
    assert model().replica_model == "a"
    assert model(upstream_model="b").replica_model == "b"
