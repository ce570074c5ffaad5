"""``draftwise train-heads`` (Medusa / EAGLE heads by self-distillation) and ``draftwise export-heads`` (vLLM layout).

``train-heads MODEL --method medusa|eagle --output DIR``: splits the prompts into training and held-out parts
(``DIR/heldout.jsonl``, Spec-Bench lines for ``draftwise bench --prompts``), lets the target continue every prompt
greedily and caches its features (``DIR/cache``), trains with checkpoints (``DIR/checkpoint.pt``; ``--resume``),
evaluates on the held-out prompts and saves ``DIR/heads.safetensors`` + ``DIR/heads_config.json``; with
``--export-vllm DIR2`` it also writes the vLLM layout. See ``docs/heads.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from draftwise.benchmark import default_prompts_path, load_prompts
from draftwise.commands.common import CliError, check_device_args
from draftwise.heads.config import CONFIG_FILE, METHODS, HeadsConfig, base_model_identity
from draftwise.heads.data import PromptSplit, build_samples, split_prompts, write_prompts_jsonl
from draftwise.heads.eagle import eagle_layer_config
from draftwise.heads.export import EXPORT_FORMATS, export_vllm, parse_export_dtype
from draftwise.heads.io import WEIGHTS_FILE, load_heads, save_heads
from draftwise.heads.training import TrainResult, TrainSettings, evaluate_heads, train_heads
from draftwise.models.loading import LoadedModel, load_model

__all__ = ["register", "run_train", "run_export", "CHECKPOINT_FILE", "HELDOUT_FILE"]

logger = logging.getLogger(__name__)

#: Files inside a ``train-heads --output`` directory besides the heads themselves.
CHECKPOINT_FILE = "checkpoint.pt"
HELDOUT_FILE = "heldout.jsonl"


def register(subparsers) -> None:
    _register_train(subparsers)
    _register_export(subparsers)


def _register_train(subparsers) -> None:
    parser = subparsers.add_parser("train-heads", help="train Medusa or EAGLE draft heads on a target's own outputs")
    parser.add_argument("model", help="target: registry name, .gguf file or Hugging Face directory")
    parser.add_argument("--method", required=True, help=f"{' or '.join(METHODS)}")
    parser.add_argument("--output", required=True, help="heads directory (also holds cache/, checkpoint.pt, heldout.jsonl)")
    parser.add_argument("--num-heads", type=int, default=3, help="Medusa heads (default 3)")
    parser.add_argument("--num-layers", type=int, default=1, help="residual blocks per Medusa head (default 1; EAGLE: 1)")
    parser.add_argument("--prompts", default=None, help="JSONL prompt file(s), comma-separated (default: Spec-Bench questions)")
    parser.add_argument("--num-prompts", type=int, default=None, help="training prompts (default: all not held out)")
    parser.add_argument("--held-out", type=int, default=4, help="prompts held out per category (default 4)")
    parser.add_argument("--held-out-categories", default=None, help="comma-separated categories to hold prompts out of "
                        "(default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="continuation length per prompt (default 128)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024,
                        help="keep the last N tokens of longer prompts (default 1024)")
    parser.add_argument("--chat", choices=["auto", "off"], default="auto", help="apply the chat template (as bench)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training data (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps in total (overrides --epochs)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: medusa 3e-3, eagle 1e-3)")
    parser.add_argument("--batch-tokens", type=int, default=512, help="training positions per step (default 512)")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    parser.add_argument("--eval-depth", type=int, default=4, help="EAGLE draft depth evaluated on held-out data (default 4)")
    parser.add_argument("--eval-anchors", type=int, default=16, help="EAGLE roll-out anchors per held-out sequence (default 16)")
    parser.add_argument("--eagle-fc-bias", action="store_true", help="train EAGLE's fc bias (vLLM's EAGLE-1 drops it)")
    parser.add_argument("--eagle-noise", type=float, default=0.0,
                        help="EAGLE: uniform noise U(-a, a) on the input features while training (default 0: off)")
    parser.add_argument("--cache-dir", default=None, help="sample cache (default OUTPUT/cache)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint.pt")
    parser.add_argument("--overwrite", action="store_true", help="start afresh even if OUTPUT has a checkpoint")
    parser.add_argument("--export-vllm", default=None, metavar="DIR", help="also write the vLLM layout into DIR")
    parser.add_argument("--export-dtype", default="bf16", help="vLLM export weight dtype: bf16 (default), fp16, fp32")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="target dtype: fp32, bf16, fp16 (default: fp32 CPU, bf16 GPU)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run_train)


def _register_export(subparsers) -> None:
    parser = subparsers.add_parser("export-heads", help="write trained heads in vLLM's medusa / eagle layout")
    parser.add_argument("heads", help="heads directory written by train-heads")
    parser.add_argument("--output", required=True, help="export directory")
    parser.add_argument("--format", default="vllm", help=f"{', '.join(EXPORT_FORMATS)} (default vllm)")
    parser.add_argument("--model", default=None, help="the target (default: the base model named in heads_config.json)")
    parser.add_argument("--dtype", default="bf16", help="weight dtype: bf16 (default), fp16, fp32")
    parser.add_argument("--lm-head", choices=["shared", "per-head"], default="shared",
                        help="Medusa: one LM head copy with original_lm_head (default) or one per head (older vLLM)")
    parser.add_argument("--include-embeddings", action="store_true",
                        help="EAGLE: also write embed_tokens.weight (vLLM needs it only with pipeline parallelism)")
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(func=run_export)


# ---------------------------------------------------------------------------------------------- train-heads
def _settings(args: argparse.Namespace) -> TrainSettings:
    method = args.method.strip().lower()
    if method not in METHODS:
        raise CliError(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    lr = args.lr if args.lr is not None else (3e-3 if method == "medusa" else 1e-3)
    return TrainSettings(method=method, num_heads=args.num_heads, num_layers=args.num_layers, epochs=args.epochs,
                         steps=args.steps, lr=lr, weight_decay=args.weight_decay, batch_tokens=args.batch_tokens,
                         eagle_fc_bias=args.eagle_fc_bias, eagle_noise=args.eagle_noise, seed=args.seed,
                         checkpoint_every=args.checkpoint_every, eval_depth=args.eval_depth,
                         eval_anchors=args.eval_anchors)


def _split(args: argparse.Namespace) -> tuple[list[str], PromptSplit]:
    paths = [p.strip() for p in args.prompts.split(",") if p.strip()] if args.prompts else [str(default_prompts_path())]
    prompts = []
    for path in paths:
        if not Path(path).is_file():
            raise CliError(f"prompt file not found: {path}")
        prompts += load_prompts(path)
    if not prompts:
        raise CliError(f"no prompts in {', '.join(paths)}")
    categories = None
    if args.held_out_categories:
        categories = [c.strip() for c in args.held_out_categories.split(",") if c.strip()]
    split = split_prompts(prompts, held_out=args.held_out, held_out_categories=categories, num_train=args.num_prompts,
                          seed=args.seed)
    return paths, split


def _check_output(output: Path, args: argparse.Namespace) -> None:
    if args.resume and args.overwrite:
        raise CliError("--resume and --overwrite exclude each other")
    checkpoint = output / CHECKPOINT_FILE
    if checkpoint.exists() and not (args.resume or args.overwrite):
        raise CliError(f"{output} already holds a training checkpoint; pass --resume to continue it or --overwrite "
                       "to start afresh (the sample cache is reused either way)")
    if args.overwrite:
        checkpoint.unlink(missing_ok=True)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)


def _samples(target: LoadedModel, prompts, label: str, fingerprint: str, cache_dir: Path, args, console: Console):
    if not prompts:
        return []
    with _progress(console) as progress:
        task = progress.add_task(f"{label} continuations", total=len(prompts))
        return build_samples(target, prompts, fingerprint=fingerprint, cache_dir=cache_dir,
                             max_new_tokens=args.max_new_tokens, chat=args.chat == "auto",
                             max_prompt_tokens=args.max_prompt_tokens,
                             on_sample=lambda sample, cached: progress.advance(task))


def _train(model, samples, settings: TrainSettings, fingerprint: str, output: Path, resume: bool,
           console: Console) -> TrainResult:
    with _progress(console) as progress:
        task = progress.add_task("training", total=None)

        def on_step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total, description=f"training (loss {loss:.3f})")

        return train_heads(model, samples, settings, fingerprint=fingerprint, checkpoint_path=output / CHECKPOINT_FILE,
                           resume=resume, on_step=on_step)


def run_train(args: argparse.Namespace) -> int:
    check_device_args(args)
    began = time.perf_counter()
    settings = _settings(args)
    if args.max_new_tokens < 2:
        raise CliError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    if args.max_prompt_tokens < 1:
        raise CliError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    export_dtype = parse_export_dtype(args.export_dtype)
    prompt_files, split = _split(args)
    output = Path(args.output)
    _check_output(output, args)
    output.mkdir(parents=True, exist_ok=True)
    write_prompts_jsonl(output / HELDOUT_FILE, split.heldout)
    console = Console(stderr=True)
    console.print(f"loading {args.model} ...")
    target = load_model(args.model, device=args.device, dtype=args.dtype)
    model = getattr(target.backend, "model", None)
    if model is None:
        raise CliError("train-heads needs the PyTorch backend")
    fingerprint = base_model_identity(model)
    cache_dir = Path(args.cache_dir) if args.cache_dir else output / "cache"
    data_began = time.perf_counter()
    train_samples = _samples(target, split.train, "training", fingerprint, cache_dir, args, console)
    heldout_samples = _samples(target, split.heldout, "held-out", fingerprint, cache_dir, args, console)
    data_time = time.perf_counter() - data_began
    result = _train(model, train_samples, settings, fingerprint, output, args.resume, console)
    evaluation = evaluate_heads(result.heads, model, heldout_samples, settings)
    training = _training_record(args, settings, prompt_files, split, train_samples, heldout_samples, result, evaluation,
                                data_time, time.perf_counter() - began, target)
    config = _heads_config(target, model, settings, fingerprint, training)
    save_heads(output, result.heads, config)
    exported = None
    if args.export_vllm:
        exported = export_vllm(result.heads, config, model, args.export_vllm, dtype=export_dtype)
    _report(console, args, output, config, exported)
    return 0


def _heads_config(target: LoadedModel, model, settings: TrainSettings, fingerprint: str, training: dict) -> HeadsConfig:
    return HeadsConfig(
        method=settings.method, hidden_size=int(model.config.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]), base_model=target.name,
        base_fingerprint=fingerprint, num_heads=settings.num_heads if settings.method == "medusa" else 1,
        num_layers=settings.num_layers, eagle=eagle_layer_config(model.config) if settings.method == "eagle" else {},
        training=training,
    )


def _training_record(args, settings: TrainSettings, prompt_files, split: PromptSplit, train_samples, heldout_samples,
                     result: TrainResult, evaluation: dict, data_time: float, wall_time: float, target) -> dict:
    """The ``training`` field of the heads config: how, on what, how long, how well."""
    losses = result.losses
    return {
        "settings": result.settings,
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "prompt_files": prompt_files,
        "chat": args.chat,
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "train_prompts": len(split.train),
        "train_prompt_ids": [p.id for p in split.train],
        "train_generated_tokens": sum(s.num_generated for s in train_samples),
        "train_positions": result.num_positions,
        "heldout_file": HELDOUT_FILE,
        "heldout_prompt_ids": [p.id for p in split.heldout],
        "heldout_categories": sorted({p.category for p in split.heldout}),
        "heldout_generated_tokens": sum(s.num_generated for s in heldout_samples),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "data_time_s": round(data_time, 2),
        "train_time_s": round(result.train_time_s, 2),
        "wall_time_s": round(wall_time, 2),
        "eval": evaluation,
        "device": str(target.backend.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _report(console: Console, args, output: Path, config: HeadsConfig, exported) -> None:
    heads_bytes = (output / WEIGHTS_FILE).stat().st_size
    training = config.training
    if args.json:
        print(json.dumps({"output": str(output), "heads_bytes": heads_bytes, "method": config.method,
                          "export": None if exported is None else str(exported.directory),
                          "export_bytes": None if exported is None else exported.weights_bytes,
                          "training": training}, indent=2))
        return
    table = Table(title=f"{config.method} heads for {config.base_model}: held-out top-1 accuracy")
    evaluation = training.get("eval") or {}
    if config.method == "medusa":
        for column in ("head", "predicts", "top-1", "chain (all heads so far right)"):
            table.add_column(column, justify="right")
        for i, top1 in enumerate(evaluation.get("top1", [])):
            chain = evaluation.get("chain", [])
            table.add_row(str(i), f"t+{i + 2}", _pct(top1), _pct(chain[i] if i < len(chain) else None))
    else:
        for column in ("depth", "top-1", "chain (all depths so far right)"):
            table.add_column(column, justify="right")
        depths = evaluation.get("top1_by_depth", [])
        chain = evaluation.get("chain_by_depth", [])
        for d, top1 in enumerate(depths):
            table.add_row(str(d + 1), _pct(top1), _pct(chain[d]))
    console.print(table)
    print(f"heads: {output / WEIGHTS_FILE} ({heads_bytes} bytes) + {output / CONFIG_FILE}")
    print(f"steps {training['steps']}, {training['train_prompts']} prompts, {training['train_generated_tokens']} "
          f"generated tokens; data {training['data_time_s']:.1f} s, training {training['train_time_s']:.1f} s, "
          f"wall {training['wall_time_s']:.1f} s; loss {training['first_loss']:.3f} -> {training['final_loss']:.3f}")
    print(f"held-out prompts: {output / HELDOUT_FILE} (draftwise bench --prompts {output / HELDOUT_FILE})")
    if exported is not None:
        print(f"vLLM export: {exported.directory} ({exported.weights_bytes} bytes of weights)")


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


# ---------------------------------------------------------------------------------------------- export-heads
def run_export(args: argparse.Namespace) -> int:
    check_device_args(args, dtype=False)  # --dtype here is the exported weights', not a compute dtype
    if args.format not in EXPORT_FORMATS:
        raise CliError(f"--format must be one of {', '.join(EXPORT_FORMATS)}, got {args.format!r}")
    dtype = parse_export_dtype(args.dtype)
    config = HeadsConfig.from_json_file(Path(args.heads) / CONFIG_FILE)
    spec = args.model or config.base_model
    target = load_model(spec, device=args.device)
    model = getattr(target.backend, "model", None)
    if model is None:
        raise CliError("export-heads needs the PyTorch backend")
    heads, config = load_heads(args.heads, fingerprint=base_model_identity(model), base_name=spec)
    exported = export_vllm(heads, config, model, args.output, dtype=dtype, shared_lm_head=args.lm_head == "shared",
                           include_embeddings=args.include_embeddings)
    print(f"wrote {exported.directory}/config.json and model.safetensors ({exported.weights_bytes} bytes); serve with:")
    print(f"  vllm serve TARGET --speculative-config '{{\"method\": \"{config.method}\", \"model\": \"{exported.directory}\", "
          f"\"num_speculative_tokens\": {config.num_heads if config.method == 'medusa' else 3}}}'")
    return 0
