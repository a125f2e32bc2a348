import subprocess
import sys

import pytest

from inferd.cli import ChatConfig, GenerateConfig, parse_config


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferd", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_parse_generate_flows_into_dataclasses():
    cfg = parse_config(["generate", "hello", "--max-tokens", "5", "--temperature", "0", "--stop", "\n", "--dtype", "float32"])
    assert isinstance(cfg, GenerateConfig)
    assert cfg.prompt == "hello" and cfg.params.max_tokens == 5 and cfg.params.stop == ["\n"]
    assert cfg.engine.dtype == "float32" and cfg.engine.model is None


def test_parse_chat_and_bad_values():
    cfg = parse_config(["chat", "--system", "be brief"])
    assert isinstance(cfg, ChatConfig) and cfg.system == "be brief"
    with pytest.raises(ValueError, match="top_p"):
        parse_config(["generate", "x", "--top-p", "2"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse_config(["generate", "x", "--max-num-seqs", "0"])


def test_parse_serve_flows_into_a_server_config(tmp_path):
    from inferd.server.config import ServerConfig

    model = str(tmp_path / "m.gguf")
    cfg = parse_config(["serve", model, "--port", "9001", "--max-waiting-requests", "8", "--shutdown-grace", "2.5",
                        "--log-format", "json", "--max-num-seqs", "4"])
    assert isinstance(cfg, ServerConfig)
    assert cfg.engine.model == model and cfg.engine.max_num_seqs == 4
    assert (cfg.port, cfg.max_waiting_requests, cfg.shutdown_grace_s, cfg.log_format) == (9001, 8, 2.5, "json")
    assert cfg.host == "127.0.0.1" and cfg.max_body_bytes == 2 * 1024 * 1024
    default = parse_config(["serve"])
    assert default.engine.model is None and default.port == 8000
    with pytest.raises(ValueError, match="two models"):
        parse_config(["serve", model, "--model", "other.gguf"])
    with pytest.raises(ValueError, match="max_waiting_requests"):
        parse_config(["serve", "--max-waiting-requests", "0"])


def test_generate_prints_a_greedy_completion(llm):
    expected = llm.generate(["The capital of France is"], _greedy(8), use_tqdm=False)[0].outputs[0].text
    r = run_cli("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is" + expected + "\n"


def test_generate_reports_bad_input_without_a_traceback():
    r = run_cli("generate", "hi", "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens" in r.stderr and "Traceback" not in r.stderr


def test_chat_answers_then_exits():
    r = run_cli("chat", "--temperature", "0", "--max-tokens", "16", stdin="Say hello.\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 2
    reply = r.stdout.split("> ")[1].strip()
    assert reply and "<|im_" not in reply


def _greedy(n):
    from inferd import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)
