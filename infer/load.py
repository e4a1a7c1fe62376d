"""Loading what a command runs: the target (its weights, or dummy ones), heads (a folder, or a
fresh random one) and prompts (a set, a JSONL file, or random token ids). JAX and the library
load inside the functions: the CLI parses its flags first."""

from __future__ import annotations

import argparse
import sys

from peagle_jax.runtime.command_line import positive_int

NEW_DRAFT_VOCAB = 16384  # train's model.draft_vocab default
SYNTHETIC = "synthetic:"  # --prompts synthetic:LENGTHS: random token ids, no tokenizer needed


def status(message: str) -> None:
    print(f"[infer] {message}", file=sys.stderr, flush=True)


def new_head_layers(spec: str) -> int | None:
    """The layers of a fresh head (`new` = 1, `new:LAYERS`), None when `spec` names a folder."""
    if spec == "new":
        return 1
    if not spec.startswith("new:"):
        return None
    try:
        return positive_int(spec[4:])
    except argparse.ArgumentTypeError:
        return None


def target_config(args):
    """The target's config from --target and --load-format, no weight read."""
    from peagle_jax.handles.target import target_source

    return target_source(args.target, args.load_format)[0]


ROWS_FLAGS = {
    "serve": ("--max-batch", "max_batch"),
    "bench": ("--batch-size", "batch_size"),
    "cost": ("--batch", "batch"),
}


