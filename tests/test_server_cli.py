"""``draftwise serve``: flag resolution (demo pair, plain, vLLM's --speculative-config) and one real run of the
command, talked to with the openai client."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from draftwise.builder import DEMO_DRAFT, DEMO_TARGET
from draftwise.cli import build_parser, main
from draftwise.commands.common import CliError
from draftwise.commands.serve import plan_from_args
from draftwise.server.serving import DrainingServer


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


def test_the_draft_runtime_defaults_to_the_measured_one():
    """`serve T --speculative-model D` gets `--speculative-backend auto` (the measured runtime for one request at a
    time, the lean draft in the batched engine); a flag or the JSON's own field wins, a target on llama.cpp keeps
    its draft there, and plain decoding gets no backend."""
    assert plan("t.gguf", "--speculative-model", "d.gguf").speculative_config.backend == "auto"
    hybrid = plan("t.gguf", "--speculative-config", '{"method": "hybrid", "model": "d.gguf"}')
    assert hybrid.speculative_config.backend == "auto"
    assert plan("t.gguf", "--speculative-model", "d.gguf", "--speculative-backend", "torch").speculative_config.backend \
        == "torch"
    json_field = plan("t.gguf", "--speculative-config", '{"model": "d.gguf", "backend": null}')
    assert json_field.speculative_config.backend is None
    assert plan("t.gguf", "--backend", "llama.cpp", "--speculative-model", "d.gguf").speculative_config.backend is None
    assert plan("t.gguf", "--speculative-model", "none").speculative_config is None
    assert plan("t.gguf", "--speculative-config", '{"method": "ngram"}').speculative_config.backend is None


def test_chat_template_from_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert plan("t", "--chat-template", str(path)).settings.chat_template == "{{ messages[0]['content'] }}"
    assert plan("t", "--chat-template", "{% for m in messages %}{% endfor %}").settings.chat_template
    with pytest.raises(CliError, match="chat-template"):
        plan("t", "--chat-template", str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("template, error", [("{% for %}", "TemplateSyntaxError"),
                                             ("{{ messages[5]['content'] }}", "UndefinedError"),
                                             ("{{ raise_exception('no system prompt') }}", "no system prompt")])
def test_a_chat_template_that_fails_is_refused_at_start(template, error):
    """Found by a new-user test: such a template was accepted, and every chat request then got a 400 that
    blamed the client's messages."""
    with pytest.raises(CliError, match=error):
        plan("t", "--chat-template", template)


@pytest.mark.parametrize("argv", [["a", "--model", "b"], ["t", "--default-max-tokens", "0"], ["t", "--port", "-1"],
                                  ["t", "--max-num-seqs", "0"], ["t", "--max-num-batched-tokens", "0"]])
def test_bad_flags_are_cli_errors(argv):
    with pytest.raises(CliError):
        plan(*argv)


