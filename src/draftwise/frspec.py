"""FR-Spec: the draft model's LM head over a frequency-ranked subset of the vocabulary.

Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling" (arXiv 2502.14856); SGLang loads the kept ids from ``--speculative-token-map``. For a small draft
with a large vocabulary the LM head dominates a one-token pass: Qwen2.5's 0.5B draft has a
``[151936, 896]`` head, 136M of its 494M weights. Computing only the rows of the ``size`` most frequent
tokens (16-32k) cuts that part of the draft's cost in proportion. The target's verification is untouched,
so the output is still exactly the target's: a token outside the subset has draft logit ``-inf`` (draft
probability 0) and is simply never proposed; under rejection sampling the residual ``max(p - q, 0)`` still
covers it.

What this module provides:

- :class:`SubsetLMHead`: ``x [..., hidden] -> logits [..., vocab]``, computing only the kept rows (float
  ``nn.Linear`` or :class:`~draftwise.backends.quantization.Int8Linear`) and scattering them into a row of
  ``-inf``. Generic (a weight tensor in, a module out), so any backend that has the float head weight can
  plug it in with one call.
- the ranking: :func:`rank_tokens` counts a tokenizer's ids over a local corpus (:func:`corpus_texts`:
  the Python standard library's sources, C headers, the text documentation under ``/usr/share/doc``; never a
  benchmark's prompts), :func:`save_token_map` / :func:`load_token_map` store it (``.npy`` int32 or text,
  most frequent first; ``scripts/build_token_map.py`` writes one), :func:`default_ranking` finds a shipped
  map for the tokenizer (``data/token_maps/``, matched by :func:`vocabulary_hash`) or computes one from a
  small corpus in seconds, cached under ``$DRAFTWISE_HOME/token_maps``.
- :func:`kept_ids` (top ``size`` plus always-kept ids such as EOS and special tokens),
  :class:`HeadSubset` (a config's ``draft_vocab_size`` / ``token_map`` resolved against a tokenizer),
  :func:`restrict_lm_head` (on a ``transformers`` model before quantization: what
  :func:`draftwise.models.loading.load_model` does with ``head_subset``) and :func:`restrict_draft_head`
  (on an already loaded draft).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = ["SubsetLMHead", "HeadSubset", "LinearFactory", "kept_ids", "always_kept_ids", "load_token_map",
           "save_token_map", "rank_tokens", "count_tokens", "corpus_texts", "CorpusSource", "DEFAULT_SOURCES",
           "vocabulary_hash", "default_ranking", "token_map_cache_dir", "shipped_token_map", "restrict_lm_head",
           "restrict_draft_head", "head_nbytes", "TOKEN_MAPS_DIR", "FALLBACK_CORPUS_BYTES"]

logger = logging.getLogger(__name__)

#: Builds the projection of the kept rows: ``(weight [n, hidden], bias [n] or None) -> module`` mapping
#: ``[..., hidden] -> [..., n]``.
LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None"], nn.Module]

#: Ranked token maps shipped with the source checkout, named ``<label>-<vocabulary hash>.npy``.
TOKEN_MAPS_DIR = Path(__file__).resolve().parents[2] / "data" / "token_maps"
#: Corpus bytes of the ranking computed at load time when no map file fits (about 1 s of tokenizing).
FALLBACK_CORPUS_BYTES = 1_000_000
#: Bumped when :data:`DEFAULT_SOURCES` or the ranking rule change, so cached fallback rankings are rebuilt.
_CORPUS_VERSION = 2


# ------------------------------------------------------------------------------------------------ the head
def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """An inference ``nn.Linear`` holding ``weight [out, in]`` (and ``bias [out]``) in their dtype."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                       dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    linear.requires_grad_(False)
    return linear


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    from draftwise.backends.quantization import Int8Linear

    return Int8Linear(weight, bias)


_KERNELS: dict[str, LinearFactory] = {"float": _float_linear, "int8": _int8_linear}


