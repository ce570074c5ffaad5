"""``--speculative-backend auto``: the draft's backend chosen by a measured one-token decode time, cached per
draft file and machine; forced backends still force; on stories260K (llama.cpp and the lean runtime) the
engine stays exact whichever is chosen."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from draftwise.builder import build_engine
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.draft_backend import choose_draft_backend, draft_backend_cache_dir
from draftwise.engine import SpeculativeEngine
from llama_cpp_gate import needs_llama_cpp


def fake_load(loaded: list[str], fail: tuple[str, ...] = ()):
    def load(kind: str):
        if kind in fail:
            raise ValueError(f"{kind} cannot run it here")
        loaded.append(kind)
        return SimpleNamespace(backend=SimpleNamespace(kind=kind))
    return load


def timings(**seconds):
    return lambda backend: seconds[backend.kind.replace(".", "_")]


def test_the_faster_backend_is_chosen_cached_and_reused(tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    loaded: list[str] = []
    choice, model = choose_draft_backend(str(draft), fake_load(loaded), threads=2, quantization="int8",
                                         cache_dir=tmp_path / "cache", measure=timings(torch=0.076, llama_cpp=0.041),
                                         measure_prefill=timings(torch=0.005, llama_cpp=0.01))
    assert choice.backend == "llama.cpp" and model.backend.kind == "llama.cpp" and not choice.cached
    assert choice.seconds_per_token == {"torch": 0.076, "llama.cpp": 0.041}
    assert choice.prefill_seconds_per_token == {"torch": 0.005, "llama.cpp": 0.01}
    assert "llama.cpp 41.0 ms, torch 76.0 ms" in choice.reason
    assert "torch 200 tok/s, llama.cpp 100 tok/s" in choice.reason
    assert len(list((tmp_path / "cache").iterdir())) == 1

    def no_measuring(backend):
        raise AssertionError("a cached choice measures nothing")

    loaded.clear()
    again, model = choose_draft_backend(str(draft), fake_load(loaded), threads=2, quantization="int8",
                                        cache_dir=tmp_path / "cache", measure=no_measuring)
    assert again.cached and again.backend == "llama.cpp" and loaded == ["llama.cpp"]
    assert again.prefill_seconds_per_token == {"torch": 0.005, "llama.cpp": 0.01}
    other, _ = choose_draft_backend(str(draft), fake_load([]), threads=1, quantization="int8",  # another key
                                    cache_dir=tmp_path / "cache", measure=timings(torch=0.03, llama_cpp=0.04),
        measure_prefill=lambda backend: 0.01)
    assert other.backend == "torch" and not other.cached


def test_an_unwritable_cache_does_not_fail_the_load(tmp_path, caplog):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="draftwise.draft_backend"):
        choice, _ = choose_draft_backend(str(draft), fake_load([]), threads=None, quantization=None,
                                         cache_dir=blocked / "cache", measure=timings(torch=0.02, llama_cpp=0.03),
        measure_prefill=lambda backend: 0.01)
    assert choice.backend == "torch" and any("could not cache" in r.getMessage() for r in caplog.records)


def test_a_candidate_that_cannot_load_leaves_the_other_and_nothing_is_cached(tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    choice, model = choose_draft_backend(str(draft), fake_load([], fail=("llama.cpp",)), threads=None,
                                         quantization=None, cache_dir=tmp_path / "cache",
                                         measure=timings(torch=0.05, llama_cpp=0.01),
        measure_prefill=lambda backend: 0.01)
    assert choice.backend == "torch"
    assert "llama.cpp unavailable (ValueError: llama.cpp cannot run it here)" in choice.reason
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="no draft backend could load"):
        choose_draft_backend(str(draft), fake_load([], fail=("torch", "llama.cpp")), threads=None, quantization=None,
                             cache_dir=tmp_path / "cache", measure=timings(torch=0.05, llama_cpp=0.01),
        measure_prefill=lambda backend: 0.01)


@needs_llama_cpp
def test_auto_measures_both_backends_on_a_real_gguf_and_stays_exact(stories_path, draftwise_home, caplog):
    config = SpeculativeConfig(method="draft_model", model=str(stories_path), num_speculative_tokens=3,
                               backend="auto")
    before = _cached_choices()
    with caplog.at_level(logging.INFO, logger="draftwise.draft_backend"):
        bundle = build_engine(str(stories_path), config, device="cpu", threads=1)
    messages = [r.getMessage() for r in caplog.records]
    assert any("draft backend (auto, measured)" in m or "draft backend (auto, cached)" in m for m in messages)
    files = _cached_choices()
    assert len(files) == 1 and before <= files  # one choice for this draft and machine (perhaps cached before)
    choice = json.loads(next(iter(files)).read_text())["choice"]
    assert set(choice["seconds_per_token"]) == {"torch", "llama.cpp"}
    kind = "llama.cpp" if type(bundle.draft.backend).__name__ == "LlamaCppCausalLM" else "torch"
    assert kind == choice["backend"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = bundle.target.encode("Once upon a time, there was a little girl")
    plain = SpeculativeEngine(bundle.target.backend).generate(prompt, params).token_ids
    assert bundle.engine.generate(prompt, params).token_ids == plain


def _cached_choices() -> set:
    folder = draft_backend_cache_dir()
    return set(folder.iterdir()) if folder.exists() else set()


@needs_llama_cpp
def test_forced_backends_measure_nothing(stories_path, draftwise_home):
    before = _cached_choices()
    for backend in ("torch", "llama.cpp"):
        config = SpeculativeConfig(method="draft_model", model=str(stories_path), num_speculative_tokens=2,
                                   backend=backend)
        bundle = build_engine(str(stories_path), config, device="cpu", threads=1)
        assert (type(bundle.draft.backend).__name__ == "LlamaCppCausalLM") == (backend == "llama.cpp")
    assert _cached_choices() == before


@needs_llama_cpp
def test_auto_with_a_missing_draft_file_says_so_like_a_forced_backend(stories_path, draftwise_home):
    from draftwise.models.loading import ModelLoadError

    config = SpeculativeConfig(method="draft_model", model="/nope/draft.gguf", num_speculative_tokens=2,
                               backend="auto")
    with pytest.raises(ModelLoadError, match="GGUF file not found: /nope/draft.gguf"):
        build_engine(str(stories_path), config, device="cpu", threads=1)
