"""Training Medusa heads and the EAGLE head on the target's own continuations (:mod:`.data`).

Medusa-1 (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
https://arxiv.org/abs/2401.10774): the target is frozen; head i on the feature h_t is trained with cross-entropy
against token x_{t+2+i} through the target's own LM head, and the heads' losses are summed with weights
``medusa_decay ** i`` (0.8 in the reference code), since later heads are harder and matter less.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
https://arxiv.org/abs/2401.15077): the head reads the pairs (f_j, embed(x_{j+1})) of a whole sequence with
causal attention and regresses the next feature f_{j+1} (smooth L1, averaged over the hidden dimension) plus
``eagle_ce_weight`` (0.1, as in the paper) times the cross-entropy of lm_head(prediction) against x_{j+2}.

Both use AdamW in float32 (the heads' device is the target's), a short linear warm-up then cosine decay to a
tenth of the learning rate, gradient clipping, and a deterministic batch order (seeded per epoch), so a run
resumed from a checkpoint (heads, optimizer, step, written atomically) continues exactly where it stopped.
Positions train only where their label is a target-generated token.

Evaluation on held-out sequences: Medusa: top-1 accuracy of each head, and the fraction of positions where heads
0..d-1 are all right (what a chain draft of depth d gets accepted). EAGLE: depth 1 teacher-forced (the target's
features), depths 2..D by rolling the head out on its own predicted features with its KV cache
(:class:`~draftwise.heads.eagle.HeadCache`) from a sample of anchor positions, feeding the true next tokens;
again per-depth top-1 and the all-correct-so-far chain rate.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.files import atomic_write
from draftwise.heads.config import METHODS, HeadsMismatchError
from draftwise.heads.data import HeadsSample
from draftwise.heads.eagle import EagleHead, HeadCache, eagle_layer_config
from draftwise.heads.medusa import MedusaHeads

__all__ = ["TrainSettings", "TrainResult", "FrozenTarget", "new_heads", "medusa_examples", "eagle_loss_positions",
           "medusa_head_loss", "eagle_sequence_loss", "train_heads", "evaluate_heads", "evaluate_medusa",
           "evaluate_eagle", "save_checkpoint", "load_checkpoint", "lr_at", "IGNORE"]

logger = logging.getLogger(__name__)

#: Label value that marks "no target-generated token here" (``F.cross_entropy``'s ignore_index).
IGNORE = -100
_CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class TrainSettings:
    """How to train (validated).

    Attributes:
        method: ``"medusa"`` or ``"eagle"``.
        num_heads: Medusa heads (draft depth they cover); ignored for EAGLE.
        num_layers: residual blocks per Medusa head; EAGLE has exactly one decoder layer.
        epochs: passes over the training data (ignored when ``steps`` is set).
        steps: optimizer steps in total (None: ``epochs`` passes).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        batch_tokens: training positions per optimizer step (EAGLE: whole sequences are added until this many
            positions; at least one sequence).
        max_grad_norm: gradient clipping (L2 norm over all head parameters).
        medusa_decay: weight of head i's loss is ``medusa_decay ** i``.
        eagle_ce_weight: weight of EAGLE's token cross-entropy next to the feature regression.
        eagle_fc_bias: train the bias of EAGLE's ``fc``. Off by default: vLLM's EAGLE-1 model (``llama_eagle``)
            builds ``fc`` without a bias and would silently drop a trained one on export.
        eagle_noise: EAGLE: amplitude a of uniform noise U(-a, a) added to the input features during training (the
            reference code's "data noise", which makes the head tolerate its own imprecise features when drafting
            deeper); 0 disables it. Seeded per step, so resumed runs replay it.
        seed: initialisation and batch-order seed.
        checkpoint_every: write a checkpoint every this many steps (and at the end).
        eval_depth: EAGLE: draft depth of the held-out roll-out evaluation.
        eval_anchors: EAGLE: roll-out start positions per held-out sequence (evenly spaced).
    """

    method: str
    num_heads: int = 3
    num_layers: int = 1
    epochs: int = 3
    steps: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_tokens: int = 512
    max_grad_norm: float = 1.0
    medusa_decay: float = 0.8
    eagle_ce_weight: float = 0.1
    eagle_fc_bias: bool = False
    eagle_noise: float = 0.0
    seed: int = 0
    checkpoint_every: int = 50
    eval_depth: int = 4
    eval_anchors: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown heads method {self.method!r}; choose one of {', '.join(METHODS)}")
        checks = {"--num-heads": self.num_heads, "--num-layers": self.num_layers, "--epochs": self.epochs,
                  "--batch-tokens": self.batch_tokens, "--checkpoint-every": self.checkpoint_every,
                  "--eval-depth": self.eval_depth, "--eval-anchors": self.eval_anchors}
        for name, value in checks.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if not (self.eagle_noise >= 0 and math.isfinite(self.eagle_noise)):
            raise ValueError(f"--eagle-noise must be >= 0, got {self.eagle_noise}")
        if self.method == "eagle" and self.num_layers != 1:
            raise ValueError("an EAGLE head has exactly one decoder layer (--num-layers 1)")


@dataclass
class TrainResult:
    """A finished (or resumed and finished) training run.

    Attributes:
        heads: the trained module (eval mode).
        steps: optimizer steps done in total.
        losses: training loss per step (all steps, across resumes).
        train_time_s: seconds spent in optimizer steps (across resumes).
        resumed_from: step the run resumed from (0 for a fresh run).
        num_positions: training positions (Medusa: feature rows with a label; EAGLE: labelled pairs).
        settings: the :class:`TrainSettings` as a dict (for the heads config's ``training`` record).
    """

    heads: nn.Module
    steps: int
    losses: list[float]
    train_time_s: float
    resumed_from: int
    num_positions: int
    settings: dict = field(default_factory=dict)


class FrozenTarget:
    """The target's LM head and input embedding as frozen float32 functions (shared, never trained or saved).

    Args:
        model: the target ``transformers`` causal LM.
        device: where the heads train (the weights are used in place when already float32 there).
    """

    def __init__(self, model: nn.Module, device: torch.device | str) -> None:
        head = model.get_output_embeddings()
        self.lm_weight = head.weight.detach().to(device, torch.float32)  # [V, H]
        bias = getattr(head, "bias", None)
        self.lm_bias = None if bias is None else bias.detach().to(device, torch.float32)  # [V]
        self.embed_weight = model.get_input_embeddings().weight.detach().to(device, torch.float32)  # [V_in, H]
        self.device = torch.device(device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]`` logits."""
        return F.linear(hidden, self.lm_weight, self.lm_bias)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64 -> ``[n, H]`` input embeddings."""
        return F.embedding(token_ids.to(self.device), self.embed_weight)


def new_heads(settings: TrainSettings, model: nn.Module) -> nn.Module:
    """Freshly initialised heads for the target ``model`` (seeded by ``settings.seed``), float32.

    EAGLE's ``fc`` bias starts at zero and stays frozen unless ``settings.eagle_fc_bias``.
    """
    torch.manual_seed(settings.seed)
    hidden = int(model.config.hidden_size)
    if settings.method == "medusa":
        return MedusaHeads(hidden, settings.num_heads, settings.num_layers)
    head = EagleHead(hidden, eagle_layer_config(model.config))
    with torch.no_grad():
        head.fc.bias.zero_()
    head.fc.bias.requires_grad_(settings.eagle_fc_bias)
    return head


# ---------------------------------------------------------------------------------------------- Medusa
def medusa_examples(samples: Sequence[HeadsSample], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training rows for Medusa: features h_t and labels x_{t+2+i} per head.

    A label is kept only where it is a target-generated token (index >= prompt_len) inside the sequence;
    rows where no head has a label are dropped.

    Returns:
        features ``[N, H]`` float32 and labels ``[N, num_heads]`` int64 (:data:`IGNORE` where absent).
    """
    features, labels = [], []
    offsets = torch.arange(num_heads) + 2  # head i reads h_t, predicts x_{t+2+i}
    for sample in samples:
        length, prompt_len = int(sample.tokens.shape[0]), sample.prompt_len
        start, end = max(0, prompt_len - 1 - num_heads), length - 2  # rows t in [start, end)
        if end <= start:
            continue
        rows = torch.arange(start, end)
        index = rows[:, None] + offsets[None, :]  # [n, heads]
        valid = (index >= prompt_len) & (index < length)
        row_labels = torch.where(valid, sample.tokens[index.clamp(max=length - 1)], torch.full_like(index, IGNORE))
        keep = valid.any(dim=1)
        features.append(sample.features[rows[keep]])
        labels.append(row_labels[keep])
    if not features:
        raise ValueError("no training positions: every continuation is shorter than 2 tokens")
    return torch.cat(features), torch.cat(labels)


def medusa_head_loss(heads: MedusaHeads, index: int, target: FrozenTarget, features: torch.Tensor,
                     labels: torch.Tensor) -> torch.Tensor | None:
    """Mean cross-entropy of head ``index`` on ``features`` ``[n, H]`` against ``labels`` ``[n]`` (:data:`IGNORE`
    skipped); None when no label is present."""
    valid = labels != IGNORE
    if not bool(valid.any()):
        return None
    out = heads.blocks[index](features[valid])  # [m, H]
    return F.cross_entropy(target.logits(out), labels[valid])


# ---------------------------------------------------------------------------------------------- EAGLE
def eagle_loss_positions(sample: HeadsSample) -> torch.Tensor:
    """Pair positions j whose token label x_{j+2} is target-generated: ``[max(0, prompt_len - 2), T - 3]``."""
    length = int(sample.tokens.shape[0])
    return torch.arange(max(0, sample.prompt_len - 2), max(0, length - 2))


def eagle_sequence_loss(head: EagleHead, target: FrozenTarget, sample: HeadsSample, *, noise: float = 0.0,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """EAGLE losses of one sequence, summed over its labelled positions.

    The head runs over every pair (f_j, embed(x_{j+1})), j = 0..T-2, at positions j, with causal attention and
    no cache; losses are taken at :func:`eagle_loss_positions`. With ``noise`` > 0 the input features (not the
    regression targets) get U(-noise, noise) added, drawn from ``generator`` (CPU).

    Returns:
        (smooth-L1 of the predicted vs the target's next feature, averaged over H and summed over positions;
        cross-entropy of the predicted feature's logits against x_{j+2}, summed; number of positions).
    """
    positions = eagle_loss_positions(sample)
    if positions.numel() == 0:
        zero = torch.zeros((), device=target.device)
        return zero, zero, 0
    device = target.device
    tokens = sample.tokens.to(device)
    features = sample.features.to(device)
    pairs = int(tokens.shape[0]) - 1
    inputs = features[:-1]  # [T-1, H]
    if noise > 0:
        jitter = (torch.rand(inputs.shape, generator=generator) * 2 - 1) * noise
        inputs = inputs + jitter.to(device)
    predicted = head(inputs, target.embed(tokens[1:]), torch.arange(pairs, device=device))  # [T-1, H]
    positions = positions.to(device)
    chosen = predicted[positions]  # [n, H]
    regression = F.smooth_l1_loss(chosen, features[positions + 1], reduction="none").mean(dim=-1).sum()
    cross_entropy = F.cross_entropy(target.logits(chosen), tokens[positions + 2], reduction="sum")
    return regression, cross_entropy, int(positions.numel())


# ---------------------------------------------------------------------------------------------- batches
def lr_at(step: int, total: int, base: float) -> float:
    """Learning rate of step ``step`` (0-based) of ``total``: linear warm-up over min(20, total / 10) steps, then
    cosine decay from ``base`` to ``base / 10``."""
    warmup = max(1, min(20, total // 10))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _epoch_order(count: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(count, generator=generator)


def _medusa_epoch(num_rows: int, settings: TrainSettings, epoch: int) -> list[torch.Tensor]:
    order = _epoch_order(num_rows, settings.seed, epoch)
    return list(order.split(settings.batch_tokens))


def _eagle_epoch(counts: Sequence[int], settings: TrainSettings, epoch: int) -> list[list[int]]:
    """Sequences (indices) grouped into batches of about ``batch_tokens`` labelled positions."""
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in _epoch_order(len(counts), settings.seed, epoch).tolist():
        if counts[index] == 0:
            continue
        if current and size + counts[index] > settings.batch_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(index)
        size += counts[index]
    if current:
        batches.append(current)
    return batches


def _schedule(epoch_batches: Callable[[int], list], settings: TrainSettings) -> tuple[int, Callable[[int], Iterator]]:
    """Total steps and an iterator factory ``from_step -> (step, batch)`` over epochs in order."""
    if settings.steps is not None:
        total = settings.steps
    else:
        total = sum(len(epoch_batches(epoch)) for epoch in range(settings.epochs))

    def iterate(start: int) -> Iterator:
        step, epoch = 0, 0
        while step < total:
            batches = epoch_batches(epoch)
            if not batches:
                return
            for batch in batches:
                if step >= total:
                    return
                if step >= start:
                    yield step, batch
                step += 1
            epoch += 1

    return total, iterate


# ---------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: str | Path, *, heads: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    losses: Sequence[float], train_time_s: float, identity: dict) -> Path:
    """Write heads, optimizer state, step, losses and the run's identity to ``path`` atomically (a temporary
    file in the same directory, then ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": _CHECKPOINT_FORMAT, "step": step, "heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
             "losses": list(losses), "train_time_s": train_time_s, "identity": identity}
    return atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: str | Path, identity: dict) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` and check it belongs to this run.

    Raises:
        HeadsMismatchError: unreadable file, or a checkpoint of another method, size or base model.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise HeadsMismatchError(f"cannot read checkpoint {path}: {exc}") from exc
    if state.get("format") != _CHECKPOINT_FORMAT:
        raise HeadsMismatchError(f"{path}: unknown checkpoint format {state.get('format')!r}")
    saved = state.get("identity", {})
    different = {key: (saved.get(key), value) for key, value in identity.items() if saved.get(key) != value}
    if different:
        details = ", ".join(f"{key}: checkpoint {old!r} vs now {new!r}" for key, (old, new) in different.items())
        raise HeadsMismatchError(f"{path} belongs to another run ({details}); use another --output or --overwrite")
    return state


def _identity(settings: TrainSettings, fingerprint: str) -> dict:
    identity = {"method": settings.method, "fingerprint": fingerprint, "seed": settings.seed}
    if settings.method == "medusa":
        identity.update(num_heads=settings.num_heads, num_layers=settings.num_layers)
    return identity


# ---------------------------------------------------------------------------------------------- training
def train_heads(model: nn.Module, samples: Sequence[HeadsSample], settings: TrainSettings, *, fingerprint: str,
                checkpoint_path: str | Path | None = None, resume: bool = False,
                on_step: Callable[[int, int, float], None] | None = None) -> TrainResult:
    """Train heads for the target ``model`` on ``samples``.

    Args:
        model: the target ``transformers`` causal LM (frozen; its LM head and embeddings are used, not trained).
        samples: training sequences (:func:`draftwise.heads.data.build_samples`).
        settings: how to train.
        fingerprint: :func:`~draftwise.heads.config.base_model_identity` of ``model`` (checked on resume).
        checkpoint_path: where checkpoints go (None: no checkpoints).
        resume: continue from ``checkpoint_path`` when it exists (a fresh run otherwise).
        on_step: ``on_step(step_done, total_steps, loss)`` after every optimizer step (progress display).

    Raises:
        ValueError: no training position in ``samples``.
        HeadsMismatchError: a checkpoint of another run.
    """
    device = next(model.parameters()).device
    target = FrozenTarget(model, device)
    heads = new_heads(settings, model).to(device).train()
    trainable = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    plan = _medusa_plan if settings.method == "medusa" else _eagle_plan
    total, iterate, step_fn, num_positions = plan(heads, target, samples, settings)
    identity = _identity(settings, fingerprint)
    start, losses, train_time = 0, [], 0.0
    if resume and checkpoint_path is not None and Path(checkpoint_path).is_file():
        state = load_checkpoint(checkpoint_path, identity)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        start, losses, train_time = int(state["step"]), list(state["losses"]), float(state["train_time_s"])
        logger.info("resuming from step %d of %d (%s)", start, total, checkpoint_path)
    elif resume:
        logger.warning("--resume: no checkpoint at %s; starting a fresh run", checkpoint_path)
    for step, batch in iterate(start):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, settings.lr)
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(batch, step)
        torch.nn.utils.clip_grad_norm_(trainable, settings.max_grad_norm)
        optimizer.step()
        train_time += time.perf_counter() - began
        losses.append(loss)
        done = step + 1
        if checkpoint_path is not None and (done % settings.checkpoint_every == 0 or done == total):
            save_checkpoint(checkpoint_path, heads=heads, optimizer=optimizer, step=done, losses=losses,
                            train_time_s=train_time, identity=identity)
        if on_step is not None:
            on_step(done, total, loss)
    steps_done = max(start, len(losses))
    return TrainResult(heads=heads.eval(), steps=steps_done, losses=losses, train_time_s=train_time,
                       resumed_from=start, num_positions=num_positions, settings=asdict(settings))


def _medusa_plan(heads: MedusaHeads, target: FrozenTarget, samples: Sequence[HeadsSample], settings: TrainSettings):
    """(total steps, batch iterator factory, step function(batch, step) -> loss, training positions) for Medusa."""
    features, labels = medusa_examples(samples, settings.num_heads)
    total, iterate = _schedule(lambda epoch: _medusa_epoch(features.shape[0], settings, epoch), settings)
    device = target.device

    def step_fn(rows: torch.Tensor, step: int) -> float:
        return _medusa_step(heads, target, features[rows].to(device), labels[rows].to(device), settings)

    return total, iterate, step_fn, int((labels != IGNORE).any(dim=1).sum())


def _eagle_plan(head: EagleHead, target: FrozenTarget, samples: Sequence[HeadsSample], settings: TrainSettings):
    """As :func:`_medusa_plan`, for EAGLE (batches of whole sequences)."""
    counts = [int(eagle_loss_positions(s).numel()) for s in samples]
    if sum(counts) == 0:
        raise ValueError("no training positions: every continuation is shorter than 2 tokens")
    total, iterate = _schedule(lambda epoch: _eagle_epoch(counts, settings, epoch), settings)

    def step_fn(batch: list[int], step: int) -> float:
        return _eagle_step(head, target, [samples[i] for i in batch], settings, step)

    return total, iterate, step_fn, sum(counts)


def _medusa_step(heads: MedusaHeads, target: FrozenTarget, features: torch.Tensor, labels: torch.Tensor,
                 settings: TrainSettings) -> float:
    """Backpropagate sum_i decay^i * CE_i, one head at a time (frees each head's ``[n, V]`` logits); return it."""
    total = 0.0
    for index in range(heads.num_heads):
        loss = medusa_head_loss(heads, index, target, features, labels[:, index])
        if loss is None:
            continue
        weighted = loss * settings.medusa_decay ** index
        weighted.backward()
        total += float(weighted.detach())
    return total


def _eagle_step(head: EagleHead, target: FrozenTarget, batch: Sequence[HeadsSample], settings: TrainSettings,
                step: int) -> float:
    """Backpropagate the batch's mean (regression + ce_weight * CE) per position, one sequence at a time."""
    count = sum(int(eagle_loss_positions(s).numel()) for s in batch)
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    total = 0.0
    for sample in batch:
        regression, cross_entropy, n = eagle_sequence_loss(head, target, sample, noise=settings.eagle_noise,
                                                           generator=generator)
        if n == 0:
            continue
        loss = (regression + settings.eagle_ce_weight * cross_entropy) / count
        loss.backward()
        total += float(loss.detach())
    return total


# ---------------------------------------------------------------------------------------------- evaluation
def evaluate_heads(heads: nn.Module, model: nn.Module, samples: Sequence[HeadsSample], settings: TrainSettings) -> dict:
    """:func:`evaluate_medusa` or :func:`evaluate_eagle` on held-out ``samples`` (an empty dict without any)."""
    if not samples:
        return {}
    target = FrozenTarget(model, next(model.parameters()).device)
    began = time.perf_counter()
    if settings.method == "medusa":
        result = evaluate_medusa(heads, target, samples)
    else:
        result = evaluate_eagle(heads, target, samples, depth=settings.eval_depth, anchors=settings.eval_anchors)
    result["eval_time_s"] = round(time.perf_counter() - began, 3)
    return result


@torch.no_grad()
def evaluate_medusa(heads: MedusaHeads, target: FrozenTarget, samples: Sequence[HeadsSample], chunk: int = 512) -> dict:
    """Held-out Medusa accuracy.

    Returns:
        ``top1``: per head, the fraction of labelled positions where argmax(lm_head(head_i(h_t))) == x_{t+2+i};
        ``chain``: per depth d, the fraction of positions (with all heads labelled) where heads 0..d-1 are all
        right; ``expected_accepted``: sum of ``chain`` (mean drafts accepted by a chain draft, bonus excluded);
        ``positions``: labelled positions per head.
    """
    heads = heads.eval()
    features, labels = medusa_examples(samples, heads.num_heads)
    labels = labels.to(target.device)
    predictions = torch.empty_like(labels)
    for start in range(0, features.shape[0], chunk):
        out = heads(features[start:start + chunk].to(target.device))  # [heads, n, H]
        predictions[start:start + chunk] = target.logits(out).argmax(-1).T  # [n, heads]
    valid = labels != IGNORE
    correct = (predictions == labels) & valid
    top1 = [float(correct[:, i].sum() / valid[:, i].sum()) if bool(valid[:, i].any()) else None
            for i in range(heads.num_heads)]
    full = valid.all(dim=1)
    chain = correct[full].float().cumprod(dim=1).mean(dim=0).tolist() if bool(full.any()) else []
    return {"top1": top1, "chain": chain, "expected_accepted": float(sum(chain)),
            "positions": [int(valid[:, i].sum()) for i in range(heads.num_heads)]}


@torch.no_grad()
def evaluate_eagle(head: EagleHead, target: FrozenTarget, samples: Sequence[HeadsSample], *, depth: int,
                   anchors: int) -> dict:
    """Held-out EAGLE accuracy.

    Depth 1 is teacher-forced on every labelled position (the head reads the target's features). For depth
    >= 2, from up to ``anchors`` evenly spaced anchor pairs a per sequence, the head (its cache holding pairs
    0..a) rolls out on its own features: pair (f̂_{a+d}, embed(x_{a+d+1})) at position a+d predicts f̂_{a+d+1},
    whose logits are compared with x_{a+d+2}; the true tokens are fed, which is what a chain draft sees as long
    as it is accepted.

    Returns:
        ``top1_teacher_forced``, ``positions``; ``top1_by_depth`` and ``chain_by_depth`` (all depths up to d right)
        over ``anchors`` anchors; ``expected_accepted``: sum of ``chain_by_depth``.
    """
    head = head.eval()
    correct_tf = total_tf = 0
    depth_correct = [0] * depth
    chain_correct = [0] * depth
    num_anchors = 0
    for sample in samples:
        positions = eagle_loss_positions(sample)
        if positions.numel() == 0:
            continue
        tokens = sample.tokens.to(target.device)
        features = sample.features.to(target.device)
        pairs = int(tokens.shape[0]) - 1
        cache = HeadCache()
        predicted = head(features[:-1], target.embed(tokens[1:]), torch.arange(pairs, device=target.device), cache=cache)
        index = positions.to(target.device)
        guesses = target.logits(predicted[index]).argmax(-1)
        correct_tf += int((guesses == tokens[index + 2]).sum())
        total_tf += int(index.numel())
        for anchor in _anchors(positions, depth, anchors):
            num_anchors += 1
            hits = _roll_out(head, target, cache, predicted[anchor], tokens, anchor, depth)
            alive = True
            for d, hit in enumerate(hits):
                depth_correct[d] += hit
                alive = alive and hit
                chain_correct[d] += alive
    top1 = [c / num_anchors for c in depth_correct] if num_anchors else []
    chain = [c / num_anchors for c in chain_correct] if num_anchors else []
    return {"top1_teacher_forced": correct_tf / total_tf if total_tf else None, "positions": total_tf,
            "top1_by_depth": top1, "chain_by_depth": chain, "expected_accepted": float(sum(chain)),
            "anchors": num_anchors, "depth": depth}


def _anchors(positions: torch.Tensor, depth: int, count: int) -> list[int]:
    """Up to ``count`` evenly spaced anchors a among ``positions`` with labels up to depth (a + depth + 1 < T,
    i.e. a <= positions[-1] - depth + 1)."""
    usable = positions[positions <= int(positions[-1]) - depth + 1]
    if usable.numel() == 0:
        return []
    picks = torch.linspace(0, usable.numel() - 1, steps=min(count, usable.numel())).round().long().unique()
    return usable[picks].tolist()


def _roll_out(head: EagleHead, target: FrozenTarget, cache: HeadCache, first: torch.Tensor, tokens: torch.Tensor,
              anchor: int, depth: int) -> list[bool]:
    """Draft ``depth`` tokens after anchor pair ``anchor``; return which matched x_{anchor+2..anchor+depth+1}."""
    local = HeadCache()
    local.keys, local.values = cache.keys[:, :anchor + 1], cache.values[:, :anchor + 1]
    feature = first  # f̂_{anchor+1}
    hits = []
    for d in range(depth):
        guess = int(target.logits(feature).argmax())
        hits.append(guess == int(tokens[anchor + d + 2]))
        if d + 1 < depth:
            position = torch.tensor([anchor + d + 1], device=target.device)
            feature = head(feature[None], target.embed(tokens[anchor + d + 2][None]), position, cache=local)[0]
    return hits
