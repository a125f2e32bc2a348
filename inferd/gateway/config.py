"""``GatewayConfig``: what ``inferd gateway -c FILE`` runs, read from YAML.

Each section is a dataclass validated in ``__post_init__``; ``load_config``
builds them from the file and turns any error into one line naming the file,
the line and the field (``gateway.yaml:12: models[0].max_replicas: ...``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inferd.gateway.ratelimit import RateLimits

ROUTING_POLICIES = ("prefix_affinity", "least_loaded", "round_robin")
PORT_PLACEHOLDER = "{port}"


def _positive(owner: object, *names: str, allow_none: bool = False) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass
class ModelConfig:
    # The `model` clients ask for.
    name: str
    # A local replica: the command that starts one, with "{port}" where the
    # gateway's chosen port goes, e.g. [inferd, serve, --port, "{port}"].
    command: list[str] | None = None
    # Or fixed replicas somewhere else: their base URLs (any OpenAI-compatible server).
    upstreams: list[str] = field(default_factory=list)
    # The name the replicas know the model by (default: name).
    upstream_model: str | None = None
    # Sent to the replicas as "Authorization: Bearer ..." (a hosted upstream's
    # key); clients' own keys never travel upstream.
    upstream_api_key: str | None = None
    # Extra environment of local replicas.
    env: dict[str, str] = field(default_factory=dict)
    # Local replicas only: how many run, between these bounds; 0 allows scale to zero.
    min_replicas: int = 1
    max_replicas: int = 1
    # In-flight requests per replica above which one more replica starts...
    target_concurrency: int = 16
    # ...once it has stayed above that long.
    scale_up_after_s: float = 2.0
    # A replica that served nothing this long stops (down to min_replicas).
    idle_timeout_s: float = 300.0
    # A local replica that is not healthy this long after it started is killed.
    startup_timeout_s: float = 300.0
    # Where the replicas answer health checks (200 = healthy).
    health_path: str = "/health"
    # Edge validation: the largest max_tokens and prompt a request may carry
    # (None: the replica decides).
    max_tokens: int | None = None
    max_prompt_tokens: int | None = None
    # A tokenizer.json (or GGUF file, or "default" for the embedded model) to
    # count prompt tokens exactly; without one, prompts are counted as
    # ceil(UTF-8 bytes / 4), the usual estimate for English.
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if (self.command is None) == (not self.upstreams):
            raise ValueError("command or upstreams: give exactly one (a local replica command, or upstream URLs)")
        if self.command is not None:
            if not self.command:
                raise ValueError("command must not be empty")
            if not any(PORT_PLACEHOLDER in arg for arg in self.command):
                raise ValueError(f"command must contain {PORT_PLACEHOLDER} where the replica's port goes")
            for name in ("min_replicas", "max_replicas"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
            if self.max_replicas < max(1, self.min_replicas):
                raise ValueError(f"max_replicas must be >= max(1, min_replicas={self.min_replicas}), got {self.max_replicas}")
        for url in self.upstreams:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstreams must be http:// or https:// URLs, got {url!r}")
        self.upstreams = [url.rstrip("/").removesuffix("/v1") for url in self.upstreams]
        if len(set(self.upstreams)) != len(self.upstreams):
            raise ValueError("upstreams must not repeat a URL")
        if isinstance(self.target_concurrency, bool) or not isinstance(self.target_concurrency, int) or self.target_concurrency < 1:
            raise ValueError(f"target_concurrency must be an integer >= 1, got {self.target_concurrency!r}")
        _positive(self, "scale_up_after_s", "idle_timeout_s", "startup_timeout_s")
        _positive(self, "max_tokens", "max_prompt_tokens", allow_none=True)
        if not self.health_path.startswith("/"):
            raise ValueError(f"health_path must start with /, got {self.health_path!r}")

    @property
    def local(self) -> bool:
        return self.command is not None

    @property
    def replica_model(self) -> str:
        return self.upstream_model or self.name


@dataclass
class AuthConfig:
    # Require an API key (inferd keys create) on every route but /health.
    enabled: bool = True
    # Let /metrics be scraped without a key.
    public_metrics: bool = False


@dataclass
class RoutingConfig:
    policy: str = "prefix_affinity"
    # The leading characters of the prompt (system prompt first) that choose
    # the affine replica: requests agreeing on them share a cached prefix.
    prefix_chars: int = 256
    # The affine replica is passed over when its load exceeds both
    # overload_factor x and overload_margin + the least loaded replica's.
    overload_factor: float = 1.5
    overload_margin: int = 2

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        _positive(self, "prefix_chars")
        if not self.overload_factor >= 1:
            raise ValueError(f"overload_factor must be >= 1, got {self.overload_factor}")
        if self.overload_margin < 0:
            raise ValueError(f"overload_margin must be >= 0, got {self.overload_margin}")


@dataclass
class HealthConfig:
    interval_s: float = 2.0
    timeout_s: float = 2.0
    # Consecutive failures (requests or checks) that open a replica's circuit...
    failure_threshold: int = 3
    # ...for this long, after which one trial request may close it again.
    cooldown_s: float = 10.0
    # Other replicas tried for a request that failed before its first byte.
    retries: int = 2

    def __post_init__(self) -> None:
        _positive(self, "interval_s", "timeout_s", "cooldown_s", "failure_threshold")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


@dataclass
class GatewayConfig:
    models: list[ModelConfig]
    host: str = "127.0.0.1"
    port: int = 8080
    auth: AuthConfig = field(default_factory=AuthConfig)
    # Per-key limits for keys that set none of their own.
    limits: RateLimits = field(default_factory=RateLimits)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    max_body_bytes: int = 2 * 1024 * 1024
    # CORS: the origins browsers may call from ("*" for any); empty is off.
    cors_origins: list[str] = field(default_factory=list)
    tls_cert: str | None = None
    tls_key: str | None = None
    # Keys, usage and replica logs; None: $INFERD_HOME, default ~/.inferd.
    data_dir: str | None = None
    # A request waiting for a model at zero replicas gives up after this.
    cold_start_timeout_s: float = 300.0
    # Upstream silence (no byte) after which a request fails.
    upstream_timeout_s: float = 600.0
    # On SIGTERM: how long in-flight requests may take before replicas stop.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must list at least one model")
        names = [m.name for m in self.models]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"models must have distinct names, {duplicate!r} repeats")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")
        _positive(self, "max_body_bytes", "cold_start_timeout_s", "upstream_timeout_s")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


# YAML -> dataclasses, with line numbers -----------------------------------------


class ConfigError(ValueError):
    pass


def load_config(path: str | Path, **overrides: Any) -> GatewayConfig:
    """The config in ``path``; ``overrides`` (e.g. host, port from flags)
    replace top-level fields. Raises ``ConfigError`` naming line and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config: {e.strerror}") from None
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    if node is None:
        raise ConfigError(f"{path}: the file is empty")
    builder = _Builder(path, yaml.SafeLoader(""))
    data = builder.plain(node, "")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: the top level must be a mapping of settings")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return builder.build(GatewayConfig, data, "")


