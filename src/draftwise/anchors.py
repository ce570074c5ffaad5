"""External anchors for benchmarks: Hugging Face transformers' own speculative decoding on the same models.

``assisted generation`` (``generate(assistant_model=...)``, a draft model) and ``prompt lookup decoding``
(``generate(prompt_lookup_num_tokens=...)``), both greedy, timed the same way as draftwise's engine so the
speed-ups stand side by side.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from draftwise.backends.torch_backend import TorchCausalLM
from draftwise.config import SamplingParams
from draftwise.engine import GenerationResult
from draftwise.stats import SpeculativeStats

__all__ = ["hf_runner"]


def hf_runner(target: TorchCausalLM, eos_token_ids: Iterable[int], *, assistant: TorchCausalLM | None = None,
              prompt_lookup_tokens: int | None = None, num_assistant_tokens: int | None = None):
    """A benchmark runner ``(prompt_ids, params) -> GenerationResult`` around ``transformers.generate``.

    Args:
        target: the draftwise PyTorch backend whose ``model`` is the target.
        eos_token_ids: stop tokens (as the engine uses).
        assistant: draft backend for assisted generation (constant schedule of ``num_assistant_tokens``).
        prompt_lookup_tokens: K for prompt lookup decoding.

    Raises:
        ValueError: for sampling params (the anchors are run greedy only).
    """
    eos = sorted(set(eos_token_ids))
    if assistant is not None and num_assistant_tokens:
        assistant.model.generation_config.num_assistant_tokens = num_assistant_tokens
        assistant.model.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.model.generation_config.assistant_confidence_threshold = 0.0

    @torch.inference_mode()
    def run(prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not params.greedy:
            raise ValueError("the transformers anchors run greedy decoding only")
        input_ids = torch.tensor([prompt_ids], device=target.device)
        kwargs: dict = dict(max_new_tokens=params.max_tokens, do_sample=False, eos_token_id=None if params.ignore_eos else eos,
                            pad_token_id=eos[0] if eos else 0, attention_mask=torch.ones_like(input_ids))
        if assistant is not None:
            kwargs["assistant_model"] = assistant.model
        if prompt_lookup_tokens:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
        start = time.perf_counter()
        output = target.model.generate(input_ids, **kwargs)
        elapsed = time.perf_counter() - start
        tokens = output[0, len(prompt_ids):].tolist()
        reason = "length"
        for i, token in enumerate(tokens):
            if token in eos and not params.ignore_eos:
                tokens, reason = tokens[:i], "stop"
                break
        stats = SpeculativeStats(num_prompt_tokens=len(prompt_ids), num_generated_tokens=len(tokens),
                                 total_time_s=elapsed, finish_reason=reason)
        return GenerationResult(token_ids=tokens, finish_reason=reason, stats=stats)

    return run
