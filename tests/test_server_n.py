"""``n`` > 1 choices: in the engine core, the choices of one request share the prompt's KV state (the first
prefills it, the others fork it from its slot: :mod:`draftwise.engine.prefix_reuse`) and run as a batch, each
equal to the same request run alone with seed + i; through the server, choices carry their index in bodies and
streamed chunks, each with its own logprobs, usage counts the prompt once, ``best_of`` returns the ``n`` choices
of highest cumulative logprob, and bad ``n`` / ``best_of`` values are 400s naming the field."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from conftest import tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.builder import EngineBundle
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import EngineCore, SpeculativeEngine
from draftwise.proposers.base import PerSequenceProposers
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.speculation.cost_model import PassCostCurve
from draftwise.proposers.ngram import NgramProposer
from draftwise.server import ServerSettings, create_app
from test_server import CHAT_TEMPLATE, live_server, metric, one_torch_thread  # noqa: F401  (fixture)

SLOTS = 4
PROMPT = [5, 17, 3, 44, 9, 12, 30, 7, 21, 2, 8, 60, 33]


@pytest.fixture(scope="module")
def tiny_multi():
    return build_lean(tiny_llama(0).model, quantization="none", name="tiny-n", num_slots=SLOTS)


@pytest.fixture(scope="module")
def tiny_single():
    return build_lean(tiny_llama(0).model, quantization="none", name="tiny-n1")


def run_choices(core: EngineCore, prompt: list[int], params: list[SamplingParams]):
    """Add the choices as the server does (the first prefills, the others fork its prompt); run them to the
    end; returns the sequences and the prompt rows every step's pass carried."""
    first = core.add(prompt, params[0])
    sequences = [first] + [core.add(prompt, p, prompt_source=first) for p in params[1:]]
    prefill_rows = 0
    while core.has_work:
        core.step()
        if core.last_step is not None:
            prefill_rows += core.last_step.prefill_rows
    return sequences, prefill_rows