class _Builder:
    def __init__(self, path: Path, loader: yaml.SafeLoader) -> None:
        self.path = path
        self.loader = loader
        self.lines: dict[str, int] = {}

    def plain(self, node: yaml.Node, where: str) -> Any:
        """The node as plain Python, remembering each path's line."""
        self.lines[where] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            out = {}
            for key_node, value_node in node.value:
                key = str(self.loader.construct_object(key_node))
                out[key] = self.plain(value_node, f"{where}.{key}" if where else key)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.plain(item, f"{where}[{i}]") for i, item in enumerate(node.value)]
        return self.loader.construct_object(node)

    def fail(self, where: str, message: str) -> ConfigError:
        line = self.lines.get(where)
        while line is None and where:  # a missing field: the line of its section
            where_up = where.rsplit(".", 1)[0] if "." in where else ""
            line, where = self.lines.get(where_up), where_up
        prefix = f"{self.path}:{line}" if line else str(self.path)
        return ConfigError(f"{prefix}: {message}")

    def build(self, cls: type, data: Any, where: str) -> Any:
        if not isinstance(data, dict):
            raise self.fail(where, f"{where or 'the top level'}: expected a mapping, got {_kind(data)}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in data.items():
            here = f"{where}.{key}" if where else key
            if key not in fields:
                raise self.fail(here, f"{here}: unknown setting (expected one of {', '.join(fields)})")
            kwargs[key] = self.convert(hints[key], value, here)
        missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            here = f"{where}.{missing[0]}" if where else missing[0]
            raise self.fail(where, f"{here}: required")
        try:
            return cls(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            # The dataclasses' messages start with the field they name.
            # "field must ..." and "field: ..." name their field; anything else
            # ("command or upstreams: ...") is about the section as a whole.
            message = str(e)
            first, _, rest = message.partition(" ")
            field_name = first.rstrip(":")
            if field_name in fields and (first.endswith(":") or rest.startswith("must ")):
                here = f"{where}.{field_name}" if where else field_name
                message = rest
            else:
                here = where
            raise self.fail(here, f"{here or 'config'}: {message}") from None

    def convert(self, hint: Any, value: Any, where: str) -> Any:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            (hint,) = [a for a in args if a is not type(None)]
            return self.convert(hint, value, where)
        if dataclasses.is_dataclass(hint):
            return self.build(hint, value, where)
        if origin is list:
            if not isinstance(value, list):
                raise self.fail(where, f"{where}: expected a list, got {_kind(value)}")
            return [self.convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
        if origin is dict:
            if not isinstance(value, dict):
                raise self.fail(where, f"{where}: expected a mapping, got {_kind(value)}")
            return {str(k): self.convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # a port in a command line, say
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise self.fail(where, f"{where}: expected {_NAMES.get(hint, hint.__name__)}, got {_kind(value)}")
        return value


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{type(value).__name__} {value!r}"
