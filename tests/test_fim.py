"""Fill-in-the-middle (``suffix`` on /v1/completions) and ``echo``: the FIM tokens found in a tokenizer's
vocabulary, the prompt built in prefix-suffix-middle order with the special tokens as single ids, a 400 naming
``suffix`` for a model without them; the suffix's tokens are in the prompt, so the n-gram and suffix proposers
draft from them; ``echo`` prepends the prompt's text, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest

from draftwise.config import SamplingParams
from draftwise.models.loading import LoadedModel
from draftwise.proposers.ngram import NgramProposer
from draftwise.proposers.suffix import SuffixProposer
from draftwise.sampling import Sampler
from draftwise.server import ServerSettings
from draftwise.server.errors import RequestError
from draftwise.server.fim import FimFormat, detect_fim
from draftwise.server.protocol import CompletionRequest
from draftwise.server.text import TextCodec
from draftwise.server.validation import EngineLimits, RequestValidator
from test_server_n import url  # noqa: F401  (fixture: stories260K served with 4 slots)

QWEN_FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def char_tokenizer(special: tuple[str, ...] = ()):
    """A character-level ``transformers`` tokenizer (one id per character; ``special`` added as special tokens,
    after the characters), so a special token's text would be many ids if it were tokenized as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    model.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def validator_for(tokenizer) -> RequestValidator:
    codec = TextCodec(LoadedModel(backend=None, tokenizer=tokenizer, name="fake-coder"), copies=1)
    return RequestValidator(codec, EngineLimits(max_context=4096, vocab_size=len(tokenizer), max_num_seqs=4),
                            ServerSettings(), "fake-coder")


def char_ids(text: str) -> list[int]:
    return [CHARS.index(c) + 1 for c in text]


# ---------------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize("vocab, expected", [
    ({"<|fim_prefix|>": 10, "<|fim_suffix|>": 11, "<|fim_middle|>": 12, "a": 1, "<|endoftext|>": 0,
      "<|file_sep|>": 13}, FimFormat("qwen", 10, 11, 12, (), (10, 11, 12, 0, 13))),
    ({"<fim_prefix>": 3, "<fim_suffix>": 4, "<fim_middle>": 5}, FimFormat("starcoder", 3, 4, 5, (), (3, 4, 5))),
    ({"▁<PRE>": 7, "▁<SUF>": 8, "▁<MID>": 9, "▁<EOT>": 2}, FimFormat("codellama", 7, 8, 9, (1,), (7, 8, 9, 2))),
    ({"<|fim_prefix|>": 10, "<|fim_suffix|>": 11}, None),  # no middle token: not a FIM vocabulary
    ({"a": 1, "b": 2}, None),
])
def test_fim_tokens_are_detected_from_the_vocabulary(vocab, expected):
    assert detect_fim(vocab, bos_id=1) == expected


# ---------------------------------------------------------------------------------------------- prompts
def test_fim_prompt_puts_single_special_ids_in_prefix_suffix_middle_order():
    tokenizer = char_tokenizer(QWEN_FIM)
    pre, suf, mid = (tokenizer.convert_tokens_to_ids(t) for t in QWEN_FIM)
    prefix, suffix = 'def add(a, b):\n    """Sum."""\n', "\n\ndef sub(a, b):\n    return a - b\n"
    request = validator_for(tokenizer).completion(CompletionRequest(prompt=prefix, suffix=suffix, max_tokens=8))
    assert list(request.prompt_ids) == [pre, *char_ids(prefix), suf, *char_ids(suffix), mid]
    assert len(set((pre, suf, mid))) == 3 and min(pre, suf, mid) > len(CHARS)


def test_the_middle_ends_at_the_fim_tokens_and_end_of_text_beside_the_requests_stop_ids():
    tokenizer = char_tokenizer(QWEN_FIM + ("<|endoftext|>",))
    stops = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_FIM + ("<|endoftext|>",)]
    validator = validator_for(tokenizer)
    request = validator.completion(CompletionRequest(prompt="def f():", suffix="\n", max_tokens=4,
                                                     stop_token_ids=[5, stops[3]]))
    assert request.params.stop_token_ids == (5, stops[3], *stops[:3])
    plain = validator.completion(CompletionRequest(prompt="def f():", max_tokens=4))
    assert plain.params.stop_token_ids == ()  # without a suffix: no FIM stops


def test_fim_prompt_from_token_ids_and_an_empty_prefix():
    tokenizer = char_tokenizer(QWEN_FIM)
    pre, suf, mid = (tokenizer.convert_tokens_to_ids(t) for t in QWEN_FIM)
    validator = validator_for(tokenizer)
    ids = validator.completion(CompletionRequest(prompt=[5, 6, 7], suffix="x", max_tokens=4)).prompt_ids
    assert list(ids) == [pre, 5, 6, 7, suf, *char_ids("x"), mid]
    ids = validator.completion(CompletionRequest(prompt="", suffix="x", max_tokens=4)).prompt_ids
    assert list(ids) == [pre, suf, *char_ids("x"), mid]


def test_suffix_on_a_model_without_fim_tokens_is_a_400_naming_suffix():
    validator = validator_for(char_tokenizer())
    with pytest.raises(RequestError) as caught:
        validator.completion(CompletionRequest(prompt="def f():", suffix="    return 1\n", max_tokens=4))
    assert caught.value.status == 400 and caught.value.param == "suffix"
    assert "fill-in-the-middle" in caught.value.message
    # no suffix: the same model serves the prompt as it is
    ids = validator.completion(CompletionRequest(prompt="def f():", max_tokens=4)).prompt_ids
    assert list(ids) == char_ids("def f():")


