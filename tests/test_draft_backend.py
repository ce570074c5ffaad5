"""``--speculative-backend auto``: the draft's backend chosen by a measured one-token decode time, cached per
draft file and machine; forced backends still force; on stories260K (llama.cpp and the lean runtime) the
engine stays exact whichever is chosen."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftwise.backends.llama_cpp_backend import copy_recipe
from draftwise.builder import build_engine
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.draft_backend import Candidate, choose_draft_backend, draft_backend_cache_dir
from draftwise.engine import SpeculativeEngine
from llama_cpp_gate import needs_llama_cpp


AS_IS = [Candidate("torch", "torch"), Candidate("llama.cpp", "llama.cpp")]
WITH_Q4_0 = [*AS_IS, Candidate("llama.cpp Q4_0", "llama.cpp", "Q4_0")]
WITH_Q4_0_HEAD = [*WITH_Q4_0, Candidate("llama.cpp Q4_0, Q4_0 head", "llama.cpp", "Q4_0", "Q4_0")]


def fake_load(loaded: list[str], fail: tuple[str, ...] = ()):
    """``(backend, file) -> model`` whose backend's ``kind`` names the candidate (``"llama.cpp Q4_0"`` for a copy)."""
    def load(kind: str, file: str):
        copies = {"-Q4_0-head-Q4_0.gguf": " Q4_0, Q4_0 head", "-Q4_0.gguf": " Q4_0"}  # the longer ending first
        name = kind + next((label for end, label in copies.items() if file.endswith(end)), "")
        if name in fail:
            raise ValueError(f"{name} cannot run it here")
        loaded.append(name)
        return SimpleNamespace(backend=SimpleNamespace(kind=name), file=file)
    return load


def _keyword(kind: str) -> str:
    """A candidate name as a keyword argument: ``"llama.cpp Q4_0"`` -> ``llama_cpp_Q4_0``, ``"llama.cpp Q4_0, Q4_0
    head"`` -> ``llama_cpp_Q4_0_Q4_0_head``."""
    return kind.replace(".", "_").replace(",", "").replace(" ", "_")


def timings(**seconds):
    """``backend -> seconds`` by candidate name (:func:`_keyword`)."""
    return lambda backend: seconds[_keyword(backend.kind)]


def predictions(**agree):
    """``model -> probe predictions``: the as-is llama.cpp file predicts 0..9; a copy agrees at ``agree`` of them."""
    def predict(model):
        share = agree.get(_keyword(model.backend.kind), 1.0)
        same = round(10 * share)
        return torch.tensor(list(range(same)) + [99] * (10 - same))
    return predict


def fake_copy(made: list[str]):
    def requantize(path: str, file_type: str, head_type: str | None) -> str:
        copy = path[: -len(".gguf")] + f"-{copy_recipe(file_type, head_type)}.gguf"
        Path(copy).write_bytes(b"GGUF")
        made.append(copy)
        return copy
    return requantize


@pytest.fixture
def draft(tmp_path):
    path = tmp_path / "draft.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_the_faster_backend_is_chosen_cached_and_reused(tmp_path, draft):
    loaded: list[str] = []
    choice, model = choose_draft_backend(str(draft), fake_load(loaded), threads=2, quantization="int8",
                                         cache_dir=tmp_path / "cache", candidates=AS_IS,
                                         measure=timings(torch=0.076, llama_cpp=0.041),
                                         measure_prefill=timings(torch=0.005, llama_cpp=0.01))
    assert choice.backend == "llama.cpp" and model.backend.kind == "llama.cpp" and not choice.cached
    assert choice.candidate == "llama.cpp" and choice.file == str(draft)
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
                                    cache_dir=tmp_path / "cache", candidates=AS_IS,
                                    measure=timings(torch=0.03, llama_cpp=0.04), measure_prefill=lambda b: 0.01)
    assert other.backend == "torch" and not other.cached


def test_progress_lines_name_the_draft(tmp_path, draft):
    """The measuring and the cached choice's lines carry the draft's name (they were shown under the model
    named last, the target)."""
    from draftwise.progress import ProgressLines, report

    lines = io.StringIO()
    handler = ProgressLines({"qwen-target": "target", "qwen-draft": "draft"}, stream=lines)
    progress_logger = logging.getLogger("draftwise.progress")
    progress_logger.addHandler(handler)
    level = progress_logger.level
    progress_logger.setLevel(logging.INFO)
    try:
        report("loading the weights", model="qwen-target")
        for _ in range(2):  # measured, then cached
            choose_draft_backend(str(draft), fake_load([]), threads=2, quantization="int8", name="qwen-draft",
                                 cache_dir=tmp_path / "cache", candidates=AS_IS,
                                 measure=timings(torch=0.076, llama_cpp=0.041), measure_prefill=lambda b: 0.01)
    finally:
        progress_logger.removeHandler(handler)
        progress_logger.setLevel(level)
    choice_lines = [line for line in lines.getvalue().splitlines() if "draft backend" in line]
    assert any("(auto, measured)" in line for line in choice_lines)
    assert any("(auto, cached)" in line for line in choice_lines)
    assert choice_lines and all(line.startswith("[draft qwen-draft] ") for line in choice_lines), choice_lines


