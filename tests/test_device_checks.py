"""``--device`` / ``--dtype`` the machine lacks (issue 21 C): one line and exit code 2, checked before any model
is read (the model paths here do not exist: a command that tried to load first would report the missing file),
and the same check in ``load_model``.

The tests fake what the machine has (CUDA present with two GPUs; a CPU that cannot compute in fp16) by
patching ``torch`` where :mod:`draftwise.backends.devices` reads it; on this CPU-only machine the real answers
are "no CUDA, no MPS, no XPU".
"""

from __future__ import annotations

import pytest
import torch

import draftwise.backends.devices as devices
from draftwise.backends.devices import DeviceError, check_device, check_dtype
from draftwise.cli import main
from draftwise.commands.common import CliError, check_device_args

MISSING_MODEL = "/nonexistent/draftwise-test/model.gguf"


def _machine_has_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _machine_lacks(monkeypatch, kind: str) -> None:
    if kind == "cuda":
        _machine_has_cuda(monkeypatch, 0)
    elif kind == "mps":
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    elif hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)


LOADERS = ["draftwise.builder.build_engine", "draftwise.builder.load_model", "draftwise.models.loading.load_model",
           "draftwise.commands.bench.load_model", "draftwise.commands.costs.load_model",
           "draftwise.commands.train_heads.load_model"]


def _never_load(monkeypatch) -> None:
    """Make every model load fail the test: the check must come first."""
    # every command module imported BEFORE patching: one first imported under the patch would keep the refusing
    # function as its module-level name for the rest of the session (later tests then fail)
    import draftwise.commands.bench  # noqa: F401 - imported so that their references can be patched
    import draftwise.commands.check  # noqa: F401
    import draftwise.commands.costs  # noqa: F401
    import draftwise.commands.generate  # noqa: F401
    import draftwise.commands.serve  # noqa: F401
    import draftwise.commands.train_heads  # noqa: F401

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the device check")

    for target in LOADERS:
        monkeypatch.setattr(target, refuse)


