"""Regression (issue 21, item 1): a lean KV cache that grows past its first capacity (1,024 positions) inside
the model's ``torch.inference_mode()`` forward must still accept the in-place writes made outside that mode:
prefix reuse (``import_slot`` / ``import_cache``) at a request's admission and tree compaction
(``move_entries``). Before the fix the grown tensors were inference tensors and every later prefix hit failed
with "Inplace update to inference tensor outside InferenceMode is not allowed".

Multi-turn sessions whose context grows past the slot capacity, on the batched engine, the single engine and
the HTTP server (batched, prefix cache on); every turn succeeds and says what a cold engine (no prefix cache)
says, token for token."""

from __future__ import annotations

import httpx
import pytest
import torch

from draftwise.backends.lean.kv_cache import SlotKVCache
from draftwise.backends.quantization import int8_kernels_available
from draftwise.builder import build_engine
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.prefix_cache import PrefixCache
from draftwise.server import ServerSettings, create_app
from test_server import CHAT_TEMPLATE, live_server, one_torch_thread  # noqa: F401  (fixture)

MODE = "int8" if int8_kernels_available() else "none"
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
INITIAL_CAPACITY = 1024  # SlotKVCache's default first capacity: the sessions below grow past it


def test_grown_cache_accepts_writes_outside_inference_mode():
    cache = SlotKVCache(1, 2, 1, 4, 4096, block=64, initial=64)
    with torch.inference_mode():
        cache.ensure(300)  # grows inside the forward's mode
        cache.write(0, torch.tensor([0]), torch.tensor([5]), torch.ones(1, 1, 4), torch.ones(1, 1, 4))
        payload = cache.export_slot(0, 200)
    assert cache.capacity >= 300 and not cache.keys[0].is_inference()
    cache.import_slot(1, payload, 200)  # outside inference mode: prefix reuse
    cache.move_entries(1, torch.tensor([5]), 0)  # outside inference mode: tree compaction
    assert torch.equal(cache.keys[0][1, :, 0], torch.ones(1, 4))


STORY = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. "
         "One day they found a big red ball under a tree and they played all day long. ") * 5


def run_session(generate, encode, turns: int = 4) -> tuple[list[list[int]], list[int]]:
    """An agent session: each turn's prompt is the previous turn's prompt and output plus ~300 new tokens, so
    the later turns cross the first cache capacity. ``generate``: prompt ids -> output ids. Returns the
    outputs and the prompt lengths (tokens)."""
    context: list[int] = []
    outputs, lengths = [], []
    for _ in range(turns):
        prompt = context + encode(STORY)
        outputs.append(generate(prompt))
        lengths.append(len(prompt))
        context = prompt + outputs[-1]
    return outputs, lengths


