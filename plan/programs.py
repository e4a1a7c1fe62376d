"""The programs a user runs, built over abstract weights and compiled for a device without one.

Weights are `jax.ShapeDtypeStruct`s (`nnx.eval_shape`: nothing allocated, nothing read) carrying
the shardings the real run gives them (the `peagle_jax.runtime.sharding` rule table over a mesh of the
topology's devices), so `jit(...).lower(...).compile()` runs the device's own compiler (XLA GPU with
Triton and ptxas, or XLA TPU with Mosaic) on the real shapes; the trace's jaxpr gives the FLOPs
of the roofline estimate (`peagle_jax.hardware.roofline`). Jobs: the train step (the head's
trainer step with the target inside it, as `python -m train` runs it) and serving (the speculative
round of each mode, and the plain decode step: the engine's mode "none").
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from peagle_jax.engine import Engine, Slots
from peagle_jax.handles.drafter import Drafter, head_config
from peagle_jax.handles.target import Target
from peagle_jax.hardware.launches import Launches, count_launches
from peagle_jax.hardware.roofline import gathered_bytes, jaxpr_flops
from peagle_jax.models.eagle import abstract_drafter, flat_state, param_key
from peagle_jax.runtime.command_line import interruptible
from peagle_jax.runtime.sharding import (
    AXES,
    kernels_partitioned,
    make_mesh,
    role_sharding,
    state_shardings,
    tree_shardings,
)
from peagle_jax.sources.weights import abstract_model

__all__ = ["Program", "abstract_target", "abstract_head", "train_step", "serve_round", "compile_program", "mesh_of"]

KERNEL_NAME = re.compile(r"peagle_(?:attention_[a-z]+|decode_attention)")  # the kernels' names, not paths


@dataclasses.dataclass
class Program:
    """One compiled (or refused) program and XLA's plan of its buffers per device."""

    name: str
    compiled: bool
    error: str | None = None
    argument_bytes: int = 0
    temp_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    compile_seconds: float = 0.0
    kernels: tuple[str, ...] = ()  # the project's Pallas kernels in it
    launches: Launches | None = None  # the kernels it launches (`launches.count_launches`)
    flops: float | None = None  # the jaxpr's, global (`roofline.jaxpr_flops`)
    gathered_bytes: int = 0  # per device: the arguments only gathered from (`roofline.gathered_inputs`)

    @property
    def peak_bytes(self) -> int:
        """Arguments + temporaries + outputs not aliased to a (donated) argument."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


def mesh_of(devices, job: str = "serve", tensor: int | None = None, data: int = 1) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over topology devices: training splits sequences and weights
    over fsdp (every device); serving splits heads over tensor within a host (fast links), rows over
    data, or with `tensor` (and `data`) as `python -m infer serve --tensor N --data D` does
    (`sharding.make_mesh` over the first N x D devices)."""
    if tensor is not None:
        return make_mesh(tensor=tensor, data=data, devices=devices)
    n = len(devices)
    shape = (1, n, 1) if job == "train" else (n // min(n, 8), 1, min(n, 8))
    grid = np.asarray(devices).reshape(shape)
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def placed(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves with `shardings` (a matching tree, or one sharding for all)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_target(config, dtype: str, mesh) -> Target:
    """A Target whose state is ShapeDtypeStructs placed on `mesh` by the rule table (no weight read)."""
    graphdef, state = abstract_model(config, dtype)
    target = Target(config, graphdef, placed(state, state_shardings(state, mesh)))
    target.mesh = mesh
    return target


def abstract_head(target: Target, mode: str, *, num_layers=1, draft_vocab=16384, k=8, dtype="float32", flags=None):
    """A Drafter of `new_drafter`'s shape for `target` with ShapeDtypeStruct weights on its mesh."""
    v = target.config.vocab_size
    vd = draft_vocab if 0 < draft_vocab < v else v
    config = head_config(target, num_layers, mode, vd, None, k, **(flags or {}))
    graphdef, state = abstract_drafter(config, dtype)
    return Drafter(config, graphdef, placed(state, state_shardings(state, target.mesh)))


def compile_program(name: str, trace) -> Program:
    """Compiles `trace()` (a jax Traced): a Program with its byte counts and FLOPs, or the
    compiler's refusal."""
    return compile_traced(name, trace)[0]


def compile_traced(name: str, trace) -> tuple[Program, object]:
    """`compile_program`'s Program and the jax Compiled (None when refused), to run it."""
    t0 = time.perf_counter()
    try:
        traced = trace()
        flops = jaxpr_flops(traced.jaxpr)
        lowered = traced.lower()
        text = lowered.as_text()
        compiled = interruptible(lowered.compile)  # minutes in XLA: an interrupt must not wait for it
    except Exception as err:  # the compiler's refusal (RESOURCE_EXHAUSTED, ...) is the result
        msg = " ".join(str(err).split())
        refused = Program(
            name, False, error=f"{type(err).__name__}: {msg[:400]}", compile_seconds=time.perf_counter() - t0
        )
        return refused, None
    mem = compiled.memory_analysis()
    launches = count_launches(compiled.as_text() or "")
    program = Program(
        name,
        True,
        argument_bytes=int(mem.argument_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        compile_seconds=time.perf_counter() - t0,
        kernels=tuple(sorted(set(KERNEL_NAME.findall(text)))),
        launches=launches,
        flops=flops,
        gathered_bytes=gathered_bytes(traced.jaxpr, compiled),
    )
    return program, compiled


def platform_of(mesh) -> str:
    """The kernels' platform of a mesh: its devices' (a topology's GPUs are "cuda"; the CPU of a
    --run test takes the XLA paths)."""
    return {"tpu": "tpu", "cpu": "cpu"}.get(mesh.devices.flat[0].platform, "cuda")


# ---------------------------------------------------------------- the train step


def synthetic_examples(batch: int, tokens: int, vocab: int):
    """`batch` sequences of `tokens` ids, the second half supervised (the step's shapes only
    depend on the lengths; the COD rows are sampled from them as in training)."""
    from train.data import Example

    rng = np.random.default_rng(0)
    mask = np.arange(tokens) >= tokens // 2
    return [Example(rng.integers(5, min(vocab, 30000), tokens).astype(np.int32), mask, i) for i in range(batch)]


def _train_config(mode: str, tokens: int, batch: int, compute_dtype: str, segments, flags):
    """The TrainConfig `python -m train` builds for this plan's step (UsageError / ConfigError)."""
    from train.flags import parse_args

    args = ["--model.mode", mode, "--model.compute_dtype", compute_dtype, "--data.max_len", str(tokens)]
    return parse_args([*args, "--data.batch_size", str(batch), "--loop.segments", str(segments), *flags])


def train_flags_error(mode: str, tokens: int, flags) -> str | None:
    """Why the trainer refuses these `python -m train` flags for a `mode` plan (None: it takes them)."""
    from peagle_jax.runtime.command_line import UsageError, one_line

    try:
        _train_config(mode, tokens, 1, "bfloat16", "auto", flags)
    except (UsageError, ValueError) as err:
        return one_line(err)
    return None


def train_step(
    target: Target, mode: str, *, tokens: int, batch: int = 1, compute_dtype="bfloat16", flags=(), segments="auto"
):
    """The traced train step of `python -m train` on `target` (its mesh): one batch of `batch`
    sequences of `tokens` tokens. `flags`: more `python -m train` flags (the head's shape)."""
    from train.config import draft_vocab_size
    from train.trainer import head_flags

    cfg = _train_config(mode, tokens, batch, compute_dtype, segments, flags)
    mc = cfg.model
    head = abstract_head(
        target, mode, num_layers=mc.num_layers, k=mc.k_train,
        draft_vocab=draft_vocab_size(mc.draft_vocab, target.config.vocab_size), dtype=mc.dtype,
        flags={k: v for k, v in head_flags(mc).items() if k != "init_layer"},
    )  # fmt: skip
    stepper, state = _stepper(cfg, target, head)
    arrays = _batch_arrays(cfg, stepper, target, batch, tokens)
    with kernels_partitioned(target.mesh if target.mesh.size > 1 else None):
        return stepper.trace(*state, arrays, platform_of(target.mesh))


def _stepper(cfg, target: Target, head: Drafter):
    """The trainer's TrainStep over abstract (params, opt_state, frozen), placed by the rule table."""
    from train.optim import make_optimizer
    from train.spec import TrainSpec
    from train.step import Parts, TrainStep, compute_parts, trainable

    mc, mesh = cfg.model, target.mesh
    flat = flat_state(head.state)
    dflash = mc.mode == "dflash"
    is_trained = nnx_predicate(trainable(mc.freeze_embed or dflash, mc.freeze_lm_head or dflash))
    params = {param_key(p): v.get_raw_value() for p, v in flat.items() if is_trained(p, v)}
    frozen = {param_key(p): v.get_raw_value() for p, v in flat.items() if not is_trained(p, v)}
    parts = compute_parts(Parts(head.graphdef, tuple(flat.items())), head.config, mc.compute_dtype, mc.dtype)
    optimizer = make_optimizer(cfg.optim, 1000)
    opt_state = jax.eval_shape(optimizer.init, params)
    state = tuple(placed(x, tree_shardings(x, mesh)) for x in (params, opt_state, frozen))
    vd, h = head.config.draft_vocab_size, target.config.hidden_size
    head_w = jax.ShapeDtypeStruct((vd, h), jnp.dtype(mc.dtype), sharding=role_sharding(mesh, "vocab_rows", 2))
    placement = dict(mesh=mesh, state=state) if mesh.size > 1 else {}  # as the Trainer places it
    spec = TrainSpec.of(cfg, target.config).step
    return TrainStep(
        parts, optimizer, target, head_w, spec, aux_layer_ids=head.config.aux_layer_ids, **placement
    ), state


def nnx_predicate(filter_):
    from flax import nnx

    return nnx.filterlib.to_predicate(filter_)


def _batch_arrays(cfg, stepper, target: Target, batch: int, tokens: int) -> dict:
    """The step's batch as ShapeDtypeStructs split over data x fsdp (COD rows or DFlash blocks
    sampled from synthetic sequences: the shapes a real batch of that length has)."""
    from train import cod
    from train.blocks import block_arrays, make_block_batch
    from train.spec import BatchSpec
    from train.step import batch_arrays

    exs = synthetic_examples(batch, tokens, target.config.vocab_size)
    spec = BatchSpec.of(cfg)
    if spec.mode == "dflash":
        b = make_block_batch(
            exs, step=0, seed=0, length=tokens, block_size=spec.block_size, max_anchors=spec.max_anchors
        )
        arrays = block_arrays(b)
    else:
        arrays = stepper.partition(batch_arrays(cod.make_batch(exs, spec, step=0, length=tokens)))
    mesh = target.mesh
    rows = NamedSharding(mesh, P(("data", "fsdp")) if batch % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0 else P())
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=rows) for k, v in arrays.items()}


# ---------------------------------------------------------------- serving


def serving_engine(target: Target, head: Drafter | None, mode: str, k: int) -> Engine:
    """The engine `python -m infer` builds over this target and head (abstract weights)."""
    return Engine(target, None if mode == "none" else head, k=k, mode=mode, deep_k="warn")


def abstract_state(engine: Engine, batch: int, cache_len: int):
    """The abstract DecodeState of `batch` rows placed as the engine places it."""
    shapes = jax.eval_shape(lambda: engine.empty(batch, cache_len))
    shardings = engine.state_shardings(shapes)
    return shapes if shardings is None else placed(shapes, shardings)


def serve_round(target: Target, head: Drafter | None, mode: str, *, batch: int, k: int, cache_len: int):
    """The traced speculative round of `mode` ("none": the plain decode step, one token a row)
    over caches of `cache_len` slots for `batch` rows."""
    engine = serving_engine(target, head, mode, k)
    state = abstract_state(engine, batch, cache_len)
    with kernels.for_platform(platform_of(target.mesh)):
        return engine.round_call(state).trace()


# ---------------------------------------------------------------- the server's programs (infer serve)


def server_programs(target: Target, head: Drafter | None, mode: str, *, batch: int, k: int, cache_len: int,
                    prompt: int) -> list[tuple[str, object]]:  # fmt: skip
    """(name, trace) of what `python -m infer serve --prefill-chunk PROMPT` runs, built by its own
    `Slots` over abstract weights: its prefill calls at their extremes (one prompt's longest piece,
    the most prompts a call takes) into `batch` slots of `cache_len` positions, and a step of one
    round over every slot."""
    slots = Slots(serving_engine(target, head, mode, k), batch, cache_len, prefill_tokens=prompt, abstract=True)
    platform = platform_of(target.mesh)
    most = max(slots.prefill_rows())
    extremes = sorted({(1, slots.piece_limit(1)), (most, slots.piece_limit(most))})

    def prefill(rows: int, piece: int):
        def trace():
            with kernels.for_platform(platform):
                return slots.prefill_call([slots.batch] * rows, piece).trace()

        return trace

    def step():
        with kernels.for_platform(platform):
            return slots.step_call(batch).trace()

    where = f"batch={batch} cache={slots.length}"
    programs = [(f"server/prefill/{mode} rows={r} piece={t} {where}", prefill(r, t)) for r, t in extremes]
    return [*programs, (f"server/step/{mode} k={slots.engine.k} {where}", step)]
