"""Model names to local directories: a local directory or a preset name as given, otherwise a Hugging Face hub
id (``org/name``) resolved through ``huggingface_hub``.

A hub id comes from the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``; ``~/.cache/huggingface/hub``
by default) when its snapshot is there; otherwise it is downloaded (the config, the tokenizer files and the
``*.safetensors`` weights; no other weight formats). With ``HF_HUB_OFFLINE=1`` nothing is downloaded: a hub
id that is not cached is a ``FileNotFoundError`` saying so. ``HF_TOKEN`` gives access to gated and private
repositories, as for every Hugging Face tool.
"""

from __future__ import annotations

import os

MODEL_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
TOKENIZER_PATTERNS = tuple(p for p in MODEL_PATTERNS if p != "*.safetensors")


def _not_found(name: str, weights: bool, reason: str) -> str:
    from tripath.models.presets import PRESETS

    where = (f"is neither a local model directory nor a preset; presets: {', '.join(PRESETS)}" if weights
             else "is not a local tokenizer directory")
    return f"{name!r} {where}; {reason}"


def resolve_model_path(name: str, *, weights: bool = True, revision: str | None = None,
                       cache_dir: str | None = None) -> str:
    """The local directory (or preset name) ``name`` stands for.

    ``name``: a local directory or a preset, returned as they are (a path to a file too: the loader names
    it), or a hub id, whose snapshot directory is returned (from the cache, or downloaded). ``weights``:
    False fetches only the tokenizer and config files. ``revision``: a branch, tag or commit of the hub
    repository (default: its main branch); ``cache_dir``: the Hugging Face cache to read and download into
    instead of ``HF_HUB_CACHE``. Raises ``FileNotFoundError`` naming ``name`` when it is
    none of these, when the hub does not know it, or when it is offline and not cached; ``PermissionError``
    for a gated or private repository without a token that may read it.
    """
    from tripath.models.presets import PRESETS

    name = os.fspath(name)
    if os.path.exists(name) or name in PRESETS:
        return name
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(_not_found(name, weights, "no such path exists"))
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise FileNotFoundError(_not_found(name, weights, "a Hugging Face hub id needs the huggingface_hub "
                                           "package (pip install huggingface_hub)")) from None
    try:
        validate_repo_id(name)
    except errors.HFValidationError as error:
        reason = f"nor is it a valid Hugging Face hub id ({error})"
        raise FileNotFoundError(_not_found(name, weights, reason)) from None
    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        return huggingface_hub.snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                                 allow_patterns=list(MODEL_PATTERNS if weights else TOKENIZER_PATTERNS))
    except (errors.GatedRepoError, errors.DisabledRepoError) as error:
        raise PermissionError(f"{name!r}: the Hugging Face repository is gated or disabled for this user (set "
                              f"HF_TOKEN to a token with access): {type(error).__name__}") from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(_not_found(name, weights, "the Hugging Face hub has no such repository (or "
                                           "HF_TOKEN may not read it)")) from None
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(f"{name!r}: the Hugging Face hub has no revision {revision!r}") from None
    except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError) as error:
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(_not_found(name, weights, (
                f"as a Hugging Face hub id it is not in the local cache ({cache}), and HF_HUB_OFFLINE=1 forbids "
                f"downloading it: download it once with network access (hf download {name}), point HF_HUB_CACHE "
                "at the cache that holds it, or pass a local directory"))) from None
        reason = str(error).splitlines()[0]
        raise FileNotFoundError(_not_found(name, weights, f"as a Hugging Face hub id it is not in the local "
                                           f"cache ({cache}), and the hub could not be reached ({reason})")) from None
