"""Device check on a CUDA GPU: does speculative decoding on the PyTorch backend return plain decoding's output?

The CPU paths are exact by construction (row-invariant int8 / Q4_K kernels, ``docs/kernels.md``). On a GPU the
target runs through transformers (``TorchCausalLM``, fp32 by default, SDPA attention), whose matrix products
may round a row differently in a 5-row verify pass than in a 1-row decode pass (in bf16 they did: docs/gpu.md).
This script measures, on the GPU it runs on, for each ``--dtypes`` entry (default ``fp32``, the default dtype):

1. **Row invariance of the target's passes**: the logits of the same positions computed one token per pass
   and in passes of ``K + 1`` tokens (largest absolute difference, and the positions whose argmax differs).
2. **Greedy output**: plain decoding against a draft-model proposer (the target itself as its own draft, so
   every difference is the target's numerics) and an n-gram proposer, K = 4, token for token.
3. **Seeded sampling**: the same seed with and without speculation (coupled sampling) gives the same text
   when the target's passes are row-invariant.

Models: a real trained one (``--model``, e.g. ``stories260K.gguf``) and a randomly initialised Llama of
realistic width (``--random-hidden``, a multiple of 128; 0 leaves it out; its near-flat distributions make argmax
ties likely, so it is a stress test, not a measure of how often a trained model's output changes).

Exit codes: 0 every output identical to plain decoding; 1 an output differed; 2 no CUDA device or a usage error;
3 the check itself failed (the log has the traceback). Results go to ``OUT/gpu_check.json`` and the log.

Usage: ``python scripts/bench/gpu_check.py --model stories260K.gguf --out OUT [--dtypes fp32,bf16]``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from draftwise.backends.torch_backend import TorchCausalLM
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import load_model
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer

logger = logging.getLogger("gpu_check")
K = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def row_invariance(module: torch.nn.Module, prompt: list[int], tokens: list[int], rows: int) -> dict:
    """Logits of ``tokens`` fed one per pass against ``rows`` per pass after the same ``prompt``.

    Returns: ``max_abs_diff`` (largest logit difference over ``len(tokens)`` positions), ``argmax_flips``
    (positions whose argmax differs) and ``positions``."""
    one, many = TorchCausalLM(module), TorchCausalLM(module)
    one.forward(prompt, num_logits=1)
    many.forward(prompt, num_logits=1)
    single = torch.cat([one.forward([t], num_logits=1).logits for t in tokens])
    chunks = [tokens[i:i + rows] for i in range(0, len(tokens), rows)]
    batched = torch.cat([many.forward(c, num_logits=len(c)).logits for c in chunks])
    diff = (single - batched).abs().max().item()
    flips = int((single.argmax(-1) != batched.argmax(-1)).sum())
    return {"rows": rows, "positions": len(tokens), "max_abs_diff": diff, "argmax_flips": flips}


def _mean(values) -> float | None:
    """Mean of the values that are not None (a request without drafts has no acceptance rate)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_methods(module: torch.nn.Module, prompts: list[list[int]], label: str, max_tokens: int) -> list[dict]:
    """Plain vs self-draft and n-gram (K=4), greedy and seeded sampling: identical outputs and speed."""
    vocab = int(module.get_output_embeddings().weight.shape[0])
    rows = []
    for mode, make_params in [("greedy", lambda i: SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                              ("sampled T=1 seed", lambda i: SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                          temperature=1.0, seed=i))]:
        plain_out, plain_s, _ = None, None, None
        for method in ("plain", "self-draft", "ngram", "plain (repeat)"):
            target = TorchCausalLM(module)
            proposer = {"self-draft": lambda: DraftModelProposer(TorchCausalLM(module), vocab),
                        "ngram": lambda: NgramProposer()}.get(method, lambda: None)()
            engine = SpeculativeEngine(target, proposer, num_speculative_tokens=K)
            outs = []
            start_all = time.perf_counter()
            stats = []
            for i, prompt in enumerate(prompts):
                result = engine.generate(prompt, make_params(i))
                outs.append(list(result.token_ids))
                stats.append((result.stats.acceptance_rate, result.stats.mean_accepted_length))
            _sync()
            seconds = time.perf_counter() - start_all
            if plain_out is None:
                plain_out, plain_s = outs, seconds
            diffs = [first_difference(a, b) for a, b in zip(plain_out, outs)]
            row = {"model": label, "mode": mode, "method": method, "K": K if proposer else 0,
                   "identical": sum(d is None for d in diffs), "prompts": len(prompts),
                   "first_differences": [d for d in diffs if d is not None],
                   "tokens_per_s": sum(map(len, outs)) / seconds, "speedup": plain_s / seconds,
                   "alpha": _mean(s[0] for s in stats) if proposer else None,
                   "tau": _mean(s[1] for s in stats) if proposer else None}
            logger.info("%s %s %-14s identical %d/%d first differences %s  %.1f tok/s  %.2fx  alpha %s tau %s",
                        label, mode, method, row["identical"], row["prompts"], row["first_differences"],
                        row["tokens_per_s"], row["speedup"], _fmt(row["alpha"]), _fmt(row["tau"]))
            rows.append(row)
    return rows