def mesh_sizes(args) -> tuple[int, int]:
    """(tensor, data) of --tensor, --data and --devices (auto: every device over --data: this
    machine's, or every process's in a server across hosts)."""
    if args.devices == "auto":
        import jax

        return max(jax.device_count() // args.data, 1), args.data
    return args.tensor or 1, args.data


def mesh_flags(args) -> str:
    """The mesh flags as the user gave them, to name them in an error."""
    tensor = "--devices auto" if args.devices == "auto" else f"--tensor {args.tensor or 1}"
    return tensor + (f" --data {args.data}" if args.data > 1 else "")


def check_mesh(args) -> None:
    """UsageError naming the flag when the mesh does not fit, before any weight is read: rows
    (serve's slots, bench's and cost's batches) that --data does not divide, a target that
    --tensor does not split (`sharding.tensor_problem`, from its config alone), more devices than
    the machine has."""
    from peagle_jax.runtime.command_line import UsageError

    flag, name = ROWS_FLAGS.get(args.command, (None, None))
    rows = getattr(args, name) if name else []
    for r in rows if isinstance(rows, list) else [rows]:
        if r % args.data:
            raise UsageError(
                f"{flag} {r}: not divisible by --data {args.data} (the rows are split evenly over the data groups)"
            )
    import jax

    tensor, data = mesh_sizes(args)
    if args.devices == "auto" and jax.device_count() % data:
        what = "local devices" if jax.process_count() == 1 else f"devices of the {jax.process_count()} processes"
        raise UsageError(f"{mesh_flags(args)}: --data {data} does not divide the {jax.device_count()} {what}")
    if jax.process_count() > 1 and tensor * data != jax.device_count():
        raise UsageError(
            f"{mesh_flags(args)}: a server across {jax.process_count()} processes runs on all their "
            f"{jax.device_count()} devices: tensor x data must be {jax.device_count()}, not {tensor * data}"
        )
    if tensor * data == 1:
        return
    from peagle_jax.handles.target import target_source
    from peagle_jax.runtime.sharding import tensor_problem

    why = tensor_problem(target_source(args.target, "dummy")[0], tensor)  # config.json (or the preset) only
    if why:
        raise UsageError(f"{mesh_flags(args)}: {why}")
    if tensor * data > jax.device_count():
        raise UsageError(
            f"{mesh_flags(args)}: needs tensor {tensor} x data {data} = {tensor * data} devices, "
            f"this machine has {jax.device_count()}"
        )


def command_mesh(args):
    """The (data, fsdp, tensor) mesh of the mesh flags; None on one device."""
    tensor, data = mesh_sizes(args)
    if tensor * data == 1:
        return None
    from peagle_jax.runtime.sharding import make_mesh

    return make_mesh(tensor=tensor, data=data)


def mesh_words(mesh) -> str:
    """A mesh for people: "1 device", "tensor 2 x data 2 (4 cpu devices)"."""
    if mesh is None or mesh.size == 1:
        return "1 device"
    import jax

    shape = " x ".join(f"{a} {mesh.shape[a]}" for a in ("tensor", "data", "fsdp") if mesh.shape[a] > 1)
    hosts = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return f"{shape} ({mesh.size} {mesh.devices.flat[0].platform} devices{hosts})"


def mesh_record(mesh) -> dict:
    """A mesh for a JSON report: its axes' sizes and devices."""
    sizes = {a: 1 if mesh is None else int(mesh.shape[a]) for a in ("tensor", "data")}
    return {**sizes, "devices": 1 if mesh is None else int(mesh.size)}


def load_target(args):
    """The target of --target, --load-format and --dtype, its weights on the mesh of the mesh
    flags (`command_mesh`; the heads are placed beside it by the `Engine`)."""
    import peagle_jax as pj

    mesh = command_mesh(args)
    how = "with dummy weights" if args.load_format == "dummy" else "..."
    where = "" if mesh is None else f" on {mesh_words(mesh)}"
    status(f"loading target {args.target}{where} {how}")
    dtype = None if args.dtype == "auto" else args.dtype
    return pj.load_target(args.target, dtype=dtype, load_format=args.load_format, mesh=mesh)


def load_head(spec: str, target, mode: str):
    """A head folder, or a fresh random head (`new[:LAYERS]`) of the default shape in `mode`
    (the trainer's default draft vocabulary: the first 16384 ids stand in for the most frequent)."""
    import numpy as np

    import peagle_jax as pj

    layers = new_head_layers(spec)
    if layers is None:
        return pj.load_drafter(spec)
    vocab = target.config.vocab_size
    draft_vocab = np.arange(NEW_DRAFT_VOCAB) if vocab > NEW_DRAFT_VOCAB else None
    return pj.new_drafter(target, num_layers=layers, mode=mode, draft_vocab=draft_vocab, seed=0)


def synthetic_lengths(source: str) -> list[int] | None:
    """The lengths of `synthetic:L1,L2,...` (positive integers), None for any other source."""
    if not source.startswith(SYNTHETIC):
        return None
    try:
        lengths = [int(t) for t in source[len(SYNTHETIC) :].split(",")]
    except ValueError:
        return None
    return lengths if lengths and min(lengths) > 0 else None


SYNTHETIC_COUNT = 8  # prompts of --prompts synthetic:LENGTHS without --limit


def synthetic_prompts(batch: int, length: int, vocab: int, avoid=(), seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` random token ids in [0, vocab), none of them in `avoid` (eos)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, length))
    for token in avoid:
        ids[ids == token] = (token + 1) % vocab
    return ids.tolist()


def source_prompt_ids(target, source: str, limit: int | None = None, max_tokens: int | None = None) -> list[list[int]]:
    """Token ids of the prompts of `source` (mtbench | humaneval | a JSONL file) in the target's
    format, or of `synthetic:LENGTHS` (random ids, `limit` or 8 prompts cycling through the
    lengths); with `max_tokens`, longer prompts are left out; at most `limit` of them."""
    from peagle_jax.engine import load_prompts, prompt_ids

    lengths = synthetic_lengths(source)
    if lengths is not None:
        c = target.config
        rows = [synthetic_prompts(1, lengths[i % len(lengths)], c.vocab_size, c.eos_token_id, seed=i)[0]
                for i in range(limit or SYNTHETIC_COUNT)]  # fmt: skip
        ids = [r for r in rows if max_tokens is None or len(r) <= max_tokens]
    elif target.tokenizer is None:
        where = getattr(target, "path", None) or "the target"
        raise ValueError(
            f"--prompts {source}: text prompts need a tokenizer, and {where} has none (tokenizer.json); "
            "--prompts synthetic:LENGTHS needs none"
        )
    else:
        ids = prompt_ids(target.tokenizer, load_prompts(source), max_tokens, limit)
    if not ids:
        raise ValueError(f"--prompts {source}: no prompts" + (f" of at most {max_tokens} tokens" if max_tokens else ""))
    return ids
