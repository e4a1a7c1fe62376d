"""Hugging Face Hub ids for targets, heads and data sets: the one place a name becomes a folder.

    folder = hub.resolve("Qwen/Qwen3-8B", "target")           # config, tokenizer files, safetensors (+ index)
    folder = hub.resolve("amazon/GPT-OSS-20B-P-EAGLE", "head")  # config.json + safetensors, or drafter.json + state/
    folder = hub.resolve("org/chats", "dataset", revision="v1")  # README.md (subsets, splits) and the data files

- A local file or folder of the same name wins, with no request; a name that is not an
  "org/name" id comes back as a path too, for the caller to report as missing.
- An id is downloaded once by `huggingface_hub.snapshot_download` into its usual cache
  (`$HF_HUB_CACHE`, `$HF_HOME/hub`), only the files this project reads (`patterns`), pinned to the
  commit the Hub names; later calls find it there, and with `HF_HUB_OFFLINE=1` only there.
- A gated or missing repo, an unknown revision, no network, or offline with nothing cached is a
  `HubError` (a ValueError) of one line naming the id and what to do: a token, a login, a local folder.
- `repo_id_of(folder)` gives the id back for a folder of that cache (a head records its target's
  id as the verifier); `cached(id)` finds a cached snapshot without any request.

The library is imported on first use, so `import peagle_jax.sources.hub` costs nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

from peagle_jax.runtime.command_line import one_line

__all__ = [
    "HubError",
    "KINDS",
    "DATA_SUFFIXES",
    "is_repo_id",
    "patterns",
    "resolve",
    "download",
    "cached",
    "repo_id_of",
]

KINDS = ("target", "config", "head", "dataset")
DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".csv")
# what the weights reader opens: one file, or an index and the shards transformers names model-0000i-of-0000n
WEIGHTS = ("config.json", "model*.safetensors", "model.safetensors.index.json")
LOGIN = "log in with `hf auth login` (`huggingface-cli login` before huggingface_hub 1.0) or set HF_TOKEN"
_REPO_ID = re.compile(r"^([A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


class HubError(ValueError):
    """A Hub id that could not be resolved (the message names the id and what to do)."""


def is_repo_id(name, bare: bool = False) -> bool:
    """ "org/name" as the Hub spells repo ids (no "..", no "--"); a local path is not one. `bare`:
    a name without an org counts too (the Hub's legacy ids, "gpt2"); this project downloads only
    "org/name", so that a bare name stays a local folder or a bundled asset."""
    if not isinstance(name, str) or not _REPO_ID.match(name) or ".." in name or "--" in name:
        return False
    return bare or "/" in name


def patterns(kind: str) -> list[str]:
    """The files a snapshot of `kind` holds: no other weights (.bin, original/, consolidated), no images."""
    if kind == "target":
        from peagle_jax.sources.weights import TOKENIZER_FILES  # here: importing this module stays free of JAX

        return [*WEIGHTS, *TOKENIZER_FILES]
    if kind == "config":  # a target's shape and tokenizer without its weights (dummy weights)
        from peagle_jax.sources.weights import TOKENIZER_FILES

        return ["config.json", *TOKENIZER_FILES]
    if kind == "head":
        return [*WEIGHTS, "drafter.json", "state/*"]  # vLLM / speculators heads, and ours
    if kind == "dataset":
        return ["README.md", *(f"*{s}" for s in DATA_SUFFIXES)]  # the card's YAML names subsets and splits
    raise ValueError(f"hub: unknown kind {kind!r} ({', '.join(KINDS)})")


def resolve(name, kind: str, revision: str | None = None) -> Path:
    """The local file or folder `name`, else the snapshot of the Hub id `name` (`download`)."""
    path = Path(name).expanduser()
    if path.exists() or not is_repo_id(name):
        return path
    return download(name, kind, revision)


def download(repo_id: str, kind: str, revision: str | None = None) -> Path:
    """The cached snapshot of `repo_id` (downloaded when missing); HubError of one line."""
    try:
        folder = _snapshot(repo_id, kind, revision=revision)
    except Exception as err:  # noqa: BLE001 - every failure of the library is one line naming the id
        raise HubError(
            f"{kind} {repo_id} (no local folder of that name): {_problem(repo_id, kind, revision, err)}"
        ) from None
    missing = _missing(folder, kind)
    if missing:
        raise HubError(f"{kind} {repo_id}: the Hub repo has {missing}")
    return folder


def cached(repo_id, kind: str = "target") -> Path | None:
    """The cached snapshot of a Hub id, found without any request; None when there is none."""
    if not is_repo_id(repo_id):
        return None
    try:
        folder = _snapshot(repo_id, kind, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or a broken cache): not found here
        return None
    return None if _missing(folder, kind) else folder


def repo_id_of(folder) -> str | None:
    """The Hub id of a model snapshot of the cache (.../models--ORG--NAME/snapshots/COMMIT), else None."""
    if folder is None:
        return None
    parts = Path(folder).absolute().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    name = parts[-3][len("models--") :].replace("--", "/")  # ids never hold "--": the cache's separator
    return name if is_repo_id(name) else None


def _snapshot(repo_id: str, kind: str, **kwargs) -> Path:
    from huggingface_hub import snapshot_download

    # the patterns also say when a cached snapshot is complete (all the files they match are there)
    repo_type = "dataset" if kind == "dataset" else "model"
    return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns(kind), **kwargs))


def _missing(folder: Path, kind: str) -> str | None:
    """What a snapshot lacks to be of `kind`, or None."""
    if kind == "dataset":
        if any(p.name.endswith(DATA_SUFFIXES) for p in folder.rglob("*")):
            return None
        return f"no data files ({', '.join(DATA_SUFFIXES)})"
    names = ("config.json", "drafter.json") if kind == "head" else ("config.json",)
    return None if any((folder / n).is_file() for n in names) else f"no {' or '.join(names)}"


def _problem(repo_id: str, kind: str, revision: str | None, err: Exception) -> str:
    """Why `snapshot_download` failed, and what to do, in one line."""
    from huggingface_hub import constants, errors

    page = f"{constants.ENDPOINT}/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
    if isinstance(err, errors.GatedRepoError):
        return f"a gated repo on the Hugging Face Hub: accept its terms at {page}, then {LOGIN}; or pass a local folder"
    if isinstance(err, errors.RevisionNotFoundError):
        return f"the Hub repo has no revision {revision!r}"
    if isinstance(err, errors.RepositoryNotFoundError):
        return (
            f"no such repo on the Hugging Face Hub ({constants.ENDPOINT}); check the id, or for a private repo {LOGIN}"
        )
    if constants.is_offline_mode():
        return (
            f"not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1: download it once "
            "with the network on (HF_HUB_OFFLINE unset), or pass a local folder"
        )
    if isinstance(err, (errors.LocalEntryNotFoundError, ConnectionError, TimeoutError)):
        return (
            f"the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached and nothing is cached "
            f"({constants.HF_HUB_CACHE}): check the network (or HF_ENDPOINT), or pass a local folder"
        )
    return f"the download failed ({type(err).__name__}: {one_line(err)})"