@pytest.fixture(scope="module")
def stories_lean_two_slots(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    return load_model(str(stories_path), quantization=MODE, runtime="lean", num_slots=2)


@pytest.fixture(scope="module")
def stories_lean_one_slot(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    return load_model(str(stories_path), quantization=MODE, runtime="lean")


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_batched_session_past_the_slot_capacity_matches_a_cold_engine(stories_lean_two_slots, method):
    from draftwise.engine import EngineCore
    from draftwise.proposers.base import PerSequenceProposers
    from draftwise.proposers.ngram import NgramProposer
    from draftwise.proposers.suffix import SuffixProposer

    model = stories_lean_two_slots
    factory = (lambda: NgramProposer(1, 3)) if method == "ngram" else SuffixProposer

    def engine(prefix_cache):
        return EngineCore(model.backend, PerSequenceProposers(factory, method), 4,
                             eos_token_ids=model.eos_token_ids, prefix_cache=prefix_cache)

    warm, cold = engine(PrefixCache(1 << 30)), engine(None)
    warm_out, lengths = run_session(lambda p: warm.generate([p], GREEDY)[0].token_ids, model.encode)
    cold_out, _ = run_session(lambda p: cold.generate([p], GREEDY)[0].token_ids, model.encode)
    assert max(lengths) > INITIAL_CAPACITY
    assert model.backend.model.cache.capacity > INITIAL_CAPACITY
    assert warm_out == cold_out
    # the case: short prompts after the cache has grown, each a prefix hit
    for _ in range(2):
        short = model.encode("Once upon a time")
        assert warm.generate([short], GREEDY)[0].token_ids == cold.generate([short], GREEDY)[0].token_ids


def test_batched_draft_model_session_past_the_slot_capacity(draftwise_home, stories_path, stories_lean_two_slots):
    """The draft model's slot cache grows and is re-imported too (DraftModelProposer.import_state)."""
    from draftwise.engine import EngineCore
    from draftwise.proposers.draft_model import DraftModelProposer
    from draftwise.models.loading import load_model

    model = stories_lean_two_slots
    draft = load_model(str(stories_path), quantization=MODE, runtime="lean", num_slots=2)

    def engine(prefix_cache):
        return EngineCore(model.backend, DraftModelProposer(draft.backend, model.backend.vocab_size, slot_per_sequence=True), 3,
                             eos_token_ids=model.eos_token_ids, prefix_cache=prefix_cache)

    warm, cold = engine(PrefixCache(1 << 30)), engine(None)
    warm_out, lengths = run_session(lambda p: warm.generate([p], GREEDY)[0].token_ids, model.encode, turns=3)
    cold_out, _ = run_session(lambda p: cold.generate([p], GREEDY)[0].token_ids, model.encode, turns=3)
    assert max(lengths) > INITIAL_CAPACITY and draft.backend.model.cache.capacity > INITIAL_CAPACITY
    assert warm_out == cold_out


@pytest.mark.parametrize("tree_width", [1, 3])
def test_single_engine_session_past_the_slot_capacity_matches_a_cold_engine(stories_lean_one_slot, tree_width):
    """LeanCausalLM.import_cache (prefix reuse) and compact -> move_entries (suffix draft trees) on a grown
    cache; the oracle is plain decoding without a prefix cache."""
    from draftwise.proposers.suffix import SuffixProposer

    model = stories_lean_one_slot
    warm = SpeculativeEngine(model.backend, SuffixProposer(tree_width=tree_width), 4,
                             eos_token_ids=model.eos_token_ids, prefix_cache=PrefixCache(1 << 30))
    plain = SpeculativeEngine(model.backend, eos_token_ids=model.eos_token_ids)
    warm_out, lengths = run_session(lambda p: warm.generate(p, GREEDY).token_ids, model.encode)
    cold_out, _ = run_session(lambda p: plain.generate(p, GREEDY).token_ids, model.encode)
    assert max(lengths) > INITIAL_CAPACITY and model.backend.model.cache.capacity > INITIAL_CAPACITY
    assert warm_out == cold_out


# ---------------------------------------------------------------------------------------------- HTTP
def served(stories_path, kv_cache_memory: int):
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    bundle = build_engine(str(stories_path), config, quantization=MODE, max_num_seqs=4,
                          kv_cache_memory=kv_cache_memory)
    settings = ServerSettings(served_model_names=("stories",), chat_template=CHAT_TEMPLATE)
    return live_server(create_app(bundle, settings))


def chat_session(url: str, user: str, turns: int = 4) -> list[dict]:
    story = ("Lily and Ben went to the park. They saw a big tree with red apples and a small bird that sang "
             "all day. ") * 4
    messages, bodies = [{"role": "system", "content": "You tell short stories. " + story}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Tell me more, part {turn}. " + story})
        response = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": "stories", "messages": messages, "max_tokens": 16, "temperature": 0, "user": user})
        assert response.status_code == 200, response.text
        body = response.json()
        bodies.append(body)
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return bodies


def test_batched_server_agent_session_past_the_slot_capacity(draftwise_home, stories_path):
    """The issue's steps against ``serve --max-num-seqs 4`` with the prefix cache on: a session growing past
    1,024 tokens, then short prompts twice; every request 200 and identical to a server without prefix reuse."""
    with served(stories_path, 1 << 30) as url:
        warm = chat_session(url, "alice")
        shorts = [httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "stories", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}) for _ in range(2)]
    assert all(r.status_code == 200 for r in shorts), [r.text for r in shorts]
    assert warm[-1]["usage"]["prompt_tokens"] > INITIAL_CAPACITY
    assert warm[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > INITIAL_CAPACITY // 2
    with served(stories_path, 0) as url:
        cold = chat_session(url, "alice")
    assert [b["choices"][0]["message"]["content"] for b in warm] == \
        [b["choices"][0]["message"]["content"] for b in cold]
