"""A scripted tool-using "model" behind the real server, for driving real clients (the ``openai`` SDK, the OpenAI
Agents SDK, smolagents, langchain-openai) through whole agent loops without network or a large model.

:func:`tool_model` builds a :class:`~draftwise.models.loading.LoadedModel` whose backend is a
:class:`fakes.ReplyLM` with stories260K's real tokenizer and :data:`HERMES_TEMPLATE`, a Qwen2.5-style chat template
(tools in ``<tools>``, calls as ``<tool_call>`` JSON, results in ``<tool_response>``). Its reply is read off the
prompt by :func:`scripted_reply`: asked with an ``add`` tool, it calls ``add(a=2, b=3)``; shown the tool's
result, it answers with it (through smolagents' ``final_answer`` tool when that tool is offered). Offered the
coding tools of :mod:`draftwise.tool_agent_bench` (``run_tests`` among them), it plays :func:`coding_reply`.
"""

from __future__ import annotations

import json
import re

from draftwise.models.loading import LoadedModel
from fakes import ReplyLM

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' %}\n<|im_start|>assistant\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>"
    "{%- elif m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- else %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}\n<|im_start|>assistant\n")

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def scripted_reply(prompt: str) -> str:
    """What the scripted model answers to ``prompt`` (the templated conversation)."""
    turns = "".join(turn for turn in prompt.split("<|im_start|>") if not turn.startswith("system"))
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", turns, re.S)
    if '"name": "run_tests"' in prompt:
        return coding_reply(prompt.count("<|im_start|>assistant") - 1, results)
    observation = re.findall(r"Observation:\s*(.*?)(?:<\|im_end\|>|$)", turns, re.S)  # smolagents' tool turns
    if results or observation:
        result = (results or observation)[-1].strip()
        if '"name": "final_answer"' in prompt:
            return CALL.format(name="final_answer", arguments=json.dumps({"answer": f"The sum is {result}."}))
        return f"The sum is {result}."
    if '"name": "add"' in prompt and "As a code block." in prompt:  # Qwen2.5-Coder's habit in tool_choice auto
        return "```json\n" + json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}}, indent=2) + "\n```"
    if '"name": "add"' in prompt:
        call = CALL.format(name="add", arguments=json.dumps({"a": 2, "b": 3}))
        # smolagents forces a call (tool_choice "required": the grammar admits no text before it)
        return call if '"name": "final_answer"' in prompt else "I will add them.\n" + call
    return "Hello! Ask me to add two numbers."


BUG = "def subtract(a, b):\n    return a + b"


def coding_reply(step: int, results: list[str]) -> str:
    """A coding agent's reply at model call ``step`` (0-based) of a tool session, given the tool results so far:
    list the files and read ``calc.py`` (two calls in one reply), write it back with :data:`BUG` fixed,
    run the tests, then answer with the tests' last line. Reads the file from the tool result, so the write
    copies the context (what n-gram and suffix drafts find)."""
    if step == 0:
        return ("Let me look at the code.\n" + CALL.format(name="list_files", arguments="{}") + "\n"
                + CALL.format(name="read_file", arguments=json.dumps({"path": "calc.py"})))
    if step == 1:
        fixed = results[-1].replace(BUG, BUG.replace("a + b", "a - b"))
        return CALL.format(name="write_file", arguments=json.dumps({"path": "calc.py", "content": fixed}))
    if step == 2:
        return CALL.format(name="run_tests", arguments="{}")
    return f"Fixed subtract: {results[-1].splitlines()[-1] if results else 'no results'}"


def tool_model(stories: LoadedModel, name: str = "tool-model") -> LoadedModel:
    """A :class:`LoadedModel` answering with :func:`scripted_reply`, on stories260K's tokenizer."""
    tokenizer = stories.tokenizer
    eos = stories.eos_token_ids[0]

    def reply(prompt_ids: list[int]) -> list[int]:
        text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        ids = tokenizer.encode(scripted_reply(text), add_special_tokens=False)
        # SentencePiece's dummy prefix: a reply starting with a character it does not merge with (``<tool_call>``)
        # opens with a lone "▁" (a space the text does not have), which a forced call's grammar refuses; the
        # model would then sample among the grammar's tokens at random and lose its place in the script
        return ids[1:] if ids and tokenizer.convert_ids_to_tokens(ids[0]) == "\u2581" else ids

    backend = ReplyLM(reply, vocab_size=stories.backend.vocab_size, eos=eos, max_context=32768, name=name)
    return LoadedModel(backend=backend, tokenizer=tokenizer, name=name, eos_token_ids=(eos,))