def test_a_faster_agreeing_q4_0_copy_is_chosen_and_its_file_kept(tmp_path, draft):
    made: list[str] = []
    loaded: list[str] = []
    choice, model = choose_draft_backend(str(draft), fake_load(loaded), threads=2, quantization=None,
                                         cache_dir=tmp_path / "cache", candidates=WITH_Q4_0,
                                         measure=timings(torch=0.05, llama_cpp=0.03, llama_cpp_Q4_0=0.02),
                                         measure_prefill=lambda b: 0.01, predict=predictions(llama_cpp_Q4_0=0.9),
                                         requantize=fake_copy(made))
    assert choice.candidate == "llama.cpp Q4_0" and choice.backend == "llama.cpp"
    assert choice.file == made[0] == str(tmp_path / "draft-Q4_0.gguf") and model.file == made[0]
    assert choice.agreement == {"llama.cpp Q4_0": 0.9}
    assert "llama.cpp Q4_0 predicts the file's next token at 90% of probe positions" in choice.reason
    assert loaded == ["torch", "llama.cpp", "llama.cpp Q4_0"]  # the file as it is first: the copy's reference

    loaded.clear()
    again, _ = choose_draft_backend(str(draft), fake_load(loaded), threads=2, quantization=None,
                                    cache_dir=tmp_path / "cache", measure=None)
    assert again.cached and again.file == made[0] and loaded == ["llama.cpp Q4_0"]
    Path(made[0]).unlink()  # a removed copy: measured (and made) again
    third, _ = choose_draft_backend(str(draft), fake_load([]), threads=2, quantization=None,
                                    cache_dir=tmp_path / "cache", candidates=WITH_Q4_0,
                                    measure=timings(torch=0.05, llama_cpp=0.03, llama_cpp_Q4_0=0.02),
                                    measure_prefill=lambda b: 0.01, predict=predictions(), requantize=fake_copy(made))
    assert not third.cached and third.candidate == "llama.cpp Q4_0" and len(made) == 2


def test_a_copy_with_a_q4_0_head_is_chosen_when_faster_and_agreeing(tmp_path, draft):
    made: list[str] = []

    def choose(cache: str, head_agreement: float):
        return choose_draft_backend(str(draft), fake_load([]), threads=2, quantization=None,
                                    cache_dir=tmp_path / cache, candidates=WITH_Q4_0_HEAD,
                                    measure=timings(torch=0.05, llama_cpp=0.03, llama_cpp_Q4_0=0.02,
                                                    llama_cpp_Q4_0_Q4_0_head=0.016),
                                    measure_prefill=lambda b: 0.01,
                                    predict=predictions(llama_cpp_Q4_0=0.9, llama_cpp_Q4_0_Q4_0_head=head_agreement),
                                    requantize=fake_copy(made))

    choice, model = choose("cache", 0.9)
    assert choice.candidate == "llama.cpp Q4_0, Q4_0 head" and model.backend.kind == choice.candidate
    assert choice.file == str(tmp_path / "draft-Q4_0-head-Q4_0.gguf") and choice.file in made
    assert "llama.cpp Q4_0, Q4_0 head 16.0 ms, llama.cpp Q4_0 20.0 ms" in choice.reason
    # the same copy guessing too differently: the plain Q4_0 copy is the fastest allowed one
    fallback, _ = choose("other", 0.8)
    assert fallback.candidate == "llama.cpp Q4_0"
    assert "llama.cpp Q4_0, Q4_0 head predicts the file's next token at 80% of probe positions (below 90%" \
        in fallback.reason


def test_a_faster_copy_that_guesses_differently_is_reported_not_chosen(tmp_path, draft):
    choice, model = choose_draft_backend(str(draft), fake_load([]), threads=2, quantization=None,
                                         cache_dir=tmp_path / "cache", candidates=WITH_Q4_0,
                                         measure=timings(torch=0.05, llama_cpp=0.03, llama_cpp_Q4_0=0.01),
                                         measure_prefill=lambda b: 0.01, predict=predictions(llama_cpp_Q4_0=0.8),
                                         requantize=fake_copy([]))
    assert choice.candidate == "llama.cpp" and model.backend.kind == "llama.cpp" and choice.file == str(draft)
    assert choice.seconds_per_token["llama.cpp Q4_0"] == 0.01 and choice.agreement == {"llama.cpp Q4_0": 0.8}
    assert "at 80% of probe positions (below 90%: not chosen)" in choice.reason


