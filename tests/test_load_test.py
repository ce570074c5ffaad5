"""scripts/bench/load_test.py in its in-process mode (``--serve``): a batched stories260K server, two levels."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from conftest import REPO
from draftwise.backends.quantization import int8_kernels_available


def load_script():
    spec = importlib.util.spec_from_file_location("load_test", REPO / "scripts/bench/load_test.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not int8_kernels_available(), reason="torch build without fbgemm int8 kernels")
def test_in_process_load_test_reports_batching(draftwise_home, stories_path, tmp_path):
    script = load_script()
    out = tmp_path / "lt.json"
    old = torch.get_num_threads()
    try:
        code = script.main(["--serve", str(stories_path), "--quantization", "int8", "--max-num-seqs", "4",
                            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                            "--concurrency", "1,4", "--max-tokens", "12", "--ignore-eos", "--requests-per-client", "1",
                            "--warmup", "0", "--torch-threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(old)
    assert code == 0
    summaries = json.loads(out.read_text())["summaries"]
    assert [s["concurrency"] for s in summaries] == [1, 4] and all(s["errors"] == 0 for s in summaries)
    assert all(s["completion_tokens"] == 12 * s["concurrency"] for s in summaries)
    assert summaries[0]["batch_size_mean"] == 1.0 and summaries[1]["batch_size_mean"] > 1.0  # really batched
    assert summaries[1]["client_tokens_per_s_min"] > 0 and summaries[1]["batch_k_mean"] is not None


def test_bounds_refuse_remote_hosts_and_huge_runs():
    script = load_script()
    with pytest.raises(SystemExit, match="non-loopback"):
        script.check_bounds(script.parse_args(["--base-url", "http://8.8.8.8:8000"]), [1])
    with pytest.raises(SystemExit, match="prompt-repeat"):
        script.check_bounds(script.parse_args(["--prompt-repeat", "0"]), [1])
