"""The jitted train step: pure functions of (trainable params, frozen params, target state, batch).

Parameters are flat dicts {"a.b.c": array} (plain pytrees for optax and orbax); `Parts.merge`
rebuilds the NNX drafter inside the trace (the functional form: no `nnx.jit`). Frozen: d2t,
plus embed_tokens / lm_head when the config freezes them.

Teacher (online): the frozen target runs inside the step over the token rows and gives the
aux states (drafter inputs) and the final-norm states y; the teacher logits are y times the
target's lm_head rows of the draft vocabulary only (gathered once on the host, [Vd, H]), one
[L, Vd] product per sequence, then gathered per COD row by its reference position.

Objectives: "parallel" = P-EAGLE COD rows through `cod_rows_states(mask="kernels")` (layer 0
attends the mask slot once per position: `kernels.slot_attention`) with the
forward KL of `train.loss.fused_draft_loss` (one global normalisation, or per depth; the head's
product runs inside the loss, chunk by chunk, over the supervised rows only); "chain" =
EAGLE-3 training-time test: step j feeds the head's own pre-norm states of step j-1 back as
the hidden input of rows (anchor, j) (same P-EAGLE attention rule over the rows of steps
<= j), loss = sum_j decay**j * KL_j / count_j (speculators' per-step weights); "dflash" =
DFlash anchored blocks (`train.blocks.block_loss_and_metrics`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import kernels
from peagle_jax.handles.target import target_apply
from peagle_jax.models.abstract import abstract_module
from peagle_jax.models.dflash import DFlashModel
from peagle_jax.models.eagle import DrafterModel, cod_rows_states, flat_state, param_key
from peagle_jax.models.rows import rows_sharded
from peagle_jax.runtime.sharding import kernels_partitioned, role_sharding, shard_state, tree_shardings
from train.blocks import block_loss_and_metrics
from train.loss import LossRows, fused_draft_loss, next_rows, take_rows, teacher_logits, top_index
from train.segments import SegmentedPass, attention_for, resolve_segments, segment_rows
from train.spec import LossSpec, StepSpec

__all__ = ["Parts", "trainable", "split_params", "compute_parts", "features", "loss_and_metrics", "TrainStep"]


@dataclasses.dataclass(frozen=True)
class Parts:
    """Static description of the drafter: graphdef + variable templates (hashable by id)."""

    graphdef: Any
    template: tuple  # ((path, Variable), ...)

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other

    def merge(self, params: dict, frozen: dict):
        flat = {**params, **frozen}
        state = nnx.from_flat_state([(p, var.replace(flat[param_key(p)])) for p, var in self.template])
        return nnx.merge(self.graphdef, state)


def trainable(freeze_embed: bool, freeze_lm_head: bool):
    """The nnx filter of the trained variables: every `nnx.Param` (the d2t `VocabMap` is not one)
    but embed_tokens / lm_head when they are frozen."""
    frozen = [
        nnx.PathContains(name) for name, off in (("embed_tokens", freeze_embed), ("lm_head", freeze_lm_head)) if off
    ]
    return nnx.All(nnx.Param, nnx.Not(nnx.Any(*frozen))) if frozen else nnx.Param


def split_params(drafter, freeze_embed: bool, freeze_lm_head: bool) -> tuple[Parts, dict, dict]:
    """(Parts, trainable {param_key: array}, frozen {param_key: array}) of a Drafter handle."""
    flat = flat_state(drafter.state)
    is_trained = nnx.filterlib.to_predicate(trainable(freeze_embed, freeze_lm_head))
    params, frozen = {}, {}
    for p, var in flat.items():
        if is_trained(p, var):  # a copy: the step donates its inputs, the handle keeps its own arrays
            params[param_key(p)] = jnp.array(var[...], copy=True)
        else:
            frozen[param_key(p)] = jnp.asarray(var[...])
    return Parts(drafter.graphdef, tuple(flat.items())), params, frozen


def compute_parts(parts: Parts, config, compute_dtype: str, param_dtype: str) -> Parts:
    """`parts` whose modules compute in `compute_dtype` (matmul inputs and activations cast to it)
    while the parameters they are given stay `param_dtype`: bf16 compute over f32 master weights.
    The loss stays float32 (`train.loss` upcasts the logits)."""
    if compute_dtype == param_dtype:
        return parts
    network = DFlashModel if config.mode == "dflash" else DrafterModel
    return Parts(abstract_module(network, config, compute_dtype, param_dtype)[0], parts.template)


def features(target_def, target_state, tokens, positions, aux_layer_ids):
    """Target aux states [B, L, 3H] and final-norm states [B, L, H] (no logits computed)."""
    out = target_apply(
        target_def, target_state, tokens, positions, None, aux_layer_ids=aux_layer_ids, compute_logits=False
    )
    return jax.lax.stop_gradient(out.aux_hidden), jax.lax.stop_gradient(out.hidden)


# `features` as one compiled program per shape with the target's state an argument (closing over
# it would embed every weight in the program as a constant)
target_states = jax.jit(features, static_argnums=(0, 4))


def _teacher(y, head_w, softcap):
    """Teacher logits [B, L, Vd] of row t = the target at t + 1 (`fused_draft_loss` takes their
    log-softmax, once: a second one here cost ~1 s of a 4096-token step on CPU)."""
    return teacher_logits(next_rows(y), head_w, None, softcap=softcap)


def loss_and_metrics(parts: Parts, params, frozen, aux, y, head_w, batch, spec: LossSpec):
    """(loss, metrics) of one batch of COD rows from target features aux [B, L, 3H], y [B, L, H]
    and the target's lm_head rows of the draft vocabulary head_w [Vd, H]: the objective of
    `spec` (mode parallel or chain)."""
    model = parts.merge(params, frozen)
    anchor, depth, doc = batch["anchor"], batch["depth"], batch["doc"]
    ref = jnp.clip(anchor + depth, 0, aux.shape[1] - 1)
    row_tok = next_rows(batch["tokens"])
    teacher = _teacher(y, head_w, spec.softcap)
    top_t = top_index(teacher)  # the teacher's top token, once per position (rows gather it)
    sup = take_rows(batch["sup"], ref) & (doc >= 0)
    if spec.mode == "parallel":
        attention = attention_for(spec.attention, anchor.shape[1])
        res = cod_rows_states(model, row_tok, aux, anchor, depth, doc, mask=attention, chain_depth=spec.k - 1)
        top = take_rows(top_t, ref)
        rows = LossRows(sup, depth, spec.k, teacher_rows=ref, teacher_top=top, per_depth=spec.per_depth)
        out = fused_draft_loss(*model.head_inputs(res.prenorm), teacher, rows, ce_weight=spec.ce_weight)
        loss, hit, correct, total = out.loss, out.hit, out.correct, out.total
    else:
        loss, hit, correct, total = chain_objective(model, row_tok, aux, teacher, top_t, sup, batch, spec)
    metrics = {"loss": loss, "correct": correct, "total": total, "hit": hit, "sup": sup}
    return loss, metrics


def chain_steps(model, row_tok, aux, batch, k: int, attention: str):
    """EAGLE-3's training-time test over rows ordered by (step, anchor), L rows a step
    (`train.cod.chain_rows`; batch: their anchor, depth and doc): the pre-norm states [B, L, H] of
    steps 0..k-1, attention "kernels" or "dense". Step j runs only its own rows, over the keys
    and values steps 0..j-1 left (`context`) and the state step j-1 left at each row
    (`feedback`): every row is computed once (k passes of L rows), and a row's draft is the
    engine's chain from its anchor whenever the chain's earlier drafts were right."""
    anchor, depth, doc = batch["anchor"], batch["depth"], batch["doc"]
    length = aux.shape[1]
    hidden = model.fuse(aux.astype(jnp.float32))
    context = model.empty_context(aux.shape[0], hidden.dtype)
    states = []
    for j in range(k):
        rows = slice(j * length, (j + 1) * length)
        a, d, c = anchor[:, rows], depth[:, rows], doc[:, rows]
        seen = slice(0, (j + 1) * length)
        spec = kernels.AttentionSpec.make(a, d, c, anchor[:, seen], depth[:, seen], doc[:, seen], chain_depth=k - 1)
        res = model(
            take_rows(row_tok, jnp.clip(a + d, 0, length - 1)),
            hidden,
            jnp.where(c >= 0, a + d, -1),
            None,
            spec,
            "auto" if attention == "kernels" else "dense",
            context=context,
        )
        context = model.extend_context(context, res.cache)
        hidden = model.feedback(res.prenorm)
        states.append(res.prenorm)
    return states


def chain_objective(model, row_tok, aux, teacher, top_t, sup, batch, spec: LossSpec):
    """EAGLE-3's training-time test (`chain_steps`): (loss, hit, correct, total) of the spec.k
    steps of rows, step j weighted spec.chain_decay**j."""
    length = aux.shape[1]
    attention = attention_for(spec.attention, batch["anchor"].shape[1])
    states = chain_steps(model, row_tok, aux, batch, spec.k, attention)
    loss = jnp.zeros((), jnp.float32)
    hits, corrects, totals = [], [], []
    for j, prenorm in enumerate(states):
        rows = LossRows(sup[:, j * length : (j + 1) * length], teacher_top=next_rows(top_t, j))
        o = fused_draft_loss(*model.head_inputs(prenorm), next_rows(teacher, j), rows, ce_weight=spec.ce_weight)
        loss = loss + (spec.chain_decay**j) * o.loss
        hits.append(o.hit)
        corrects.append(o.correct[0])
        totals.append(o.total[0])
    hit = jnp.concatenate(hits, axis=1)
    correct, total = jnp.stack(corrects), jnp.stack(totals)
    return loss, hit, correct, total


class TrainStep:
    """Jitted train / eval steps for one run (online teacher, or cached features)."""

    def __init__(
        self, parts: Parts, optimizer, target, head_w, spec: StepSpec, *, aux_layer_ids=None, mesh=None, state=None
    ):
        """The step of `spec` (its loss: `train.spec.LossSpec`; mode "dflash" takes `train.blocks`
        batches). aux_layer_ids: the target layers the head reads (None: the target's; a DFlash
        head's own). mesh: a (data, fsdp, tensor) Mesh (peagle_jax.runtime.sharding): the steps are jitted
        with explicit shardings (parameters and optimizer state by its rule table, batch rows over
        data x fsdp, logged scalars replicated); `state` = (params, opt_state, frozen) templates
        gives their structures. Place the state with `place_state`; batches are this process's
        rows (`rows`)."""
        self.parts, self.optimizer = parts, optimizer
        self.mesh, self.spec = mesh, spec
        resolve_segments(spec.segments, 1, spec.max_rows_per_segment)  # a bad value fails here, not at the first step
        self.target_def, self.target_state = target.graphdef, target.state
        self.aux_ids = tuple(target.aux_layer_ids if aux_layer_ids is None else aux_layer_ids)
        self.head_w = head_w
        sh = None
        if mesh is not None:
            if getattr(target, "mesh", None) is not mesh:
                self.target_state = shard_state(target.state, mesh)
            sh = self._shardings(mesh, state)
            placed = isinstance(head_w, jax.ShapeDtypeStruct)  # `peagle_jax.plan`'s abstract weights
            self.head_w = head_w if placed else jax.device_put(head_w, sh["head_w"])
        loss = spec.loss
        objective = block_loss_and_metrics if loss.mode == "dflash" else loss_and_metrics
        aux_ids = self.aux_ids
        opt = optimizer

        def lossf(params, frozen, aux, y, head_w, batch):
            return objective(parts, params, frozen, aux, y, head_w, batch, loss)

        def segments(params, frozen, aux, y, head_w, batch, with_grads=True):
            # batches with "seg_rows" (see partition): (loss, metrics, grads), grads None without with_grads
            return SegmentedPass(parts, frozen, aux, y, head_w, batch, loss).run(params, with_grads)

        def constrain(m, rows):
            # per-row outputs keep the batch split (each process reads its own rows); the rest is replicated
            if sh is None:
                return m
            return jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, sh["batch"] if rows and x.ndim >= 2 else sh["rep"]), m
            )

        def from_features(params, opt_state, frozen, head_w, aux, y, batch):
            if "seg_rows" in batch:
                _, m, grads = segments(params, frozen, aux, y, head_w, batch)
            else:
                (_, m), grads = jax.value_and_grad(lossf, has_aux=True)(params, frozen, aux, y, head_w, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            m["grad_norm"] = optax.global_norm(grads)
            m["param_norm"] = optax.global_norm(params)  # the updated head: a blown-up update shows here
            return params, opt_state, constrain(m, True)

        def online(params, opt_state, frozen, head_w, tstate, batch):
            with rows_sharded(None if sh is None else sh["batch"]):
                aux, y = features(target.graphdef, tstate, batch["tokens"], batch["positions"], aux_ids)
            return from_features(params, opt_state, frozen, head_w, aux, y, batch)

        def evaluate(params, frozen, head_w, tstate, batch):
            aux, y = features(target.graphdef, tstate, batch["tokens"], batch["positions"], aux_ids)
            if "seg_rows" in batch:
                return constrain(segments(params, frozen, aux, y, head_w, batch, with_grads=False)[1], False)
            return constrain(lossf(params, frozen, aux, y, head_w, batch)[1], False)

        def feats(tstate, tokens, positions):
            return features(target.graphdef, tstate, tokens, positions, aux_ids)

        self._jit(sh, online, from_features, evaluate, feats)

    def _jit(self, sh, online, from_features, evaluate, feats) -> None:
        """The four programs jitted, with explicit shardings on a mesh (`sh`, else None)."""
        if sh is None:
            self._jit_online = lambda: jax.jit(lambda *a: online(*a), donate_argnums=(0, 1))  # noqa: E731
            self._online = self._jit_online()
            self._cached = jax.jit(from_features, donate_argnums=(0, 1))
            self._eval = jax.jit(evaluate)
            self._feats = jax.jit(feats)
            return
        online, from_features, evaluate, feats = (
            _kernels_on(self.mesh, fn) for fn in (online, from_features, evaluate, feats)
        )
        p, o, f, b, rep, t, hw = (sh[n] for n in ("params", "opt", "frozen", "batch", "rep", "target", "head_w"))
        out = (p, o, None)  # metrics: placed by `constrain`
        self._jit_online = lambda: jax.jit(  # noqa: E731
            lambda *a: online(*a), in_shardings=(p, o, f, hw, t, b), out_shardings=out, donate_argnums=(0, 1)
        )
        self._online = self._jit_online()
        self._cached = jax.jit(
            from_features, in_shardings=(p, o, f, hw, b, b, b), out_shardings=out, donate_argnums=(0, 1)
        )
        self._eval = jax.jit(evaluate, in_shardings=(p, f, hw, t, rep), out_shardings=rep)
        self._feats = jax.jit(feats, in_shardings=(t, rep, rep), out_shardings=rep)

    def _shardings(self, mesh, state) -> dict:
        if state is None:
            raise ValueError("TrainStep(mesh=...) needs state=(params, opt_state, frozen) templates")
        params, opt_state, frozen = state
        return {
            "params": tree_shardings(params, mesh),
            "opt": tree_shardings(opt_state, mesh),
            "frozen": tree_shardings(frozen, mesh),
            "target": jax.tree.map(lambda x: x.sharding, self.target_state),
            "head_w": role_sharding(mesh, "vocab_rows", 2),
            "batch": role_sharding(mesh, "batch", 1),
            "rep": role_sharding(mesh, "replicated", 0),
        }

    def place_state(self, params, opt_state, frozen):
        """(params, opt_state, frozen) placed on the mesh by the rule table (unchanged without one)."""
        if self.mesh is None:
            return params, opt_state, frozen
        return tuple(jax.device_put(x, tree_shardings(x, self.mesh)) for x in (params, opt_state, frozen))

    def _blocks(self, n: int) -> list[tuple[int, int]]:
        """The distinct [lo, hi) row blocks of an n-row batch that this process's devices hold."""
        idx = role_sharding(self.mesh, "batch", 1).addressable_devices_indices_map((n,))
        return sorted({i[0].indices(n)[:2] for i in idx.values()})

    def rows(self, global_batch: int) -> tuple[int, int]:
        """[lo, hi): the rows of a global batch this process feeds (all of them in one process).
        The batch is split over data x fsdp, so its size must be a multiple of their product."""
        if self.mesh is None:
            return 0, global_batch
        split = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if global_batch % split:
            raise ValueError(
                f"data.batch_size={global_batch} is not a multiple of mesh.data x mesh.fsdp = {split} "
                "(each of those device groups takes whole sequences)"
            )
        blocks = self._blocks(global_batch)
        if any(a[1] != b[0] for a, b in zip(blocks, blocks[1:])):
            raise ValueError("this process's devices hold non-contiguous batch rows: use another mesh shape")
        return blocks[0][0], blocks[-1][1]

    def place_batch(self, local: dict) -> dict:
        """This process's rows of a batch (host numpy, see `rows`) -> global arrays split over the mesh."""
        if self.mesh is None:
            return local
        split = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        n = len(next(iter(local.values())))
        total = n * split // len(self._blocks(split))
        b = role_sharding(self.mesh, "batch", 1)
        return {
            k: jax.make_array_from_process_local_data(b, np.asarray(v), (total, *np.shape(v)[1:]))
            for k, v in local.items()
        }

    def partition(self, batch: dict) -> dict:
        """The batch with its segments' rows ("seg_rows", host numpy) when it is split into
        more than one segment (train.segments); unchanged otherwise."""
        mode = self.spec.loss.mode
        if "seg_rows" in batch or mode == "dflash":  # DFlash blocks run in one pass
            return batch
        length, rows = np.shape(batch["tokens"])[1], np.shape(batch["anchor"])[1]
        s = resolve_segments(self.spec.segments, rows, self.spec.max_rows_per_segment)
        if s == 1:
            return batch
        seg = segment_rows(batch["anchor"], batch["depth"], batch["doc"], length, s, mode, self.spec.loss.k)
        if jax.process_count() > 1 and mode == "parallel":  # one global array: pad to the widest of any process
            from jax.experimental import multihost_utils

            width = int(np.max(multihost_utils.process_allgather(np.int32(seg.shape[2]))))
            seg = np.pad(seg, ((0, 0), (0, 0), (0, width - seg.shape[2])), constant_values=rows)
        return {**batch, "seg_rows": seg}

    def __call__(self, params, opt_state, frozen, batch: dict, feats=None):
        batch = self.place_batch(self.partition(batch))
        if feats is not None and self.mesh is not None:
            feats = tuple(self.place_batch({"x": np.asarray(x)})["x"] for x in feats)
        if feats is None:
            return self._online(params, opt_state, frozen, self.head_w, self.target_state, batch)
        return self._cached(params, opt_state, frozen, self.head_w, feats[0], feats[1], batch)

    def trace(self, params, opt_state, frozen, batch: dict, platform: str):
        """The online step (the target inside) traced for `platform` ("cuda", "tpu", "cpu") with
        that platform's kernels, on any machine: the program the accelerator would run. A fresh
        function under a fresh jit, so no trace made for another platform is reused."""
        with kernels.for_platform(platform):
            return self._jit_online().trace(
                params, opt_state, frozen, self.head_w, self.target_state, self.partition(batch)
            )

    def lower(self, params, opt_state, frozen, batch: dict, platform: str):
        """`trace`, lowered for `platform`."""
        with kernels.for_platform(platform):
            return self.trace(params, opt_state, frozen, batch, platform).lower(lowering_platforms=(platform,))

    def trace_cached(self, params, opt_state, frozen, aux, y, batch: dict):
        """The cached-features step traced for these shapes (benchmarks compile it and read its
        `memory_analysis()`, XLA's plan of the step's buffers, and its jaxpr's FLOPs)."""
        return self._cached.trace(params, opt_state, frozen, self.head_w, aux, y, self.partition(batch))

    def evaluate(self, params, frozen, batch: dict):
        batch = self.partition(batch)
        if self.mesh is not None:  # a whole held-out batch, the same on every process
            batch = jax.device_put(batch, role_sharding(self.mesh, "replicated", 0))
        return self._eval(params, frozen, self.head_w, self.target_state, batch)

    def features(self, tokens, positions):
        if self.mesh is not None:
            tokens, positions = jax.device_put((tokens, positions), role_sharding(self.mesh, "replicated", 0))
        return self._feats(self.target_state, tokens, positions)


def batch_arrays(b) -> dict[str, np.ndarray]:
    return {
        "tokens": b.tokens,
        "positions": b.positions,
        "sup": b.sup,
        "anchor": b.anchor,
        "depth": b.depth,
        "doc": b.doc,
    }


def _kernels_on(mesh, fn):
    """fn traced with the Pallas kernels partitioned over `mesh` (`sharding.kernels_partitioned`)."""

    @functools.wraps(fn)
    def traced(*args):
        with kernels_partitioned(mesh):
            return fn(*args)

    return traced
