"""The ``inferd`` command: arguments -> one config dataclass -> constructors."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inferd.bench.config import BenchConfig, add_arguments as _bench_args, config_from_args as _bench_config
from inferd.gateway import keys_cli
from inferd.sampling_params import SamplingParams

if TYPE_CHECKING:  # both import torch; `inferd keys`, `gateway` and `bench` never need it
    from inferd.gateway.config import GatewayConfig
    from inferd.config import EngineConfig
    from inferd.server.config import ServerConfig


@dataclass
class GenerateConfig:
    engine: EngineConfig
    params: SamplingParams
    prompt: str
    # Wrap the prompt as a user message in the model's chat template.
    chat: bool = False


@dataclass
class GatewayCommand:
    config: GatewayConfig
    log_format: str = "plain"
    log_level: str = "info"


@dataclass
class ChatConfig:
    engine: EngineConfig
    params: SamplingParams
    system: str | None = None


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--quantization", default="none", choices=["none", "int8", "int4"], help="weight-only quantization of the linear layers, CPU only (default: none)")
    g.add_argument("--quant-group-size", type=int, default=32, choices=[32, 64, 128], help="int4 group size (default: 32)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV-cache memory (default: min(4 GiB, 20%% of RAM))")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget per engine step")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not share the K/V of identical prompt prefixes")
    g.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: one per core)")
    g.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL", help="speculative decoding: prompt-lookup n-grams or a draft model (default: off)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens per step with --speculative")
    g.add_argument("--speculative-max-batch", type=int, default=4, help="propose drafts only while at most this many requests run")
    g.add_argument("-v", "--verbose", action="store_true", help="log engine events")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
    g.add_argument("--temperature", "-t", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="Self-hostable AI inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="print a completion of PROMPT")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send PROMPT as a user message through the chat template")
    _engine_args(gen)
    _sampling_args(gen, max_tokens=128)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="GGUF file or Hugging Face directory (default: the embedded model)")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="the `model` clients pass (default: the model file's name)")
    g.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024, help="larger request bodies get 413")
    g.add_argument("--max-waiting-requests", type=int, default=256, help="beyond this many queued requests, 503")
    g.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    g.add_argument("--otlp-endpoint", default=None, help="OTLP/HTTP collector URL for traces and GenAI metrics, e.g. http://127.0.0.1:4318 (default: off)")
    g.add_argument("--log-format", default="plain", choices=["plain", "json"])
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--data-dir", default=None, help="the Batch API's files and jobs (default: $INFERD_HOME, else ~/.inferd)")
    g.add_argument("--max-file-bytes", type=int, default=200 * 1024 * 1024, help="larger uploads to /v1/files get 413 (default: 200 MiB)")
    _engine_args(serve)

    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_args(chat)
    _sampling_args(chat, max_tokens=512)

    bench = sub.add_parser("bench", help="load-test any OpenAI-compatible server and report latency and throughput")
    _bench_args(bench)

    batch = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) offline, resumably")
    batch.add_argument("input", metavar="IN.jsonl", help="one request per line: custom_id, method, url, body")
    batch.add_argument("output", metavar="OUT.jsonl", help="results, appended as they finish; rerun to resume")
    batch.add_argument("--errors", default=None, metavar="FILE", help="failed and invalid lines (default: OUT.errors.jsonl)")
    batch.add_argument("--max-in-flight", type=int, default=None, help="requests in the engine at once (default: 2 x --max-num-seqs)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    _engine_args(batch)

    gateway = sub.add_parser("gateway", help="run the edge: API keys, rate limits, routing, replicas")
    gateway.add_argument("-c", "--config", required=True, help="the gateway's YAML file (see examples/gateway.yaml)")
    gateway.add_argument("--host", default=None, help="listen address (default: the file's, else 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=None, help="listen port (default: the file's, else 8080)")
    gateway.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS (with --tls-key)")
    gateway.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    gateway.add_argument("--data-dir", default=None, help="keys, usage and replica logs (default: $INFERD_HOME, else ~/.inferd)")
    gateway.add_argument("--log-format", default="plain", choices=["plain", "json"])
    gateway.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    keys = sub.add_parser("keys", help="create, list and revoke the gateway's API keys")
    keys_cli.add_arguments(keys)
    return parser


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    from inferd.config import EngineConfig

    return EngineConfig(
        model=a.model,
        dtype=a.dtype,
        device=a.device,
        quantization=a.quantization,
        quantization_group_size=a.quant_group_size,
        max_model_len=a.max_model_len,
        kv_cache_memory_gb=a.kv_cache_memory_gb,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=not a.no_prefix_caching,
        num_threads=a.threads,
        speculative=a.speculative,
        num_speculative_tokens=a.num_speculative_tokens,
        speculative_max_batch=a.speculative_max_batch,
    )


def _sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        repetition_penalty=a.repetition_penalty,
        seed=a.seed,
        stop=a.stop,
        ignore_eos=a.ignore_eos,
    )


def _server_config(a: argparse.Namespace) -> ServerConfig:
    from inferd.server.config import ServerConfig

    if a.model_arg is not None and a.model is not None and a.model_arg != a.model:
        raise ValueError(f"two models given: {a.model_arg!r} and --model {a.model!r}")
    a.model = a.model or a.model_arg
    return ServerConfig(
        engine=_engine_config(a),
        host=a.host,
        port=a.port,
        served_model_name=a.served_model_name,
        max_body_bytes=a.max_body_bytes,
        max_waiting_requests=a.max_waiting_requests,
        shutdown_grace_s=a.shutdown_grace,
        otlp_endpoint=a.otlp_endpoint,
        log_format=a.log_format,
        log_level="debug" if a.verbose else a.log_level,
        data_dir=a.data_dir,
        max_file_bytes=a.max_file_bytes,
    )


def parse_config(argv: list[str] | None = None) -> GenerateConfig | ChatConfig | ServerConfig | BenchConfig | GatewayCommand | argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.command == "keys":  # no config object: keys_cli.run reads the flags itself
        return a
    if a.command == "serve":
        return _server_config(a)
    if a.command == "batch":
        from inferd.batch.config import BatchJobConfig

        return BatchJobConfig(a.input, a.output, _engine_config(a), a.errors, a.max_in_flight, not a.no_progress)
    if a.command == "gateway":
        from inferd.gateway.config import load_config

        overrides = {"host": a.host, "port": a.port, "tls_cert": a.tls_cert, "tls_key": a.tls_key, "data_dir": a.data_dir}
        return GatewayCommand(load_config(a.config, **overrides), a.log_format, a.log_level)
    if a.command == "bench":
        return _bench_config(a)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    engine, params = _engine_config(a), _sampling_params(a)
    if a.command == "generate":
        return GenerateConfig(engine=engine, params=params, prompt=a.prompt, chat=a.chat)
    return ChatConfig(engine=engine, params=params, system=a.system)


def stream(engine, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:  # noqa: ANN001
    """Yield the text of one request as it is generated."""
    engine.add_request("cli", prompt, params)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "cli":
                    yield out.outputs[0].text_delta
    finally:
        engine.abort_request("cli")
        engine.step()


def run_generate(cfg: GenerateConfig) -> None:
    from inferd.engine.engine import LLMEngine

    engine = LLMEngine(cfg.engine)
    prompt: str | list[int] = cfg.prompt
    if cfg.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": cfg.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    else:
        print(cfg.prompt, end="", flush=True)
    for delta in stream(engine, prompt, cfg.params):
        print(delta, end="", flush=True)
    print()


def run_chat(cfg: ChatConfig) -> None:
    from inferd.engine.engine import LLMEngine

    engine = LLMEngine(cfg.engine)
    history: list[dict] = [{"role": "system", "content": cfg.system}] if cfg.system else []
    print("inferd chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = history[:1] if cfg.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(history)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        reply = []
        try:
            for delta in stream(engine, ids, cfg.params):
                print(delta, end="", flush=True)
                reply.append(delta)
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        if isinstance(cfg, argparse.Namespace) and cfg.command == "keys":
            return keys_cli.run(cfg)
        if isinstance(cfg, GatewayCommand):
            from inferd.gateway.launcher import run_gateway

            return run_gateway(cfg.config, cfg.log_format, cfg.log_level)
        if isinstance(cfg, BenchConfig):
            from inferd.bench.main import run

            return run(cfg)
        from inferd.batch.config import BatchJobConfig
        from inferd.server.config import ServerConfig

        if isinstance(cfg, BatchJobConfig):
            from inferd.batch.offline import run_batch

            return run_batch(cfg)
        if isinstance(cfg, ServerConfig):
            from inferd.server.launcher import serve

            return serve(cfg)
        if isinstance(cfg, GenerateConfig):
            run_generate(cfg)
        else:
            run_chat(cfg)
    except ValueError as e:
        print(f"inferd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