COMMANDS = {
    "generate": ["generate", "--model", MISSING_MODEL, "hello"],
    "serve": ["serve", MISSING_MODEL],
    "bench": ["bench", "--model", MISSING_MODEL],
    "costs": ["costs", MISSING_MODEL],
    "export-heads": ["export-heads", "/nonexistent/heads", "--output", "/nonexistent/out"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("device", "kind"), [("cuda", "cuda"), ("cuda:0", "cuda"), ("mps", "mps"), ("xpu", "xpu")])
def test_a_device_the_machine_lacks_is_one_line_and_exit_2(command, device, kind, monkeypatch, capsys):
    _machine_lacks(monkeypatch, kind)
    _never_load(monkeypatch)
    assert main(COMMANDS[command] + ["--device", device]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"draftwise {command}: error: --device: device {device!r} is not available"), lines
    assert "Traceback" not in captured.err and "not found" not in captured.err


@pytest.mark.parametrize(("device", "words"), [
    ("cuda:3", ["'cuda:3' is not available", "2 cuda devices", "cuda:0 to cuda:1"]),
    ("cuda:2", ["'cuda:2' is not available", "2 cuda devices"]),
    ("foo", ["unknown device 'foo'", "cpu, cuda, cuda:N, mps, xpu"]),
    ("cuda:x", ["unknown device 'cuda:x'"]),
    ("CUDA", ["unknown device 'CUDA'"]),
    ("", ["unknown device ''"]),
    ("meta", ["draftwise runs models on cpu, cuda, mps, xpu, not meta"]),
    ("hip", ["not hip"]),
])
def test_a_device_index_past_the_count_or_a_garbage_name(device, words, monkeypatch, capsys):
    _machine_has_cuda(monkeypatch, 2)
    _never_load(monkeypatch)
    assert main(["generate", "--model", MISSING_MODEL, "--device", device, "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("draftwise generate: error: --device: "), err
    for word in words:
        assert word in err, (word, err)


def test_a_device_the_machine_has_passes(monkeypatch):
    _machine_has_cuda(monkeypatch, 2)
    assert check_device("cuda:1") == "cuda:1" and check_device("cuda") == "cuda"
    assert check_device("cpu") == "cpu"
    _machine_has_cuda(monkeypatch, 0)
    assert check_device(None) == "cpu"  # the default: CUDA only when present


def test_a_missing_cuda_names_the_reason(monkeypatch):
    _machine_has_cuda(monkeypatch, 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(DeviceError, match="built without CUDA"):
        check_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(DeviceError, match="no CUDA GPU was found"):
        check_device("cuda")


@pytest.mark.parametrize("dtype", ["fp8", "int8", "float64", "half"])
def test_an_unknown_dtype_is_one_line_before_loading(dtype, monkeypatch, capsys):
    _never_load(monkeypatch)
    assert main(["generate", "--model", MISSING_MODEL, "--device", "cpu", "--dtype", dtype, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"draftwise generate: error: --dtype: unknown dtype {dtype!r}; choose one of"), err


def _cpu_without_fp16(monkeypatch) -> None:
    """A CPU whose PyTorch has no fp16 matrix product (older PyTorch builds: "not implemented for 'Half'")."""
    real = devices._matmul_probe

    def probe(dtype, device):
        if dtype == torch.float16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")
        real(dtype, device)

    monkeypatch.setattr(devices, "_matmul_probe", probe)


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "costs"])
def test_a_dtype_the_device_lacks_is_one_line_before_loading(command, monkeypatch, capsys):
    _cpu_without_fp16(monkeypatch)
    _never_load(monkeypatch)
    assert main(COMMANDS[command] + ["--device", "cpu", "--dtype", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"draftwise {command}: error: --dtype: dtype fp16 is not supported on cpu: "
                           "\"addmm_impl_cpu_\" not implemented for 'Half'"), err


def test_dtypes_this_cpu_computes_in_pass():
    assert check_dtype(None, "cpu") is torch.float32
    assert check_dtype("auto", "cpu") is torch.float32
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("float16", torch.float16)):
        assert check_dtype(name, "cpu") is dtype
    assert check_dtype(torch.bfloat16, "cpu") is torch.bfloat16


def test_export_heads_checks_only_the_device():
    """export-heads' --dtype is the exported weights' (bf16 by default), not a compute dtype."""
    from draftwise.cli import build_parser

    args = build_parser().parse_args(["export-heads", "h", "--output", "o", "--dtype", "fp8-not-a-compute-dtype"])
    check_device_args(args, dtype=False)
    with pytest.raises(CliError, match="--dtype: unknown dtype"):
        check_device_args(args)


def test_load_model_checks_the_device_before_reading_the_model(monkeypatch):
    from draftwise.models.loading import load_model

    _machine_has_cuda(monkeypatch, 0)
    with pytest.raises(DeviceError, match="'cuda' is not available"):
        load_model(MISSING_MODEL, device="cuda")
    _cpu_without_fp16(monkeypatch)
    with pytest.raises(DeviceError, match="dtype fp16 is not supported on cpu"):
        load_model(MISSING_MODEL, device="cpu", dtype="fp16")


@pytest.mark.parametrize("value", ["-5", "0", "abc"])
def test_a_bad_max_model_len_is_a_one_line_error(value, capsys):
    """Regression: --max-model-len -5 ended in a traceback from the rotary tables."""
    from draftwise.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "/nonexistent.gguf", "--max-model-len", value, "hi"])
    assert exit_info.value.code == 2
    assert "--max-model-len" in capsys.readouterr().err


def test_load_model_refuses_a_context_below_one(stories_path):
    from draftwise.models.loading import load_model

    with pytest.raises(ValueError, match="must be >= 1"):
        load_model(str(stories_path), max_context=-5, quantization="none")


# --------------------------------------------------------------------------- the default dtype (GPU finding)
# On an H200, bf16 targets gave speculative output that differed from plain decoding (scripts/bench/gpu_check.py:
# 1 of 6 prompts identical), fp32 matched: a target defaults to fp32 everywhere, a draft to bf16 on a GPU.


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_a_target_defaults_to_fp32_on_every_device(device):
    assert devices.parse_dtype(None, device) == torch.float32
    assert devices.parse_dtype("auto", device) == torch.float32


def test_a_draft_defaults_to_bf16_on_a_gpu_only():
    assert devices.parse_dtype(None, "cuda", drafting=True) == torch.bfloat16
    assert devices.parse_dtype(None, "cuda:0", drafting=True) == torch.bfloat16
    assert devices.parse_dtype(None, "cpu", drafting=True) == torch.float32
    assert devices.parse_dtype("fp32", "cuda", drafting=True) == torch.float32  # an explicit dtype wins


def test_the_builder_loads_a_draft_as_a_draft():
    from draftwise.builder import BuildOptions, draft_load_options
    from draftwise.config import SpeculativeConfig

    config = SpeculativeConfig(method="draft_model", model="some-draft.gguf", num_speculative_tokens=4)
    assert draft_load_options(config, BuildOptions())["drafting"] is True


def test_a_half_precision_target_is_warned_about_and_a_draft_is_not(stories_path, caplog):
    from draftwise.models.loading import load_model

    caplog.set_level("WARNING", logger="draftwise.models.loading")
    try:
        load_model(str(stories_path), device="cpu", dtype="bf16", quantization="none", runtime="transformers")
    except DeviceError:
        pytest.skip("this CPU cannot compute in bf16")
    assert "not row-invariant" in caplog.text
    caplog.clear()
    load_model(str(stories_path), device="cpu", dtype="bf16", quantization="none", runtime="transformers",
               drafting=True)
    assert "not row-invariant" not in caplog.text
    load_model(str(stories_path), device="cpu", dtype="fp32", quantization="none", runtime="transformers")
    assert "not row-invariant" not in caplog.text


def test_gpu_passes_leave_out_cudnn_attention():
    """PyTorch picked cuDNN's attention for bf16 on an H200, which built a plan per key length: 50-80 ms a pass
    against 6-8 ms without it (torch_backend.attention_backends). CPU passes keep PyTorch's choice."""
    from torch.nn.attention import SDPBackend

    from draftwise.backends.torch_backend import attention_backends

    assert attention_backends("cpu") is None
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        kernels = attention_backends(device)
        assert SDPBackend.CUDNN_ATTENTION not in kernels
        assert SDPBackend.FLASH_ATTENTION in kernels and SDPBackend.MATH in kernels


def test_a_gpu_run_is_not_judged_by_its_cpu_share():
    """A GPU-bound run leaves the CPU idle: the bench flagged every H200 run 'machine busy' (6% CPU share)."""
    from types import SimpleNamespace

    from draftwise.speculation.measurement import backend_threads

    assert backend_threads(SimpleNamespace(device=torch.device("cuda", 0))) is None
    assert backend_threads(SimpleNamespace(device=torch.device("cpu"))) == torch.get_num_threads()
    assert backend_threads(SimpleNamespace(n_threads=3)) == 3
