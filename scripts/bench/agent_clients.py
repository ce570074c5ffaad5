#!/usr/bin/env python
"""Real agent frameworks, unchanged, against two running servers: one speculating, one not. Each framework runs the
same tool-using task on both; the script prints, per framework, the tool calls made and the final answer on each
server and whether they are identical (greedy: they must be).

Frameworks (each skipped with a note when its package is missing): the ``openai`` SDK's chat loop with tools, the
OpenAI Agents SDK (its chat-completions model and its default Responses model), smolagents' ``ToolCallingAgent``
(``tool_choice="required"``), langchain-openai's ``bind_tools`` loop and ``with_structured_output`` (a strict
``json_schema``).

Example (the README's command, and the same target without a draft)::

    draftwise serve qwen2.5-coder-1.5b --speculative-model qwen2.5-coder-0.5b --num-speculative-tokens 5 --port 8001 &
    draftwise serve qwen2.5-coder-1.5b --port 8002 &
    python scripts/bench/agent_clients.py --spec-url http://127.0.0.1:8001 --plain-url http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable

TASK = "Compute (17 * 23) + 4 with the tools, one step at a time, then state the result."
SYSTEM = "You are a careful assistant. Use the provided tools for every arithmetic step."


class RequestLog:
    """The request bodies one framework sends to one server, in order (httpx event hooks on the clients the
    frameworks are given), to tell where two runs first differ: in what the client sent, or in what a server
    answered to the same request."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def _record(self, request) -> None:
        try:
            self.bodies.append(json.loads(request.content or b"{}"))
        except ValueError:
            self.bodies.append({"unparsed": request.content.decode(errors="replace")})

    def sync_client(self):
        import httpx

        return httpx.Client(timeout=600, event_hooks={"request": [self._record]})

    def async_client(self):
        import httpx

        async def record(request) -> None:
            self._record(request)

        return httpx.AsyncClient(timeout=600, event_hooks={"request": [record]})


def first_difference(spec: RequestLog, plain: RequestLog) -> str:
    """Where two runs' requests first differ (``""`` when every request both sent is the same): the request's
    index and the first differing message or field."""
    for index, (a, b) in enumerate(zip(spec.bodies, plain.bodies)):
        if a == b:
            continue
        messages_a, messages_b = a.get("messages") or a.get("input") or [], b.get("messages") or b.get("input") or []
        if isinstance(messages_a, list) and isinstance(messages_b, list):
            for turn, (x, y) in enumerate(zip(messages_a, messages_b)):
                if x != y:
                    return f"request {index}, message {turn}: spec sent {x!r:.300} / plain sent {y!r:.300}"
        keys = sorted(key for key in set(a) | set(b) if a.get(key) != b.get(key))
        return f"request {index}: fields {keys} differ"
    if len(spec.bodies) != len(plain.bodies):
        return f"same first {min(len(spec.bodies), len(plain.bodies))} requests, then one run sent more"
    return ""


class Calculator:
    """The task's tools, recording every call (name, arguments) in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        self.calls.append(("multiply", {"a": a, "b": b}))
        return a * b

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first term.
            b: the second term.
        """
        self.calls.append(("add", {"a": a, "b": b}))
        return a + b