class SubsetLMHead(nn.Module):
    """An LM head that computes the logits of a subset of the vocabulary only; the others are ``-inf``.

    FR-Spec (Zhao et al. 2025): the draft's head keeps the rows of the most frequent tokens. The kept rows
    are copied out of ``weight`` (the full matrix is not referenced afterwards, so an untied head's memory
    can be freed; a tied embedding is left untouched).

    Args:
        weight: the full float head weight ``[vocab_rows, hidden]`` (for a tied head: the input embedding).
        token_ids: 1-D ids to keep (any order, no duplicates), each in ``[0, min(vocab_rows, vocab_size))``.
        vocab_size: the width of the logits returned (default ``vocab_rows``).
        bias: optional ``[vocab_rows]`` head bias (its kept entries are used).
        kernel: ``"float"`` (``nn.Linear`` in ``weight``'s dtype), ``"int8"``
            (:class:`~draftwise.backends.quantization.Int8Linear`: per-output-row weight scales, so each kept
            row gives the same bits as in an int8 head over the full vocabulary), or a :data:`LinearFactory`.

    Raises:
        ValueError: a weight that is not 2-D, empty / duplicate / out-of-range ids, or an unknown kernel.

    Note:
        ``quantize_model`` replaces the inner ``nn.Linear`` (:attr:`proj`) of a float subset head like any
        other, so restricting before quantizing yields the int8 subset head.
    """

    def __init__(self, weight: torch.Tensor, token_ids: Sequence[int] | torch.Tensor, vocab_size: int | None = None,
                 bias: torch.Tensor | None = None, kernel: str | LinearFactory = "float") -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"the head weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
        rows, self.hidden_size = (int(d) for d in weight.shape)
        self.vocab_size = rows if vocab_size is None else int(vocab_size)
        ids = _check_ids(token_ids, min(rows, self.vocab_size))
        factory = _KERNELS.get(kernel) if isinstance(kernel, str) else kernel
        if factory is None:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {sorted(_KERNELS)} or pass a callable")
        if bias is not None and bias.shape != (rows,):
            raise ValueError(f"bias must be [{rows}], got shape {tuple(bias.shape)}")
        index = ids.to(weight.device)
        with torch.no_grad():
            kept_bias = None if bias is None else bias.detach().index_select(0, index.to(bias.device))
            self.proj = factory(weight.detach().index_select(0, index), kept_bias)  # [n, hidden]
        self.register_buffer("token_ids", index, persistent=False)  # [n] long

    @property
    def num_kept(self) -> int:
        """How many vocabulary rows are computed."""
        return int(self.token_ids.numel())

    @property
    def weight(self) -> torch.Tensor:
        """A ``meta`` tensor of the full head's shape ``[vocab_size, hidden]``, for code that reads
        ``get_output_embeddings().weight.shape`` (the logits width); it holds no values."""
        return torch.empty((self.vocab_size, self.hidden_size), device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` -> logits ``[..., vocab_size]`` in the projection's output dtype: the kept ids'
        logits, ``-inf`` everywhere else."""
        kept = self.proj(x)  # [..., n]
        out = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))  # [..., vocab]
        return out.index_copy_(-1, self.token_ids.to(kept.device), kept)

    def extra_repr(self) -> str:
        return f"kept={self.num_kept}, vocab_size={self.vocab_size}, hidden={self.hidden_size}"


def _check_ids(token_ids: Sequence[int] | torch.Tensor, limit: int) -> torch.Tensor:
    """``token_ids`` as a 1-D long tensor; each unique and in ``[0, limit)``.

    Raises:
        ValueError: otherwise.
    """
    ids = torch.as_tensor(token_ids if isinstance(token_ids, torch.Tensor) else list(token_ids), dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"token ids must be a non-empty 1-D list, got shape {tuple(ids.shape)}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        raise ValueError(f"token ids must be in [0, {limit}), got {low}..{high}")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("token ids must not repeat")
    return ids.cpu()


def head_nbytes(head: nn.Module) -> int:
    """Bytes of an LM head's weights as they are stored: float parameters at their element size, an
    ``Int8Linear`` at 1 byte per weight plus a float32 scale per row (and its bias); a :class:`SubsetLMHead`
    counts its kept rows only."""
    from draftwise.backends.quantization import Int8Linear

    if isinstance(head, SubsetLMHead):
        return head_nbytes(head.proj)
    if isinstance(head, Int8Linear):
        bias = 0 if head.bias is None else head.bias.numel() * 4
        return head.out_features * (head.in_features + 4) + bias
    return sum(p.numel() * p.element_size() for p in head.parameters())


# --------------------------------------------------------------------------------------------- the ranking
@dataclass(frozen=True)
class CorpusSource:
    """Files of one kind for the ranking corpus: ``patterns`` (globs) below ``root``, skipping paths with any
    of ``exclude`` among their parts (lower-cased substrings of a part); ``weight`` files are read from it per
    round of :func:`corpus_texts` (its share of the corpus)."""

    name: str
    root: Path
    patterns: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    weight: int = 1

    def files(self) -> list[Path]:
        """The matching files in a fixed pseudo-random order (by a hash of the relative path), so a budget that
        stops early still samples every package and directory, and a corpus is the same on every run here."""
        if not self.root.is_dir():
            return []
        found = {p for pattern in self.patterns for p in self.root.rglob(pattern) if p.is_file()}
        keep = [p for p in found if not any(bad in part.lower() for part in p.relative_to(self.root).parts
                                            for bad in self.exclude)]
        return sorted(keep, key=lambda p: hashlib.sha1(str(p.relative_to(self.root)).encode()).hexdigest())


def _default_sources() -> tuple[CorpusSource, ...]:
    paths = sysconfig.get_paths()
    no_tests = ("test", "idle_test")
    return (
        CorpusSource("python", Path(paths["stdlib"]), ("*.py",), ("site-packages", "dist-packages") + no_tests, weight=3),
        CorpusSource("python-packages", Path(paths["purelib"]), ("*.py",), no_tests, weight=3),
        CorpusSource("english", Path("/usr/share/doc"), ("*.txt", "*.md", "*.rst"), ("changelog", "changes"), weight=2),
        CorpusSource("c", Path("/usr/include"), ("*.h",), weight=1),
        CorpusSource("web", Path("/usr/lib/node_modules"), ("*.js", "*.ts", "*.html", "*.css", "*.md"),
                     no_tests + (".min.",), weight=1),
    )


#: The local corpus: Python's standard library and installed packages (code and docstrings), the text
#: documentation of the system's packages (English; changelogs skipped, they are mostly commit ids), C headers,
#: JavaScript / HTML / CSS of globally installed node packages; read 3 : 3 : 2 : 1 : 1 files per round. No
#: network, and nothing from the benchmarks (Spec-Bench prompts would leak into what is measured).
DEFAULT_SOURCES: tuple[CorpusSource, ...] = _default_sources()


def corpus_texts(max_bytes: int, *, per_file_bytes: int = 16_384,
                 sources: Sequence[CorpusSource] = DEFAULT_SOURCES) -> Iterator[str]:
    """Texts of the local ranking corpus: at most ``per_file_bytes`` from each file, taken from the sources
    in turn (``weight`` files of each, round robin) until ``max_bytes`` in all, so a small budget still mixes
    code and English. Unreadable files and missing sources are skipped.

    Args:
        max_bytes: total budget (bytes of UTF-8 text, approximately).
        per_file_bytes: at most this much of each file (its beginning).
        sources: where to read (default :data:`DEFAULT_SOURCES`).

    Raises:
        ValueError: a non-positive budget.
    """
    if max_bytes < 1 or per_file_bytes < 1:
        raise ValueError(f"corpus budgets must be >= 1 byte, got {max_bytes} and {per_file_bytes}")
    queues = [(iter(source.files()), max(1, source.weight)) for source in sources]
    used = 0
    while queues and used < max_bytes:
        for entry in list(queues):
            queue, weight = entry
            for _ in range(weight):
                path = next(queue, None)
                if path is None:
                    queues.remove(entry)
                    break
                text = _read_head(path, min(per_file_bytes, max_bytes - used))
                if text:
                    used += len(text.encode("utf-8", "replace"))
                    yield text
                if used >= max_bytes:
                    return


def _read_head(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def count_tokens(tokenizer, texts: Iterable[str], vocab_size: int, *, batch: int = 64) -> np.ndarray:
    """Occurrences of each id when ``tokenizer`` encodes ``texts`` (no special tokens added).

    Args:
        tokenizer: a ``transformers`` tokenizer (called on a list of strings).
        texts: the corpus.
        vocab_size: the length of the returned array; ids at or above it are ignored.

    Returns:
        ``[vocab_size]`` int64 counts.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)

    def add(chunk: list[str]) -> None:
        encoded = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        flat = np.fromiter((t for ids in encoded for t in ids), dtype=np.int64)
        flat = flat[(flat >= 0) & (flat < vocab_size)]
        counts[:] += np.bincount(flat, minlength=vocab_size)

    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            add(chunk)
            chunk = []
    if chunk:
        add(chunk)
    return counts


def rank_tokens(counts: np.ndarray, vocabulary_ids: Iterable[int] | None = None) -> list[int]:
    """Ids by frequency, most frequent first (ties: smaller id first), then the ids of ``vocabulary_ids``
    never seen, by id (BPE vocabularies give earlier merges, usually the more common strings, smaller ids).

    Args:
        counts: ``[vocab]`` occurrences (:func:`count_tokens`).
        vocabulary_ids: the tokenizer's ids; only those are ranked (default: every index of ``counts``).
    """
    valid = np.arange(len(counts)) if vocabulary_ids is None else \
        np.unique(np.fromiter(vocabulary_ids, dtype=np.int64))
    valid = valid[(valid >= 0) & (valid < len(counts))]
    seen = valid[counts[valid] > 0]
    seen = seen[np.lexsort((seen, -counts[seen]))]  # count descending, then id ascending
    unseen = valid[counts[valid] == 0]  # already ascending
    return [int(t) for t in np.concatenate([seen, unseen])]


def vocabulary_hash(tokenizer) -> str:
    """16 hex digits of SHA-256 over the tokenizer's id -> token table (``get_vocab()``, added tokens
    included): the key of shipped and cached rankings."""
    table = sorted((int(i), str(tok)) for tok, i in tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()[:16]


def save_token_map(path: str | Path, ranked: Sequence[int]) -> Path:
    """Write ranked ids (most frequent first): ``.npy`` as int32, any other suffix as text, one id a line.
    Written atomically (a temporary file renamed into place)."""
    from draftwise.files import atomic_write

    path = Path(path)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            if path.suffix == ".npy":
                np.save(handle, np.asarray(ranked, dtype=np.int32))
            else:
                handle.write("".join(f"{int(t)}\n" for t in ranked).encode())

    return atomic_write(path, write)


def load_token_map(path: str | Path) -> list[int]:
    """Read a ranked token map: ``.npy`` (a 1-D integer array) or text (whitespace-separated ints; ``#``
    starts a comment). The order is kept (most frequent first).

    Raises:
        FileNotFoundError: no such file.
        ValueError: an unreadable or empty map, negative or repeated ids.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"token map not found: {path}")
    try:
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)
            if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"expected a 1-D integer array, got {array.dtype} of shape {array.shape}")
            ids = [int(t) for t in array]
        else:
            words = " ".join(line.split("#", 1)[0] for line in path.read_text().splitlines()).split()
            ids = [int(w) for w in words]
    except ValueError as exc:
        raise ValueError(f"token map {path}: {exc}") from exc
    if not ids:
        raise ValueError(f"token map {path} is empty")
    if min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(f"token map {path}: ids must be non-negative and unique")
    return ids


def shipped_token_map(tokenizer, directory: Path = TOKEN_MAPS_DIR, *, key: str | None = None) -> Path | None:
    """The map in ``directory`` built for this tokenizer's vocabulary (``*-<vocabulary_hash>.npy``), if any;
    ``key`` is the tokenizer's :func:`vocabulary_hash` when already computed."""
    if not directory.is_dir():
        return None
    matches = sorted(directory.glob(f"*-{key or vocabulary_hash(tokenizer)}.npy"))
    return matches[0] if matches else None


def token_map_cache_dir() -> Path:
    """``draftwise_home()/token_maps``: rankings counted over the local corpus (not created here)."""
    from draftwise.files import draftwise_home

    return draftwise_home() / "token_maps"


def default_ranking(tokenizer, *, cache_dir: Path | None = None, corpus_bytes: int = FALLBACK_CORPUS_BYTES,
                    sources: Sequence[CorpusSource] = DEFAULT_SOURCES) -> list[int]:
    """The ranking to use when no token map is given: a shipped map for this vocabulary
    (:func:`shipped_token_map`), else one counted over ``corpus_bytes`` of the local corpus
    (:func:`corpus_texts`), cached as ``<cache_dir>/<vocabulary hash>-v<version>-<bytes>.npy`` (default
    ``$DRAFTWISE_HOME/token_maps``).

    Raises:
        ValueError: the corpus is empty (no readable source on this machine): build a map with
            ``scripts/build_token_map.py`` and pass it as ``token_map``.
    """
    key = vocabulary_hash(tokenizer)
    shipped = shipped_token_map(tokenizer, TOKEN_MAPS_DIR, key=key)
    if shipped is not None:
        logger.info("FR-Spec ranking: shipped token map %s", shipped)
        return load_token_map(shipped)
    if cache_dir is None:
        cache_dir = token_map_cache_dir()
    cached = cache_dir / f"{key}-v{_CORPUS_VERSION}-{corpus_bytes}.npy"
    if cached.is_file():
        return load_token_map(cached)
    texts = list(corpus_texts(corpus_bytes, sources=sources))
    if not texts:
        raise ValueError("no local corpus to rank tokens by (no Python sources or docs found); build a token map "
                         "with scripts/build_token_map.py and set token_map")
    vocab = tokenizer.get_vocab()
    counts = count_tokens(tokenizer, texts, max(vocab.values()) + 1)
    ranked = rank_tokens(counts, vocab.values())
    save_token_map(cached, ranked)
    logger.info("FR-Spec ranking: counted %d tokens over %d local files; cached in %s", int(counts.sum()),
                len(texts), cached)
    return ranked


# ------------------------------------------------------------------------------------------ the kept subset
def always_kept_ids(tokenizer, eos_token_ids: Iterable[int] = ()) -> list[int]:
    """Ids a draft must be able to propose whatever their frequency: EOS ids and the tokenizer's special
    tokens (its named ones and added tokens marked special, such as chat markers; ``<|im_end|>`` ends a
    turn), sorted."""
    ids = {int(t) for t in eos_token_ids}
    ids.update(int(t) for t in getattr(tokenizer, "all_special_ids", ()) or () if t is not None)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return sorted(t for t in ids if t >= 0)


def kept_ids(ranked: Sequence[int], size: int, always: Iterable[int] = ()) -> list[int]:
    """The top ``size`` ids of ``ranked`` plus ``always`` (EOS and special ids), sorted ascending.

    Args:
        ranked: ids, most frequent first (:func:`load_token_map`, :func:`default_ranking`).
        size: how many ranked ids to keep (>= 1).
        always: ids kept in any case (may overlap the top ``size``).

    Raises:
        ValueError: ``size`` < 1 or larger than the ranking.
    """
    if size < 1:
        raise ValueError(f"the subset size must be >= 1, got {size}")
    if size > len(ranked):
        raise ValueError(f"the token map ranks {len(ranked)} ids; cannot keep the top {size}")
    return sorted({int(t) for t in ranked[:size]} | {int(t) for t in always})


@dataclass(frozen=True)
class HeadSubset:
    """Which vocabulary rows a draft's head keeps: a config's ``draft_vocab_size`` and ``token_map``.

    Attributes:
        size: keep the top ``size`` ranked ids (None: every id of the token map).
        token_map: a ranked map file (None: :func:`default_ranking`).
    """

    size: int | None = None
    token_map: str | None = None

    def __post_init__(self) -> None:
        if self.size is None and self.token_map is None:
            raise ValueError("a head subset needs a size, a token map or both")
        if self.size is not None and self.size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.size}")

    def resolve(self, tokenizer, eos_token_ids: Iterable[int], vocab_size: int) -> list[int] | None:
        """The kept ids for a model with this tokenizer and a ``vocab_size``-wide head, sorted; None when the
        subset would be the whole vocabulary (nothing to restrict).

        Raises:
            FileNotFoundError, ValueError: see :func:`load_token_map`; ids of the map outside the head.
        """
        ranked = load_token_map(self.token_map) if self.token_map else default_ranking(tokenizer)
        if max(ranked) >= vocab_size:
            raise ValueError(f"token map {self.token_map}: id {max(ranked)} is outside the draft's "
                             f"{vocab_size}-token head (a map built for another tokenizer?)")
        size = len(ranked) if self.size is None else self.size
        if size >= vocab_size:
            return None
        always = [t for t in always_kept_ids(tokenizer, eos_token_ids) if t < vocab_size]
        return kept_ids(ranked, size, always)


# ------------------------------------------------------------------------------------- applying to a model
def restrict_lm_head(model: nn.Module, token_ids: Sequence[int], *, kernel: str | LinearFactory = "float") -> SubsetLMHead:
    """Replace a ``transformers`` causal LM's float LM head (``get_output_embeddings()``, an ``nn.Linear``)
    with a :class:`SubsetLMHead` over ``token_ids``, in place; returns the new head.

    Call it before :func:`draftwise.backends.quantization.quantize_model`, which then quantizes the kept rows
    like any linear layer (what :func:`draftwise.models.loading.load_model` does with ``head_subset``). A
    tied head's rows are copied; the input embedding is not modified.

    Raises:
        ValueError: the head is not an ``nn.Linear`` (already quantized or restricted), or bad ids.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"restrict_lm_head needs a float nn.Linear LM head, got {type(head).__name__}; an int8 "
                         "model: use restrict_draft_head, or restrict before quantizing")
    subset = SubsetLMHead(head.weight, token_ids, bias=head.bias, kernel=kernel)
    model.set_output_embeddings(subset)
    return subset


def restrict_draft_head(loaded, token_ids: Sequence[int]) -> SubsetLMHead:
    """Apply a :class:`SubsetLMHead` to a loaded PyTorch draft (a :class:`~draftwise.models.loading.LoadedModel`
    on :class:`~draftwise.backends.torch_backend.TorchCausalLM`), in place.

    A float head's rows are taken from it. An int8 head (``--quantization int8``) keeps no float weight, so
    its rows are taken from the input embedding when the head is tied to it (``tie_word_embeddings``), and
    quantized row by row as :func:`~draftwise.backends.quantization.quantize_model` quantized them: the
    kept logits are bit-identical. The backend's name gets ``+fr<kept>`` (calibration caches keep it apart).

    Raises:
        ValueError: not a PyTorch model, a head already restricted, an untied int8 head (load with
            ``head_subset`` instead, which restricts before quantizing), or bad ids.
    """
    from draftwise.backends.quantization import Int8Linear
    from draftwise.backends.torch_backend import TorchCausalLM

    backend = loaded.backend
    if not isinstance(backend, TorchCausalLM):
        raise ValueError(f"FR-Spec needs a PyTorch draft model, got {type(backend).__name__}")
    model = backend.model
    head = model.get_output_embeddings()
    before = head_nbytes(head)
    if isinstance(head, nn.Linear):
        subset = restrict_lm_head(model, token_ids)
    elif isinstance(head, Int8Linear):
        embedding = model.get_input_embeddings().weight
        if not getattr(model.config, "tie_word_embeddings", False) or embedding.shape != head.weight.shape:
            raise ValueError(f"{backend.name}: the int8 LM head is not tied to the embedding, so its float rows are "
                             "gone; restrict it before quantizing (load_model(..., head_subset=...))")
        subset = SubsetLMHead(embedding, token_ids, bias=head.bias, kernel="int8")
        model.set_output_embeddings(subset)
    else:
        raise ValueError(f"{backend.name}: cannot restrict an LM head of type {type(head).__name__}")
    backend.name = f"{backend.name}+fr{subset.num_kept}"
    log_restriction(backend.name, subset, before)
    return subset


def log_restriction(name: str, subset: SubsetLMHead, bytes_before: int) -> None:
    """Log how many ids a restricted head keeps and its weight bytes before and after."""
    from draftwise.units import format_bytes

    logger.info("FR-Spec: %s's LM head keeps %d of %d ids; head weights %s -> %s", name, subset.num_kept,
                subset.vocab_size, format_bytes(bytes_before), format_bytes(head_nbytes(subset)))
