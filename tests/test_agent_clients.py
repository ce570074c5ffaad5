"""Real agent frameworks, unchanged, complete a two-step tool-using task against ``draftwise serve``: the OpenAI
Agents SDK (its chat-completions model and its default Responses model), smolagents' ``ToolCallingAgent``
(``tool_choice="required"``) and langchain-openai's ``bind_tools``. The model is the scripted
:func:`tool_agents.tool_model` behind the real server and engine, speculating with n-gram lookup; no network."""

from __future__ import annotations

import asyncio
import os

import pytest

from draftwise.builder import EngineBundle
from draftwise.engine import one_slot_core
from draftwise.server import ServerSettings, create_app
from test_server import live_server
from tool_agents import HERMES_TEMPLATE, tool_model


@pytest.fixture(scope="module")
def agent_url(stories):
    model = tool_model(stories)
    bundle = EngineBundle(target=model, core=one_slot_core(model.backend, eos_token_ids=model.eos_token_ids))
    settings = ServerSettings(served_model_names=("tool-model",), chat_template=HERMES_TEMPLATE)
    with live_server(create_app(bundle, settings)) as url:
        yield f"{url}/v1"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_a_tool_and_answers(agent_url, api, monkeypatch):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=agent_url, api_key="unused", max_retries=0)
    model = (agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel)(
        model="tool-model", openai_client=client)
    calls = []

    @agents.function_tool
    def add_tool(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    add_tool.name = "add"
    agent = agents.Agent(name="adder", instructions="Use tools.", tools=[add_tool], model=model)
    result = asyncio.run(agents.Runner.run(agent, "What is 2 + 3?", max_turns=4))
    assert calls == [(2, 3)]
    assert result.final_output.strip() == "The sum is 5."


def test_smolagents_tool_calling_agent_runs_a_tool_and_answers(agent_url):
    smolagents = pytest.importorskip("smolagents")
    tool = smolagents.tool(add)
    model = smolagents.OpenAIServerModel(model_id="tool-model", api_base=agent_url, api_key="unused")
    agent = smolagents.ToolCallingAgent(tools=[tool], model=model, max_steps=4, verbosity_level=0)
    answer = agent.run("What is 2 + 3?")
    assert str(answer).strip() == "The sum is 5."


def test_langchain_bind_tools_reads_the_call(agent_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="tool-model", base_url=agent_url, api_key="unused", max_retries=0)
    message = llm.bind_tools([add]).invoke("What is 2 + 3?")
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [("add", {"a": 2, "b": 3})]


def _bench_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "agent_clients.py"
    spec = importlib.util.spec_from_file_location("agent_clients_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_agent_clients_script_compares_two_servers_and_logs_what_each_client_sent(agent_url, capsys):
    script = _bench_script()
    server = agent_url.removesuffix("/v1")
    assert script.main(["--spec-url", server, "--plain-url", server, "--only", "openai-sdk"]) == 0
    out = capsys.readouterr().out
    assert "## openai-sdk chat loop: identical" in out and "('add', {'a': 2, 'b': 3})" in out
    spec, plain = script.RequestLog(), script.RequestLog()
    spec.bodies = [{"messages": [{"role": "user", "content": "x"}]}, {"messages": [{"role": "tool", "content": "1"}]}]
    plain.bodies = [{"messages": [{"role": "user", "content": "x"}]}, {"messages": [{"role": "tool", "content": "2"}]}]
    assert script.first_difference(spec, plain).startswith("request 1, message 0:")
    assert script.first_difference(spec, spec) == ""