def proposer_of(method: str):
    if method == "ngram":
        return PerSequenceProposers(lambda: NgramProposer(1, 3), "ngram")
    if method == "draft":  # a different tiny model as the draft: some drafts rejected
        draft = build_lean(tiny_llama(1).model, quantization="none", name="tiny-draft", num_slots=SLOTS)
        return DraftModelProposer(draft, draft.vocab_size, slot_per_sequence=True)
    return None


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_seeded_choices_equal_separate_requests_with_seed_plus_i(tiny_multi, tiny_single, method):
    core = EngineCore(tiny_multi, proposer_of(method), 3, max_num_seqs=SLOTS, min_prefill_tokens=4,
                      max_num_batched_tokens=8, pass_costs=PassCostCurve(points={1: 1.0, 64: 1.5}),
                      learn_costs=False)
    base = SamplingParams(temperature=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    params = [dataclasses.replace(base, seed=base.seed + i) for i in range(3)]
    sequences, prefill_rows = run_choices(core, PROMPT, params)
    alone = [SpeculativeEngine(tiny_single).generate(PROMPT, p).token_ids for p in params]
    assert [s.result.token_ids for s in sequences] == alone
    assert len({tuple(a) for a in alone}) > 1  # the seeds differ, so do the choices
    # the prompt ran once; each other choice fed only its last prompt token over the forked KV
    assert prefill_rows == len(PROMPT) + len(params) - 1
    assert [s.stats.num_cached_prompt_tokens for s in sequences] == [0] + [len(PROMPT) - 1] * (len(params) - 1)
    if method != "plain":
        assert all(s.stats.num_draft_tokens > 0 for s in sequences)  # every choice speculated


def test_greedy_choices_are_identical_and_the_prompt_is_computed_once(tiny_multi, tiny_single):
    core = EngineCore(tiny_multi, max_num_seqs=SLOTS)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    sequences, prefill_rows = run_choices(core, PROMPT, [greedy] * SLOTS)
    oracle = SpeculativeEngine(tiny_single).generate(PROMPT, greedy).token_ids
    assert all(s.result.token_ids == oracle for s in sequences)
    assert prefill_rows == len(PROMPT) + SLOTS - 1


def test_a_choice_waits_for_its_siblings_prompt_then_forks_it(tiny_multi):
    core = EngineCore(tiny_multi, max_num_seqs=SLOTS, max_num_batched_tokens=4, min_prefill_tokens=4)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    first = core.add(PROMPT, greedy)
    second = core.add(PROMPT, greedy, prompt_source=first)
    core.step()  # 4 of 13 prompt tokens: the second choice may not start yet
    assert first.slot >= 0 and second.slot < 0 and core.num_waiting == 1
    while first.prompt_left:
        core.step()
    core.step()
    assert second.slot >= 0 and second.num_computed >= len(PROMPT) - 1


def test_choices_asking_for_prompt_logprobs_prefill_their_own_prompts_at_once(tiny_multi, tiny_single):
    core = EngineCore(tiny_multi, max_num_seqs=SLOTS, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    first = core.add(PROMPT, params)
    second = core.add(PROMPT, params, prompt_source=first)
    core.step()  # nothing to fork (every prompt row's logits are needed): both start in the first step
    assert first.slot >= 0 and second.slot >= 0
    while core.has_work:
        core.step()
    alone = SpeculativeEngine(tiny_single).generate(PROMPT, params)
    assert len(alone.prompt_logprobs) == len(PROMPT) and len(alone.logprobs) == 4
    for sequence in (first, second):
        assert sequence.result.prompt_logprobs == alone.prompt_logprobs
        assert sequence.result.logprobs == alone.logprobs and sequence.result.token_ids == alone.token_ids


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def url(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    target = load_model(str(stories_path), quantization="none", runtime="lean", num_slots=SLOTS)
    core = EngineCore(target.backend, PerSequenceProposers(lambda: NgramProposer(1, 3), "ngram"), 3,
                      eos_token_ids=target.eos_token_ids)
    bundle = EngineBundle(target=target, core=core,
                          speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    settings = ServerSettings(served_model_names=("stories",), chat_template=CHAT_TEMPLATE)
    with live_server(create_app(bundle, settings)) as served:
        yield served


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=120)


def completion(url: str, **body) -> dict:
    response = post(url, "/v1/completions", **body)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_choices_equal_single_requests_with_seed_plus_i(url):
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    together = completion(url, n=3, seed=77, **body)
    alone = [completion(url, seed=77 + i, **body) for i in range(3)]
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [c["text"] for c in together["choices"]] == [a["choices"][0]["text"] for a in alone]
    usage = together["usage"]
    assert usage["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone) == 48
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_greedy_chat_choices_are_identical(url):
    response = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Tell me a story"}], n=2,
                    max_tokens=12, temperature=0)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["message"] == choices[1]["message"]


def stream_chunks(url: str, path: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={"model": "stories", "stream": True, **body},
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_carry_their_index_and_equal_the_bodies(url, path):
    body = {"max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True, "n": 3}
    body |= {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": [{"role": "user",
                                                                                    "content": "Once upon"}]}
    whole = post(url, path, **body).json()
    chunks = stream_chunks(url, path, stream_options={"include_usage": True}, **body)
    texts, reasons = {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        part = choice["text"] if path == "/v1/completions" else choice["delta"].get("content") or ""
        texts[choice["index"]] = texts.get(choice["index"], "") + part
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    read = (lambda c: c["text"]) if path == "/v1/completions" else (lambda c: c["message"]["content"])
    assert texts == {c["index"]: read(c) for c in whole["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 30


@pytest.mark.parametrize("extra, param", [({"n": SLOTS + 1}, "n"), ({"n": 0}, "n"),
                                          ({"n": 2, "best_of": 1}, "best_of"), ({"best_of": SLOTS + 1}, "best_of"),
                                          ({"best_of": 2, "stream": True}, "best_of"),
                                          ({"n": 2, "seed": 2**63 - 1}, "seed")])
def test_bad_n_and_best_of_are_400s_naming_the_field(url, extra, param):
    response = post(url, "/v1/completions", prompt="Once", max_tokens=4, **extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_best_of_equal_to_n_is_served(url):
    body = completion(url, prompt="Once", max_tokens=4, n=2, best_of=2, seed=3, temperature=1.0)
    assert len(body["choices"]) == 2


# ---------------------------------------------------------------------------------------------- logprobs, best_of
SAMPLED = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}


def test_each_choice_carries_its_own_logprobs_equal_to_a_single_requests(url):
    together = completion(url, n=2, seed=11, logprobs=2, **SAMPLED)
    alone = [completion(url, seed=11 + i, logprobs=2, **SAMPLED)["choices"][0] for i in range(2)]
    assert [c["index"] for c in together["choices"]] == [0, 1]
    assert [c["logprobs"] for c in together["choices"]] == [a["logprobs"] for a in alone]
    assert together["choices"][0]["logprobs"] != together["choices"][1]["logprobs"]  # seeds 11 and 12 differ
    assert all(len(c["logprobs"]["tokens"]) == 12 for c in together["choices"])


def test_greedy_chat_choices_carry_the_single_requests_logprobs(url):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 10, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    alone = post(url, "/v1/chat/completions", **body).json()["choices"][0]
    choices = post(url, "/v1/chat/completions", n=2, **body).json()["choices"]
    assert [c["logprobs"] for c in choices] == [alone["logprobs"]] * 2
    assert len(alone["logprobs"]["content"]) == 10


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_carry_their_index_and_logprobs(url, path):
    body = {"max_tokens": 10, "temperature": 1.0, "seed": 9, "ignore_eos": True, "n": 2}
    if path == "/v1/completions":
        body |= {"prompt": "Once upon", "logprobs": 1}
        tokens = lambda lp: [(t, v) for t, v in zip(lp["tokens"], lp["token_logprobs"])]  # noqa: E731
    else:
        body |= {"messages": [{"role": "user", "content": "Once upon"}], "logprobs": True, "top_logprobs": 1}
        tokens = lambda lp: [(e["token"], e["logprob"]) for e in lp["content"]]  # noqa: E731
    whole = post(url, path, **body).json()
    streamed: dict[int, list] = {}
    for chunk in stream_chunks(url, path, **body):
        (choice,) = chunk["choices"]
        if choice["logprobs"] is not None:
            streamed.setdefault(choice["index"], []).extend(tokens(choice["logprobs"]))
    assert streamed == {c["index"]: tokens(c["logprobs"]) for c in whole["choices"]}
    assert len(streamed[0]) == len(streamed[1]) == 10 and streamed[0] != streamed[1]


def test_each_choice_echoes_the_prompt_with_its_logprobs_streamed_and_not(url):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1}
    alone = completion(url, **body)["choices"][0]
    assert alone["text"].startswith("Once upon a time") and alone["logprobs"]["token_logprobs"][0] is None
    choices = completion(url, n=2, **body)["choices"]
    assert [(c["text"], c["logprobs"]) for c in choices] == [(alone["text"], alone["logprobs"])] * 2
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    for chunk in stream_chunks(url, "/v1/completions", n=2, **body):
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["logprobs"] is not None:
            tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
    assert texts == {0: alone["text"], 1: alone["text"]}
    assert tokens == {0: alone["logprobs"]["tokens"], 1: alone["logprobs"]["tokens"]}


def cumulative(choice: dict) -> float:
    return sum(choice["logprobs"]["token_logprobs"])


def test_best_of_returns_the_choice_with_the_highest_cumulative_logprob(url):
    body = {**SAMPLED, "prompt": "The little dog"}
    candidates = [completion(url, seed=33 + i, logprobs=0, **body)["choices"][0] for i in range(3)]
    scores = [cumulative(c) for c in candidates]
    best = max(range(3), key=scores.__getitem__)
    assert len(set(scores)) == 3 and best != 0  # the best is not the first generated: the ranking decides
    reply = completion(url, n=1, best_of=3, seed=33, **body)
    assert [c["text"] for c in reply["choices"]] == [candidates[best]["text"]]
    assert reply["choices"][0]["index"] == 0 and reply["choices"][0]["logprobs"] is None  # not asked for
    assert reply["usage"]["completion_tokens"] == 3 * 12  # every candidate generated is counted, as OpenAI bills
    two = completion(url, n=2, best_of=3, seed=33, logprobs=1, **body)["choices"]
    order = sorted(range(3), key=scores.__getitem__, reverse=True)[:2]
    assert [c["text"] for c in two] == [candidates[i]["text"] for i in order]
    assert [c["index"] for c in two] == [0, 1]
    assert [cumulative(c) for c in two] == [scores[i] for i in order]


def test_a_request_of_n_choices_is_recorded_once_with_its_prompt_once(url):
    before = {name: metric(url, f"draftwise:{name}") for name in
              ("request_success_total", "prompt_tokens_total", "generation_tokens_total")}
    body = completion(url, prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0, ignore_eos=True)
    after = {name: metric(url, f"draftwise:{name}") for name in before}
    assert after["request_success_total"] - before["request_success_total"] == 1
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 18