def repetitive_prompts(vocab: int, count: int, generator: torch.Generator) -> list[list[int]]:
    """Prompts of a random 24-token phrase said three times, so that n-gram lookup has something to find."""
    prompts = []
    for _ in range(count):
        phrase = torch.randint(10, vocab, (24,), generator=generator).tolist()
        prompts.append(phrase * 3)
    return prompts


def random_llama(hidden: int, layers: int, vocab: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A randomly initialised Llama of the given width on the GPU (transformers' default initialisation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
                         vocab_size=vocab, max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a real model (.gguf, directory or registry name)")
    parser.add_argument("--random-hidden", type=int, default=2048, help="width of the random Llama (0: none)")
    parser.add_argument("--random-layers", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench_results/gpu_check"),
                        help="folder for gpu_check.json and gpu_check.log (default bench_results/gpu_check)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script itself")
    parser.add_argument("--dtypes", default="fp32", help="comma-separated target dtypes to check: fp32 (the default "
                        "dtype), bf16, fp16 (default fp32)")
    args = parser.parse_args()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes!r}")
    if args.random_hidden and (args.random_hidden < 128 or args.random_hidden % 128):
        parser.error(f"--random-hidden must be 0 or a multiple of 128 (heads of 128), got {args.random_hidden}")
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "gpu_check.log")])
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        logger.error("no CUDA device: this check runs on a GPU only")
        return 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"device": name, "torch": torch.__version__, "invariance": [], "outputs": []}
    logger.info("device %s, torch %s", report["device"], report["torch"])
    generator = torch.Generator().manual_seed(0)
    cases = []
    if args.model:
        for dtype in dtypes:
            loaded = load_model(args.model, device=args.device, dtype=dtype, quantization="none")
            texts = ["Once upon a time", "Lily and Ben went to the park.", "The little dog was sad because",
                     "Tom had a red ball."]
            prompts = [loaded.encode(texts[i % len(texts)]) for i in range(args.prompts)]
            cases.append((f"{Path(args.model).name} {dtype}", loaded.backend.model, prompts))
    for dtype in ([DTYPES[d] for d in dtypes] if args.random_hidden else []):
        module = random_llama(args.random_hidden, args.random_layers, 32000, dtype, args.device)
        cases.append((f"random llama h{args.random_hidden} L{args.random_layers} {str(dtype)[6:]}", module,
                      repetitive_prompts(32000, args.prompts, generator)))
    for label, module, prompts in cases:
        vocab = int(module.get_output_embeddings().weight.shape[0])
        tokens = torch.randint(1, vocab, (60,), generator=generator).tolist()
        for rows in (K + 1, 2 * K + 1):
            row = row_invariance(module, prompts[0], tokens, rows)
            row["model"] = label
            logger.info("%s: %d-row passes vs 1-row: max |logit diff| %.3g, argmax flips %d/%d", label, rows,
                        row["max_abs_diff"], row["argmax_flips"], row["positions"])
            report["invariance"].append(row)
        report["outputs"].extend(compare_methods(module, prompts, label, args.max_tokens))
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    exact = all(r["identical"] == r["prompts"] for r in report["outputs"])
    logger.info("all outputs identical to plain decoding: %s", exact)
    return 0 if exact else 1


def _main_or_3() -> int:
    try:
        return main()
    except Exception:  # noqa: BLE001 - a failed check must not read as "an output differed" (exit 1)
        logger.exception("the GPU check failed")
        return 3


if __name__ == "__main__":
    sys.exit(_main_or_3())