def test_the_prefix_cache_budget_defaults_to_a_share_of_available_memory(monkeypatch):
    """Found in a benchmark: four servers with a fixed 4 GiB each on a 24 GiB machine, one killed by the kernel.
    Unset, --kv-cache-memory is resolved at start from the memory available then; a value given is used as is."""
    import draftwise.builder as builder

    monkeypatch.setattr(builder, "available_ram", lambda: 10 * 2**30)
    assert build_parser().parse_args(["serve"]).kv_cache_memory is None
    default = plan("t").kv_cache
    assert default.nbytes == 10 * 2**30 // 4
    assert default.describe() == "prefix cache: 2.50 GiB (1/4 of 10.0 GiB available; cap 4.00 GiB)"
    assert plan("t", "--kv-cache-memory", "512MiB").kv_cache.nbytes == 512 * 2**20
    assert plan("t", "--kv-cache-memory", "0").kv_cache.describe() == "prefix cache: off (--kv-cache-memory)"
    monkeypatch.setattr(builder, "available_ram", lambda: None)
    assert plan("t").kv_cache.nbytes == builder.DEFAULT_KV_CACHE_MEMORY


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_end_to_end(draftwise_home, stories_path, monkeypatch):
    """``draftwise serve`` through the CLI entry point, in-process (a subprocess would pay torch's and
    transformers' imports again). ``DrainingServer.run`` is wrapped only to keep a handle that stops the
    server."""
    servers: list[DrainingServer] = []
    original_run = DrainingServer.run

    def run_and_keep(self, *args, **kwargs):
        servers.append(self)
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(DrainingServer, "run", run_and_keep)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model on a shared machine: avoid OpenMP barrier stalls
    port = _free_port()
    argv = ["serve", str(stories_path), "--speculative-model", str(stories_path), "--speculative-backend", "torch",
            "--num-speculative-tokens", "2",
            "--port", str(port), "--served-model-name", "tiny", "--api-key", "secret", "--device", "cpu",
            "--uvicorn-log-level", "warning"]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    thread.start()
    try:
        _wait_healthy(thread, servers, f"http://127.0.0.1:{port}/health")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0, timeout=60)
        result = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
        assert result.usage.completion_tokens == 12 and result.choices[0].text
        assert result.usage.speculative["acceptance_rate"] == 1.0  # the draft is the target itself
        assert result.usage.speculative["num_speculative_tokens"] == 2
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(30)
        torch.set_num_threads(old_threads)
    assert codes == [0]


@pytest.mark.parametrize("method", ["draft_model", "hybrid"])
def test_serve_command_batches_a_lean_target(draftwise_home, stories_path, monkeypatch, method):
    """``--quantization int8`` (the lean runtime) with ``--max-num-seqs 3``: the server batches, with a batched
    draft model (alone, or beside suffix decoding in ``hybrid``) and the load-aware K (calibrated at start);
    concurrent requests get the texts they get alone."""
    from draftwise.backends.quantization import int8_kernels_available

    if not int8_kernels_available():
        pytest.skip("torch build without fbgemm int8 kernels")
    servers: list[DrainingServer] = []
    original_run = DrainingServer.run

    def run_and_keep(self, *args, **kwargs):
        servers.append(self)
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(DrainingServer, "run", run_and_keep)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    port = _free_port()
    config = '{"method": "%s", "model": "%s", "num_speculative_tokens": 3, "k_policy": "auto"}' % (method, stories_path)
    argv = ["serve", str(stories_path), "--speculative-config", config, "--quantization", "int8",
            "--max-num-seqs", "3", "--port", str(port), "--served-model-name", "tiny", "--device", "cpu",
            "--uvicorn-log-level", "warning"]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    thread.start()
    try:
        _wait_healthy(thread, servers, f"http://127.0.0.1:{port}/health")
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["max_num_seqs"] == 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        prompts = ["Once upon a time", "The little dog", "Lily and Ben", "One day, Tom"]
        alone = {p: client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0) for p in prompts}
        for p in prompts:
            assert alone[p].usage.completion_tokens == 12
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=12,
                                                                          temperature=0), prompts))
        assert [r.choices[0].text for r in together] == [alone[p].choices[0].text for p in prompts]
        assert all(r.usage.speculative["num_speculative_tokens"] == 3 for r in together)
        assert {r.usage.speculative["method"] for r in together} == {method}
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(30)
        torch.set_num_threads(old_threads)
    assert codes == [0]


def _wait_healthy(thread: threading.Thread, servers: list, url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert thread.is_alive(), "serve exited early"
        if servers and servers[0].started and httpx.get(url, timeout=5).status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError("serve did not become healthy")


def test_a_port_in_use_is_refused_before_any_model_loads(stories_path, monkeypatch, capsys):
    """Found by a new-user test: a taken port was reported by uvicorn only after the models had loaded."""
    import draftwise.builder as builder
    from draftwise.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the port was checked")

    monkeypatch.setattr(builder, "build_engine", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(stories_path), "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
