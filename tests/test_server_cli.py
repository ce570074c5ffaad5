"""``draftwise serve``: flag resolution (demo pair, plain, vLLM's --speculative-config) and one real run of the
command in a subprocess, talked to with the openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from draftwise.builder import DEMO_DRAFT, DEMO_TARGET
from draftwise.cli import build_parser
from draftwise.commands.common import CliError
from draftwise.commands.serve import plan_from_args


def plan(*argv: str):
    return plan_from_args(build_parser().parse_args(["serve", *argv]))


def test_no_model_named_serves_the_demo_pair():
    resolved = plan()
    assert resolved.target == DEMO_TARGET
    assert resolved.speculative_config.model == DEMO_DRAFT and resolved.speculative_config.method == "draft_model"
    assert resolved.settings.served_model_names == () and resolved.settings.api_key is None


def test_target_without_draft_is_plain_and_none_forces_plain():
    assert plan("some/model").speculative_config is None
    assert plan("--speculative-model", "none").speculative_config is None
    assert plan("--model", "m.gguf").target == "m.gguf"


def test_vllm_flags():
    resolved = plan("t.gguf", "--speculative-config", '{"method": "draft_model", "model": "d.gguf", '
                    '"num_speculative_tokens": 3}', "--served-model-name", "a", "b", "--api-key", "k",
                    "--max-model-len", "512")
    assert resolved.target == "t.gguf"
    assert resolved.speculative_config.model == "d.gguf" and resolved.speculative_config.num_speculative_tokens == 3
    assert resolved.settings.served_model_names == ("a", "b") and resolved.settings.api_key == "k"
    flags = plan("t.gguf", "--speculative-model", "d.gguf", "--num-speculative-tokens", "7")
    assert flags.speculative_config.num_speculative_tokens == 7


def test_chat_template_from_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert plan("t", "--chat-template", str(path)).settings.chat_template == "{{ messages[0]['content'] }}"
    assert plan("t", "--chat-template", "{% for m in messages %}{% endfor %}").settings.chat_template
    with pytest.raises(CliError, match="chat-template"):
        plan("t", "--chat-template", str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("argv", [["a", "--model", "b"], ["t", "--default-max-tokens", "0"], ["t", "--port", "-1"]])
def test_bad_flags_are_cli_errors(argv):
    with pytest.raises(CliError):
        plan(*argv)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_end_to_end(draftwise_home, stories_path):
    port = _free_port()
    env = {**os.environ, "DRAFTWISE_HOME": str(draftwise_home), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "draftwise.cli", "serve", str(stories_path), "--speculative-model",
           str(stories_path), "--num-speculative-tokens", "2", "--port", str(port), "--served-model-name", "tiny",
           "--api-key", "secret", "--device", "cpu"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}/health")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0, timeout=60)
        result = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
        assert result.usage.completion_tokens == 12 and result.choices[0].text
        assert result.usage.speculative["acceptance_rate"] == 1.0  # the draft is the target itself
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "OpenAI-compatible API at http://127.0.0.1" in output and "Traceback" not in output


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("serve did not become healthy")