def _schema(name: str, doc: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def openai_loop(base_url: str, model: str, log: RequestLog) -> tuple[list, str]:
    """The plain ``openai`` SDK: chat with tools, run each call, send the results back, until a reply without
    calls (at most 6 model calls)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600,
                           http_client=log.sync_client())
    calc = Calculator()
    tools = [_schema("multiply", "Multiply two integers"), _schema("add", "Add two integers")]
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for _ in range(6):
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                               max_tokens=512).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return calc.calls, reply.content or ""
        for call in reply.tool_calls:
            result = getattr(calc, call.function.name)(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return calc.calls, "(no final answer after 6 calls)"


def agents_sdk(base_url: str, model: str, log: RequestLog, api: str) -> tuple[list, str]:
    """The OpenAI Agents SDK with two function tools; ``api``: ``chat`` or ``responses`` (its default)."""
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600,
                         http_client=log.async_client())
    model_class = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
    calc = Calculator()
    agent = agents.Agent(name="calculator", instructions=SYSTEM, model=model_class(model=model, openai_client=client),
                         tools=[agents.function_tool(calc.multiply), agents.function_tool(calc.add)],
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=512))
    result = asyncio.run(agents.Runner.run(agent, TASK, max_turns=6))
    return calc.calls, str(result.final_output)


def smolagents_agent(base_url: str, model: str, log: RequestLog) -> tuple[list, str]:
    """smolagents' ToolCallingAgent (it sends ``tool_choice="required"``)."""
    import smolagents

    calc = Calculator()
    tools = [smolagents.tool(calc.multiply), smolagents.tool(calc.add)]
    llm = smolagents.OpenAIServerModel(model_id=model, api_base=f"{base_url}/v1", api_key="unused", temperature=0,
                                       max_tokens=512, client_kwargs={"http_client": log.sync_client()})
    agent = smolagents.ToolCallingAgent(tools=tools, model=llm, max_steps=6, verbosity_level=0)
    return calc.calls, str(agent.run(TASK))


def langchain_tools(base_url: str, model: str, log: RequestLog) -> tuple[list, str]:
    """langchain-openai: ``bind_tools`` in a loop, then ``with_structured_output`` (strict json_schema)."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    calc = Calculator()
    llm = ChatOpenAI(model=model, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=512,
                     max_retries=0, http_client=log.sync_client())
    bound = llm.bind_tools([calc.multiply, calc.add])
    messages = [SystemMessage(SYSTEM), HumanMessage(TASK)]
    for _ in range(6):
        reply = bound.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(str(getattr(calc, call["name"])(**call["args"])), tool_call_id=call["id"]))

    class Answer(BaseModel):
        expression: str
        result: int

    structured = llm.with_structured_output(Answer, method="json_schema", strict=True).invoke(TASK)
    return calc.calls, f"{reply.content!s} | structured: {structured.model_dump_json()}"


FRAMEWORKS: dict[str, Callable[[str, str, RequestLog], tuple[list, str]]] = {
    "openai-sdk chat loop": openai_loop,
    "agents-sdk chat model": lambda url, model, log: agents_sdk(url, model, log, "chat"),
    "agents-sdk responses model": lambda url, model, log: agents_sdk(url, model, log, "responses"),
    "smolagents ToolCallingAgent": smolagents_agent,
    "langchain bind_tools + structured": langchain_tools,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec-url", required=True)
    parser.add_argument("--plain-url", required=True)
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--only", default=None, help="comma-separated framework names (substring match)")
    args = parser.parse_args(argv)
    import httpx

    model = args.model or httpx.get(f"{args.spec_url}/v1/models", timeout=30).json()["data"][0]["id"]
    failures = 0
    for name, run in FRAMEWORKS.items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        outcome, logs = {}, {"spec": RequestLog(), "plain": RequestLog()}
        for label, url in (("spec", args.spec_url), ("plain", args.plain_url)):
            started = time.perf_counter()
            try:
                calls, answer = run(url, model, logs[label])
                outcome[label] = (calls, answer, time.perf_counter() - started)
            except ImportError as exc:
                print(f"{name}: skipped ({exc})")
                break
            except Exception as exc:  # noqa: BLE001 - a framework's failure is reported, not fatal
                outcome[label] = ([], f"FAILED: {type(exc).__name__}: {exc}", time.perf_counter() - started)
        if len(outcome) < 2:
            continue
        same = outcome["spec"][:2] == outcome["plain"][:2]
        failures += not same or outcome["spec"][1].startswith("FAILED")
        print(f"## {name}: {'identical' if same else 'DIFFERENT'}; spec {outcome['spec'][2]:.1f} s, "
              f"plain {outcome['plain'][2]:.1f} s")
        for label in ("spec", "plain"):
            calls, answer, _ = outcome[label]
            print(f"  {label}: calls {calls}")
            print(f"  {label}: answer {answer[:300]!r}")
        if not same:
            where = first_difference(logs["spec"], logs["plain"])
            print(f"  first difference in the requests sent: {where or 'none: same requests, different replies'}")
        sys.stdout.flush()
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    sys.exit(main())