def test_a_copy_needs_the_file_on_llama_cpp_to_compare_with(tmp_path, draft):
    made: list[str] = []
    choice, _ = choose_draft_backend(str(draft), fake_load([], fail=("llama.cpp",)), threads=2, quantization=None,
                                     cache_dir=tmp_path / "cache", candidates=WITH_Q4_0,
                                     measure=timings(torch=0.05, llama_cpp_Q4_0=0.01), measure_prefill=lambda b: 0.01,
                                     predict=predictions(), requantize=fake_copy(made))
    assert choice.candidate == "torch" and not made
    assert "llama.cpp Q4_0 unavailable (nothing to compare it with" in choice.reason


def test_an_unwritable_cache_does_not_fail_the_load(tmp_path, caplog, draft):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="draftwise.draft_backend"):
        choice, _ = choose_draft_backend(str(draft), fake_load([]), threads=None, quantization=None,
                                         cache_dir=blocked / "cache", candidates=AS_IS,
                                         measure=timings(torch=0.02, llama_cpp=0.03), measure_prefill=lambda b: 0.01)
    assert choice.backend == "torch" and any("could not cache" in r.getMessage() for r in caplog.records)


def test_a_candidate_that_cannot_load_leaves_the_other_and_nothing_is_cached(tmp_path, draft):
    choice, model = choose_draft_backend(str(draft), fake_load([], fail=("llama.cpp",)), threads=None,
                                         quantization=None, cache_dir=tmp_path / "cache", candidates=AS_IS,
                                         measure=timings(torch=0.05, llama_cpp=0.01), measure_prefill=lambda b: 0.01)
    assert choice.backend == "torch"
    assert "llama.cpp unavailable (ValueError: llama.cpp cannot run it here)" in choice.reason
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="no draft backend could load"):
        choose_draft_backend(str(draft), fake_load([], fail=("torch", "llama.cpp")), threads=None, quantization=None,
                             cache_dir=tmp_path / "cache", candidates=AS_IS,
                             measure=timings(torch=0.05, llama_cpp=0.01), measure_prefill=lambda b: 0.01)


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
    # one choice for this draft, machine and settings (perhaps cached before; other tests may keep choices for
    # other settings of the same file, e.g. the demo's --quantization int8)
    keys = {f: json.loads(f.read_text())["key"] for f in files}  # keyed by the quantization the target resolved to
    mine = [f for f, key in keys.items() if (key["quantization"], key["threads"]) == (bundle.target.quantization, 1)
            and key["torch_threads"] == torch.get_num_threads()]
    assert len(mine) == 1 and before <= files and len(files - before) <= 1
    choice = json.loads(mine[0].read_text())["choice"]
    copies = {"llama.cpp Q4_0", "llama.cpp Q4_0, Q4_0 head"}
    assert set(choice["seconds_per_token"]) == {"torch", "llama.cpp", *copies}  # stories260K is F32
    assert set(choice["agreement"]) == copies and all(0 <= a <= 1 for a in choice["agreement"].values())
    kind = "llama.cpp" if type(bundle.draft.backend).__name__ == "LlamaCppCausalLM" else "torch"
    assert kind == choice["backend"] and Path(choice["file"]).is_file()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = bundle.target.encode("Once upon a time, there was a little girl")
    plain = SpeculativeEngine(bundle.target.backend).generate(prompt, params).token_ids
    assert bundle.engine.generate(prompt, params).token_ids == plain


def _cached_choices() -> set:
    folder = draft_backend_cache_dir()
    return set(folder.glob("*.json")) if folder.exists() else set()


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


@needs_llama_cpp
def test_costs_says_which_draft_runtime_auto_chose(stories_path, draftwise_home, capsys):
    from draftwise.cli import main

    common = ["costs", str(stories_path), "--draft", str(stories_path), "--ks", "2", "--context", "8",
              "--repeats", "1", "--bandwidth-mib", "16"]
    assert main([*common, "--speculative-backend", "auto", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["draft_runtime_choice"].split(":")[0] in {"torch", "llama.cpp", "llama.cpp Q4_0"}
    assert "one draft token on top of 256 tokens took" in result["draft_runtime_choice"]
    assert main([*common, "--speculative-backend", "auto"]) == 0
    assert "draft runtime (auto): " in capsys.readouterr().out
    assert main([*common, "--speculative-backend", "llama.cpp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_runtime_choice"] is None  # forced: nothing measured


def test_the_cache_key_follows_the_gguf_kernels_source_for_a_q4k_draft(tmp_path, monkeypatch):
    """A lean draft on the GGUF kernels is measured again after their source changes; an int8 draft's key does
    not depend on it."""
    from draftwise import draft_backend
    from draftwise.backends.kernels import q4k

    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    monkeypatch.setattr(q4k, "build_key", lambda: "source-1")
    first = {mode: draft_backend._cache_key(str(draft), 2, mode) for mode in ("q4k", "int8")}
    monkeypatch.setattr(q4k, "build_key", lambda: "source-2")
    assert draft_backend._cache_key(str(draft), 2, "q4k") != first["q4k"]
    assert draft_backend._cache_key(str(draft), 2, "int8") == first["int8"]
