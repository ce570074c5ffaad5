"""The server's prefix reuse (usage.prompt_tokens_details.cached_tokens, scopes by key and user, Prometheus
counters) and per-request speculation control (``num_speculative_tokens`` in the body)."""

from __future__ import annotations

import httpx
import pytest

from draftwise.builder import EngineBundle
from draftwise.config import SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.ngram import NgramProposer
from draftwise.server import ServerSettings, create_app
from draftwise.server.validation import cache_scope
from test_server import CHAT_TEMPLATE, live_server, one_torch_thread  # noqa: F401  (fixture)

KEY = "sk-prefix"


@pytest.fixture(scope="module")
def url(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    target = load_model(str(stories_path), device="cpu")
    engine = SpeculativeEngine(target.backend, NgramProposer(1, 3), 3, eos_token_ids=target.eos_token_ids,
                               prefix_cache=PrefixCache(1 << 30))
    bundle = EngineBundle(target=target, core=engine.core,
                          speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    settings = ServerSettings(served_model_names=("stories",), chat_template=CHAT_TEMPLATE, api_key=KEY)
    with live_server(create_app(bundle, settings)) as served:
        yield served


def chat(url: str, messages: list[dict], **extra) -> httpx.Response:
    body = {"model": "stories", "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)


def agent_turns(url: str, user: str, turns: int = 3) -> list[dict]:
    messages, bodies = [{"role": "system", "content": "You tell short stories."}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Once upon a time there was a cat number {turn}."})
        response = chat(url, messages, user=user)
        assert response.status_code == 200, response.text
        body = response.json()
        bodies.append(body)
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return bodies


def test_later_turns_report_cached_tokens_and_match_a_cold_server(url):
    warm = agent_turns(url, user="alice")
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in warm]
    assert cached[0] == 0
    assert all(0 < c < b["usage"]["prompt_tokens"] for c, b in zip(cached[1:], warm[1:]))
    # the same conversation by another user starts cold at every first turn, and says the same
    other = agent_turns(url, user="bob")
    assert other[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert [b["choices"][0]["message"]["content"] for b in other] == \
        [b["choices"][0]["message"]["content"] for b in warm]


def test_prefix_cache_counters_in_metrics(url):
    agent_turns(url, user="carol", turns=2)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    queries = [line for line in text.splitlines() if line.startswith("draftwise:prefix_cache_queries_total")]
    hits = [line for line in text.splitlines() if line.startswith("draftwise:prefix_cache_hits_total")]
    assert queries and hits
    assert 0 < float(hits[0].split()[-1]) < float(queries[0].split()[-1])


def test_request_turns_speculation_off_or_picks_k(url):
    messages = [{"role": "user", "content": "Once upon a time"}]
    off = chat(url, messages, num_speculative_tokens=0, user="dave").json()
    assert off["usage"]["speculative"]["method"] == "plain"
    assert off["usage"]["speculative"]["num_speculative_tokens"] == 0
    assert off["usage"]["speculative"]["num_draft_tokens"] == 0
    two = chat(url, messages, num_speculative_tokens=2, user="erin").json()
    assert two["usage"]["speculative"]["method"] == "ngram"
    assert two["usage"]["speculative"]["num_speculative_tokens"] == 2
    assert len(two["usage"]["speculative"]["drafted_per_position"]) <= 2  # never drafted past position 2
    assert off["choices"][0]["message"]["content"] == two["choices"][0]["message"]["content"]


@pytest.mark.parametrize("value", [4, -1, "2", 1.5, True])
def test_bad_per_request_k_is_a_400(url, value):
    response = chat(url, [{"role": "user", "content": "Hi"}], num_speculative_tokens=value)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("num_speculative_tokens", "body.num_speculative_tokens") or \
        "num_speculative_tokens" in response.json()["error"]["message"]


def test_cache_scope_separates_keys_and_users_without_storing_the_key():
    assert cache_scope("k1", None) != cache_scope("k2", None)
    assert cache_scope("k1", "a") != cache_scope("k1", "b")
    assert cache_scope(None, None) == "|"
    assert "k1" not in cache_scope("k1", None)
