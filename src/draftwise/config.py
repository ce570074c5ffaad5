"""Validated, frozen configuration objects shared by the engine, CLI and server."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SamplingParams", "SpeculativeConfig", "SPECULATIVE_METHODS", "HEAD_METHODS", "K_POLICIES",
           "SAMPLING_RULES"]

SPECULATIVE_METHODS = ("draft_model", "ngram", "medusa", "eagle")
#: Methods whose ``model`` is a heads directory (``draftwise train-heads``) on the target itself.
HEAD_METHODS = ("medusa", "eagle")
K_POLICIES = ("fixed", "auto")
#: Temperatures below this are greedy decoding (as vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5
#: How temperature > 0 draws tokens and verifies drafts (:attr:`SamplingParams.sampling`).
SAMPLING_RULES = ("coupled", "rejection")


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into tokens.

    Attributes:
        temperature: 0 (or anything below 1e-5) means greedy (argmax); otherwise it divides the logits before
            the softmax.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it. The most likely token is always kept, so a
            tiny ``top_p`` (even one that underflows float32) is greedy sampling, never an empty distribution.
        top_k: keep only the k most likely tokens; 0 disables it.
        max_tokens: maximum number of new tokens to generate (>= 1).
        seed: seed of the request's randomness; ``None`` draws a fresh seed. With a seed, the same request
            gives the same text: on any speculative configuration under coupled sampling (the default with a
            seed), on the same configuration under rejection sampling.
        stop_token_ids: extra token ids that end generation (the model's EOS ids always do, unless
            ``ignore_eos``). The stop token itself is not part of the output.
        ignore_eos: keep generating past EOS (benchmarks use it to get fixed-length runs).
        sampling: the rule at temperature > 0 (ignored when greedy), one of :data:`SAMPLING_RULES`:
            ``"coupled"``: Gumbel-max sampling with noise keyed by (seed, position), so the same seed gives
            the same text with or without speculation, whatever the proposer, K or tree (Daliri et al. 2024,
            "Coupling without communication and drafter-invariant speculative decoding");
            ``"rejection"``: Leviathan et al. 2023 rejection sampling, whose acceptance rate with a sampled
            draft can be higher (``sum(min(p, q))``, the best any coupling reaches) but whose text for a seed
            depends on the configuration. ``None`` (default): coupled when ``seed`` is set, else rejection.
            Both emit exactly the target's distribution. See :mod:`draftwise.sampling`.

    Raises:
        ValueError: on any out-of-range field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    sampling: str | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.sampling is not None and self.sampling not in SAMPLING_RULES:
            raise ValueError(f"sampling must be one of {SAMPLING_RULES} (or unset), got {self.sampling!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature 0, or below :data:`GREEDY_TEMPERATURE` (1e-5, vLLM's
        threshold), where dividing the logits would overflow to inf / nan."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def coupled(self) -> bool:
        """True when tokens are drawn by coupled (Gumbel-max) sampling: temperature > 0 and ``sampling`` is
        ``"coupled"``, or unset with a ``seed``."""
        if self.greedy:
            return False
        return self.sampling == "coupled" or (self.sampling is None and self.seed is not None)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer to use and how far to speculate.

    Field names follow vLLM's ``--speculative-config``.

    Attributes:
        method: ``"draft_model"`` (a second, smaller causal LM with the same tokenizer), ``"ngram"``, or
            ``"medusa"`` / ``"eagle"`` (heads trained on the target by ``draftwise train-heads``).
        model: path, hub id or registry name of the draft model (``draft_model``), or the heads directory
            (``medusa``, ``eagle``).
        num_speculative_tokens: K, the maximum number of draft tokens verified per target pass (>= 1).
        prompt_lookup_min: shortest suffix n-gram to look up (``ngram`` only).
        prompt_lookup_max: longest suffix n-gram to look up (``ngram`` only).
        k_policy: ``"fixed"`` (default: always K = ``num_speculative_tokens``) or ``"auto"`` (a cost-model
            controller picks K in 0..``num_speculative_tokens`` before every step; see
            :class:`draftwise.controller.AutoK`). Not a vLLM field. Medusa and EAGLE use fixed K (the tree depth).
        tree_width: ``medusa`` / ``eagle``: candidates per expanded tree node (top-k); 1 drafts a single chain
            of K tokens. Not a vLLM field.
        tree_budget: ``medusa`` / ``eagle``: at most this many draft nodes per step (default ``K * tree_width``).
        tree: ``medusa``: an explicit static tree as Medusa "choices", a list of top-k rank paths such as
            ``[[0], [1], [0, 0]]`` (overrides ``tree_width`` / ``tree_budget``; see
            :class:`draftwise.tree.TreeTemplate`).

    Raises:
        ValueError: on an unknown method, a missing draft model or out-of-range sizes.
    """

    method: str = "draft_model"
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    k_policy: str = "fixed"
    tree_width: int = 1
    tree_budget: int | None = None
    tree: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {SPECULATIVE_METHODS}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method 'draft_model' needs a draft model (speculative model path or name)")
        if not (1 <= self.num_speculative_tokens <= 64):
            raise ValueError(f"num_speculative_tokens must be in 1..64, got {self.num_speculative_tokens}")
        if not (1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.k_policy not in K_POLICIES:
            raise ValueError(f"unknown k_policy {self.k_policy!r}; choose one of {K_POLICIES}")
        if self.method in HEAD_METHODS:
            self._check_heads_fields()

    def _check_heads_fields(self) -> None:
        if not self.model:
            raise ValueError(f"method {self.method!r} needs its heads directory as 'model' (draftwise train-heads)")
        if self.k_policy != "fixed":
            raise ValueError(f"method {self.method!r} supports k_policy 'fixed' only")
        if not 1 <= self.tree_width <= 16:
            raise ValueError(f"tree_width must be in 1..16, got {self.tree_width}")
        if self.tree_budget is not None and not 1 <= self.tree_budget <= 256:
            raise ValueError(f"tree_budget must be in 1..256, got {self.tree_budget}")
        if self.tree is not None:
            if self.method != "medusa":
                raise ValueError("an explicit 'tree' (Medusa choices) is for method 'medusa' only")
            from draftwise.tree import TreeTemplate

            try:
                paths = TreeTemplate(tuple(tuple(p) for p in self.tree)).paths
            except TypeError as exc:
                raise ValueError(f"tree must be a list of lists of non-negative ints: {exc}") from exc
            object.__setattr__(self, "tree", paths)
