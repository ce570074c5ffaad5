"""Sampling defaults from a model's ``generation_config.json`` (``draftwise serve --generation-config``, as
vLLM's flag): applied to the fields a request leaves unset, before the request is validated.

``auto`` (the default) looks beside the model: ``generation_config.json`` in a Hugging Face directory, next to a
GGUF file (``<name>.generation_config.json``, then ``generation_config.json``, so a pulled model's own file can
sit in the shared models directory), or in the local hub cache for a hub id (never downloaded). ``none``: no
defaults (OpenAI's apply: temperature 1, top_p 1). A path: that file, or the ``generation_config.json`` in that
directory. The keys read are vLLM's (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``max_new_tokens`` as ``max_tokens``) and the OpenAI penalties (``presence_penalty``, ``frequency_penalty``);
``do_sample`` is not read (vLLM does not read it either).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GenerationDefaults", "GENERATION_CONFIG_FIELDS", "GenerationConfigError", "load_generation_defaults",
           "find_generation_config"]

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"

#: ``generation_config.json`` key -> the request field it is the default of, and the number type it must be
GENERATION_CONFIG_FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}


class GenerationConfigError(ValueError):
    """``--generation-config`` names a file that does not exist or is not a JSON object."""


@dataclass(frozen=True)
class GenerationDefaults:
    """Default values of request fields (field name -> value) and the file they came from.

    Attributes:
        values: request field -> default (``max_tokens`` from ``max_new_tokens``).
        source: the file read, or None (no defaults).
        note: why there are none (for the start-up log), when ``source`` is None.
    """

    values: Mapping[str, float | int] = field(default_factory=dict)
    source: Path | None = None
    note: str = ""

    def apply(self, request):
        """``request`` (a pydantic request model) with every default whose field it did not send (absent or
        null) filled in; itself when nothing is missing. A chat request that sent ``max_completion_tokens``
        sent its ``max_tokens``. Validation then sees the defaults as if sent."""
        missing = {}
        for name, value in self.values.items():
            sent = getattr(request, name, None)
            if name == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
                continue
            if sent is None:
                missing[name] = value
        return request.model_copy(update=missing) if missing else request

    def describe(self) -> str:
        """One line for the start-up log: what was loaded from where."""
        if self.source is None:
            return f"{self.note or 'no generation config'}: OpenAI's sampling defaults apply to fields a request " \
                "does not send"
        shown = ", ".join(f"{name}={value}" for name, value in self.values.items()) or "no sampling fields"
        return f"sampling defaults from {self.source}: {shown} (applied to fields a request does not send)"


def find_generation_config(model: str) -> Path | None:
    """Where ``auto`` finds the generation config of ``model`` (a directory, a GGUF file, a pulled registry
    name, a hub id), or None."""
    from draftwise.models.loading import resolve_model

    try:
        path = Path(resolve_model(model)).expanduser()
    except Exception:  # noqa: BLE001 - a registry name not pulled: nothing to find beside it
        return None
    if path.is_dir():
        candidates = [path / FILE_NAME]
    elif path.is_file():
        candidates = [path.with_name(f"{path.name.removesuffix('.gguf')}.{FILE_NAME}"), path.with_name(FILE_NAME)]
    else:
        candidates = [_hub_cached(model)]
    return next((c for c in candidates if c is not None and c.is_file()), None)


def _hub_cached(repo_id: str) -> Path | None:
    """The hub cache's copy of a repository's generation config (never downloaded), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, FILE_NAME)
    except Exception:  # noqa: BLE001 - not a hub id
        return None
    return Path(found) if isinstance(found, str) else None


def load_generation_defaults(setting: str, model: str) -> GenerationDefaults:
    """The defaults ``--generation-config setting`` gives a server of ``model`` (:meth:`GenerationDefaults.describe`
    says what was found, for the start-up log).

    Args:
        setting: ``"auto"``, ``"none"``, or a path (a file, or a directory holding ``generation_config.json``).
        model: the target as given to ``serve`` (for ``auto``).

    Raises:
        GenerationConfigError: a path that holds no generation config, or a file that is not a JSON object.
    """
    if setting == "none":
        return GenerationDefaults(note="--generation-config none")
    if setting == "auto":
        path = find_generation_config(model)
        if path is None:
            return GenerationDefaults(note=f"no {FILE_NAME} found beside {model}")
        return read_generation_config(path)
    path = Path(setting).expanduser()
    path = path / FILE_NAME if path.is_dir() else path
    if not path.is_file():
        raise GenerationConfigError(f"--generation-config: no generation config at {path}")
    return read_generation_config(path)


def read_generation_config(path: Path) -> GenerationDefaults:
    """The sampling defaults of one ``generation_config.json`` (a key of the wrong type is skipped, logged).

    Raises:
        GenerationConfigError: not readable as a JSON object.
    """
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"--generation-config: cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise GenerationConfigError(f"--generation-config: {path} is not a JSON object")
    values: dict[str, float | int] = {}
    for key, (name, kind) in GENERATION_CONFIG_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not
                                                                               isinstance(value, int)):
            logger.warning("%s: %s=%r is not a%s number; not used", path, key, value,
                           "n integer" if kind is int else "")
            continue
        values[name] = kind(value)
    return GenerationDefaults(values, path)
