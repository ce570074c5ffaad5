"""``draftwise check`` end to end: the JSON schema, exit codes, failures before loading (tokenizers, memory),
a padded-vocabulary pair of Hugging Face directories, and the human-readable output."""

from __future__ import annotations

import json

import pytest

from draftwise.cli import main
from llama_cpp_gate import needs_llama_cpp
from test_check_support import tiny_pair_dirs, word_tokenizer

MEASURE_FLAGS = ["--num-prompts", "2", "--max-tokens", "6", "--probe-k", "2", "--max-k", "2", "--repeats", "1"]


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "w5 w9 w17 w33", "category": "a"}, {"prompt": "w40 w41 w7", "category": "b"},
             {"prompt": "w60 w61", "category": "a"}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


@pytest.fixture()
def no_loading(monkeypatch):
    """Fail the test if the check loads weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("draftwise.check.runner.load_model", refuse)


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["check", *map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_json_schema_on_stories(capsys, draftwise_home, stories_path, prompt_file):
    """stories260K checked against itself (loaded twice): the full measured report."""
    code, report = run_json(capsys, stories_path, stories_path, "--prompts", prompt_file, *MEASURE_FLAGS)
    assert code == 0
    assert set(report) == {"schema", "ok", "target", "draft", "settings", "tokenizer", "memory", "costs", "probe",
                           "predictions", "verdict", "draft_runtime"}
    assert report["schema"] == "draftwise.check/1" and report["ok"] is True
    assert report["target"]["num_parameters"] == 292_800 and report["target"]["format"] == "gguf"
    assert report["settings"]["device"] == "cpu" and report["settings"]["dtype"] == "float32"
    # --quantization auto (the default, as for bench and serve) resolved at load; the draft loaded like the target
    quantization = report["settings"]["quantization"]
    assert quantization in {"int8", "none"}
    assert report["draft_runtime"].endswith(f"quantization {quantization} (the target's runtime)")
    assert report["tokenizer"]["ok"] and report["tokenizer"]["errors"] == []
    memory = report["memory"]
    assert memory["target_kv_per_token"] == 1280 and memory["context_len"] == 2048
    assert memory["total"] == 2 * (292_800 * 4 + 1280 * 2048) and memory["fits"] is True
    assert set(report["costs"]["target"]["seconds"]) == {"1", "2", "3"}
    assert report["costs"]["cost_ratio"] > 0
    probe = report["probe"]
    assert probe["acceptance_rate"] == 1.0 and len(probe["prompts"]) == 2 and probe["k"] == 2
    assert [p["k"] for p in report["predictions"]] == [1, 2]
    assert set(report["predictions"][0]) == {"k", "cost_ratio", "verify_cost", "tokens_per_step", "speedup"}
    verdict = report["verdict"]
    assert verdict["status"] in {"helps", "marginal", "does_not_help"}
    assert verdict["best_k"] in (1, 2) and verdict["text"] and verdict["reason"]


def test_padded_vocabulary_pair_of_hf_directories(capsys, tmp_path, prompt_file):
    target, draft = tiny_pair_dirs(tmp_path, padded_width=128)
    code, report = run_json(capsys, target, draft, "--prompts", prompt_file, *MEASURE_FLAGS)
    assert code == 0 and report["ok"]
    tokenizer = report["tokenizer"]
    assert tokenizer["padded_vocab"] and tokenizer["target_vocab_width"] == 128 and tokenizer["draft_vocab_width"] == 96
    assert report["probe"]["acceptance_rate"] == 1.0


def test_tokenizer_mismatch_fails_before_loading(capsys, tmp_path, no_loading):
    target, draft = tiny_pair_dirs(tmp_path, draft_tokenizer=word_tokenizer(renamed={7: "seven", 9: "nine"}))
    code, report = run_json(capsys, target, draft, "--no-measure")
    assert code == 1 and report["ok"] is False
    assert report["tokenizer"]["first_differences"][0] == {"id": 7, "target": "w7", "draft": "seven"}
    assert report["memory"] is None and report["costs"] is None and report["probe"] is None
    assert report["verdict"]["status"] == "incompatible" and report["verdict"]["helps"] is False
    assert main(["check", str(target), str(draft)]) == 1
    out = capsys.readouterr().out
    assert "INCOMPATIBLE" in out and "id 7: target 'w7' vs draft 'seven'" in out
    assert "verdict: incompatible" in out


def test_memory_budget_exceeded_fails_before_loading(capsys, tmp_path, no_loading):
    target, draft = tiny_pair_dirs(tmp_path)
    code, report = run_json(capsys, target, draft, "--memory-budget", "100KiB", "--max-num-seqs", "4")
    assert code == 1 and report["verdict"]["status"] == "does_not_fit"
    memory = report["memory"]
    assert memory["budget"] == 100 * 1024 and memory["fits"] is False and memory["num_seqs"] == 4
    assert memory["target_kv"] == 2 * 2 * 2 * 12 * 4 * 256 * 4  # bytes/token x 256 tokens x 4 sequences
    assert "does not fit in 100.0 KiB (--memory-budget)" in report["verdict"]["reason"]


def test_no_measure_runs_static_checks_only(capsys, tmp_path, no_loading):
    target, draft = tiny_pair_dirs(tmp_path)
    code, report = run_json(capsys, target, draft, "--no-measure", "--max-model-len", "64", "--dtype", "bf16",
                            "--memory-budget", "1GiB")
    assert code == 0 and report["ok"] and report["verdict"]["status"] == "not_measured"
    assert report["memory"]["context_len"] == 64 and report["memory"]["bytes_per_param"] == 2
    assert report["memory"]["fits"] is True and report["costs"] is None


@pytest.mark.parametrize("flags, message", [
    (["--memory-budget", "lots"], "not a memory size"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
])
def test_usage_errors_are_one_line(capsys, tmp_path, flags, message):
    target, draft = tiny_pair_dirs(tmp_path)
    assert main(["check", str(target), str(draft), *flags]) == 2
    assert message in capsys.readouterr().err


def test_prompts_are_read_only_for_a_pair_that_passes(capsys, tmp_path):
    missing = tmp_path / "no-prompts.jsonl"
    target, draft = tiny_pair_dirs(tmp_path, draft_tokenizer=word_tokenizer(renamed={7: "seven"}))
    code, report = run_json(capsys, target, draft, "--prompts", missing)
    assert code == 1 and report["verdict"]["status"] == "incompatible"
    assert main(["check", str(target), str(target), "--prompts", str(missing)]) == 2
    assert "no-prompts.jsonl" in capsys.readouterr().err


def test_unknown_model_is_a_usage_error(capsys, tmp_path):
    assert main(["check", str(tmp_path / "missing.gguf"), str(tmp_path / "missing.gguf"), "--no-measure"]) == 2
    assert "not found" in capsys.readouterr().err


@needs_llama_cpp
def test_check_measures_the_draft_on_the_speculative_backend_and_says_so(capsys, draftwise_home, stories_path,
                                                                         prompt_file):
    """``--speculative-backend llama.cpp``: the draft is loaded as a run would load it, and the report says on
    what (JSON and text)."""
    code, report = run_json(capsys, stories_path, stories_path, "--prompts", prompt_file, *MEASURE_FLAGS,
                            "--quantization", "int8", "--speculative-backend", "llama.cpp")
    assert code == 0 and report["settings"]["quantization"] == "int8"
    assert report["draft_runtime"] == "LlamaCppCausalLM, quantization gguf (--speculative-backend llama.cpp)"
    # the same model on two runtimes: a draft token differs from the target's only at a near-tie of the logits
    # (the two runtimes round differently); 5 of the probe's 6 agreed with the lean runtime's native attention
    assert report["costs"]["cost_ratio"] > 0 and report["probe"]["acceptance_rate"] >= 0.8
    assert main(["check", str(stories_path), str(stories_path), "--prompts", str(prompt_file), *MEASURE_FLAGS,
                 "--speculative-backend", "llama.cpp"]) == 0
    assert "draft runtime: LlamaCppCausalLM" in capsys.readouterr().out