def test_echo_text_is_the_prompt_and_echo_with_logprobs_asks_for_the_prompts():
    validator = validator_for(char_tokenizer(QWEN_FIM))
    assert validator.completion(CompletionRequest(prompt="abc", echo=True, max_tokens=2)).echo == "abc"
    assert validator.completion(CompletionRequest(prompt=char_ids("xy"), echo=True, max_tokens=2)).echo == "xy"
    assert validator.completion(CompletionRequest(prompt="abc", max_tokens=2)).echo == ""
    echoed = validator.completion(CompletionRequest(prompt="abc", echo=True, logprobs=2, max_tokens=2))
    # the engine computes the prompt's logprobs (the echoed tokens carry them); the client did not ask for the field
    assert (echoed.params.logprobs, echoed.params.prompt_logprobs) == (2, 2)
    assert (echoed.logprobs, echoed.prompt_logprobs) == (2, None)
    both = validator.completion(CompletionRequest(prompt="abc", echo=True, logprobs=1, prompt_logprobs=3,
                                                  max_tokens=2))
    assert (both.params.prompt_logprobs, both.prompt_logprobs) == (3, 3)
    assert validator.completion(CompletionRequest(prompt="abc", logprobs=1, max_tokens=2)).params.prompt_logprobs \
        is None


# ---------------------------------------------------------------------------------------------- proposers
def fim_context() -> tuple[list[int], list[int]]:
    """A FIM prompt whose suffix holds the code that comes next, and the committed output so far: the model has
    started writing ``total = 0`` and the suffix goes on with ``total = 0\\n    for x in xs:``."""
    tokenizer = char_tokenizer(QWEN_FIM)
    validator = validator_for(tokenizer)
    prompt = validator.completion(CompletionRequest(
        prompt='def total(xs):\n    """Sum of xs."""\n', suffix="total = 0\n    for x in xs:\n", max_tokens=8))
    return list(prompt.prompt_ids), char_ids("    total = 0")


def test_ngram_and_suffix_proposers_draft_from_the_suffix_text():
    prompt, output = fim_context()
    context = prompt + output
    expected = char_ids("\n    for")
    params = SamplingParams(max_tokens=16)
    ngram = NgramProposer(2, 6).propose(context, len(expected), params, Sampler(params))
    assert list(ngram.token_ids) == expected
    suffix = SuffixProposer(min_token_prob=0.0)
    suffix.start(prompt)
    drafted = suffix.propose(context, len(expected), params, Sampler(params))
    assert list(drafted.token_ids) == expected


# ---------------------------------------------------------------------------------------------- echo, served
def test_echo_prepends_the_prompt_streamed_and_not(url):  # noqa: F811
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "echo": True}
    plain = httpx.post(f"{url}/v1/completions", json={**body, "echo": False}, timeout=120).json()
    echoed = httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, timeout=120).json()
    assert [c["text"] for c in echoed["choices"]] == ["Once upon a time" + plain["choices"][0]["text"]] * 2
    assert echoed["usage"]["completion_tokens"] == 2 * plain["usage"]["completion_tokens"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["text"] == "Once upon a time"
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------- the benchmark script
def fim_script():
    """``scripts/bench/fim.py`` as a module (it is not part of the package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "fim.py"
    spec = importlib.util.spec_from_file_location("fim_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_fim_benchmark_parses_its_arguments_and_reads_its_functions():
    script = fim_script()
    args = script.parse_args([])
    assert args.methods == ("plain", "ngram", "suffix", "draft") and args.k == 4 and args.max_tokens == 128
    assert script.parse_args(["--methods", "suffix,plain", "--k", "8"]).methods == ("plain", "suffix")
    for bad in (["--methods", "eagle"], ["--k", "0"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)
    tasks = script.load_tasks(script.DATA)
    assert len(tasks) == 12 and len({t.name for t in tasks}) == 12
    for task in tasks:  # each function is whole again with its middle, and the middle was really cut out
        compile(task.prefix + task.middle + task.suffix, task.name, "exec")
        assert task.middle.strip() and task.middle not in task.prefix + task.suffix
        assert f"def {task.name}(" in task.prefix
    assert script.speculative_config("plain", args) is None
    assert script.speculative_config("draft", args).model == args.draft
    assert script.speculative_config("ngram", args).method == "ngram"


def test_fim_benchmark_builds_the_servers_fim_prompts():
    script = fim_script()
    tasks = script.load_tasks(script.DATA, limit=3)
    tokenizer = char_tokenizer(QWEN_FIM)
    pre, suf, mid = (tokenizer.convert_tokens_to_ids(t) for t in QWEN_FIM)
    codec = TextCodec(LoadedModel(backend=None, tokenizer=tokenizer, name="fake-coder"), copies=1)
    prompts = script.build_prompts(codec, tasks)
    assert [p[0] for p in prompts] == [pre] * 3 and [p[-1] for p in prompts] == [mid] * 3
    for prompt, task in zip(prompts, tasks):
        assert prompt == [pre, *char_ids(task.prefix), suf, *char_ids(task.suffix), mid]


def test_fim_benchmark_refuses_a_model_without_fim_tokens(stories_path, draftwise_home):
    from draftwise.models.loading import load_model

    script = fim_script()
    codec = TextCodec(load_model(str(stories_path), quantization="none", runtime="lean"), copies=1)
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        script.build_prompts(codec, script.load_tasks(script.DATA, limit=1))
