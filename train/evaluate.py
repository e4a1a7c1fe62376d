"""Evaluation of a trained head. `measure`: acceptance length and speedup against plain greedy
decoding on held-out prompts (the speculative engine of `peagle_jax.engine.generation`).
`HeldoutSet`: simulated acceptance on held-out sequences with its standard error, cheap
enough to compare many heads (see its docstring), per anchor and per greedy round.

Each prompt is decoded alone (batch 1, the regime speculative decoding targets), in the
trainer's own prompt format (`peagle_jax.conversations.chat.encode_prompt`); every prompt is padded to one
length and one KV cache size, so each decoder compiles once, and that compile is done on the
first prompt before timing. Acceptance length = 1 + accepted drafts per round (vLLM's
definition), averaged over all rounds of all prompts. The outputs of speculative decoding
are checked equal to plain greedy decoding (greedy speculative decoding is lossless).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.models.dflash import block_rows_states
from peagle_jax.models.eagle import cod_rows_forward
from train import cod
from train.blocks import BlockBatch, block_arrays
from train.loss import next_rows, take_rows, teacher_logits, top_index
from train.metrics import anchor_acceptance, clustered_mean
from train.spec import BatchSpec
from train.step import batch_arrays, chain_steps, target_states

__all__ = ["measure", "HeldoutSet", "heldout_rounds", "padded_features", "walk_rounds", "answer_starts"]


def _run(dec: SpeculativeDecoder, prompts, max_new: int):
    dec.generate([prompts[0]], max_new_tokens=max_new)  # compile
    tokens, seconds, new, rounds, acc_sum = [], 0.0, 0, 0, 0.0
    for p in prompts:
        res = dec.generate([p], max_new_tokens=max_new)
        tokens.append(res.tokens[0])
        seconds += res.stats["seconds"]
        new += res.stats["new_tokens"]
        r = int(res.stats.get("rounds", 0))
        rounds += r
        acc_sum += res.stats.get("acceptance_length", 0.0) * r
    return tokens, seconds, new, (acc_sum / rounds if rounds else 0.0)


def measure(target, drafter, prompts: list[list[int]], *, ks, mode: str, max_new: int) -> dict:
    """{"baseline_tokens_per_second", "prompts", "max_new_tokens", "by_k": {k: {...}}}."""
    if not prompts:
        raise ValueError("evaluation: no prompt fits (all longer than the limit)")
    pad = int(np.ceil(max(len(p) for p in prompts) / 64.0)) * 64
    cache = int(np.ceil((pad + max_new + 2 * max(ks) + 8) / 64.0)) * 64
    base = SpeculativeDecoder(target, mode="none", cache_len=cache, prompt_pad=pad)
    ref, b_sec, b_new, _ = _run(base, prompts, max_new)
    out = {"prompts": len(prompts), "max_new_tokens": max_new, "baseline_tokens_per_second": b_new / b_sec, "by_k": {}}
    for k in ks:
        dec = SpeculativeDecoder(target, drafter, k=k, mode=mode, cache_len=cache, prompt_pad=pad, deep_k="warn")
        toks, sec, new, acc = _run(dec, prompts, max_new)
        same = sum(a == b for a, b in zip(toks, ref)) / len(ref)
        out["by_k"][int(k)] = {
            "k": int(k),
            "acceptance_length": acc,
            "tokens_per_second": new / sec,
            "speedup": (new / sec) / (b_new / b_sec),
            "identical_to_greedy": same,
        }
    return out


class HeldoutSet:
    """Held-out sequences scored the way one greedy round would be, for any head.

    Every supervised anchor gets its parallel draft of depths 0..k-1 in one pass (COD rows with
    r = 1: every chain kept); a depth is right when the draft's target id equals the target's
    own greedy token there (argmax over the full vocabulary of its logits at that position, so
    a token outside the draft vocabulary is a miss). An anchor's acceptance is 1 + its leading
    right depths; the mean is over anchors whose k rows are all supervised, with a standard
    error over sequences (`train.metrics.clustered_mean`). On target-regenerated answers it is
    what the engine would accept from those positions. `features(example) -> (aux [L, 3H],
    y [L, H])` as the trainer computes them; the target's greedy tokens are computed once.

    EAGLE-3 heads (`chain=True`): every anchor's rows of steps 0..k-1 (`train.cod.chain_rows`)
    run as the training-time test does, step j over the keys and states of steps before it; a
    row's draft is the engine's chain draft from its anchor as long as the earlier ones were
    right, which is all an acceptance length reads.

    DFlash heads (`block_size` given; aux: the head's own context layers): every anchor a whose
    tokens a+1..a+k are supervised drafts its block in one pass, slot j right when it is the
    target's greedy token after position a + j - 1 (k at most block_size - 1). The anchors leave
    room for a block of `room` (default block_size) before the sequence ends: heads of different
    block sizes scored with one `room` are scored on the same anchors.

    Per round (`acceptance`'s "per_round"): the engine does not start a round at every anchor.
    From an answer's first token it runs a round, accepts that anchor's length L and starts the
    next round L tokens on (`walk_rounds`), so its acceptance length is tokens / rounds along that
    walk: long accepts are stepped over, and the mean over every anchor overstates it. On the
    target's own greedy answers the walk is exactly the engine's rounds (a test checks it)."""

    def __init__(self, target, examples: list, features, *, k=7, max_len=256, block_size=None, room=None, chain=False):
        self.k, self.block_size, self.chain = k, block_size, chain
        if block_size is not None and not 1 <= k < block_size:
            raise ValueError(f"HeldoutSet: k={k} drafts do not fit a DFlash block of {block_size}")
        w = jnp.asarray(target.embedding_arrays()[1])
        softcap = target.config.final_logit_softcapping
        self.rows, self.feats, self.greedy = [], [], []
        self.starts = [answer_starts(e.mask) for e in examples]
        every_anchor = BatchSpec(  # r = 1: every chain kept, one row bucket
            mode="chain" if chain else "parallel", k=k, max_len=max_len, length_buckets=1, r=1.0, r_min=1.0,
            row_factor=float(k + 1), row_granularity=512,
        )  # fmt: skip
        for e in examples:
            aux, y = features(e)
            greedy = _greedy_at(jnp.asarray(y)[None], w, softcap)  # [1, L]: the target's token after each position
            self.feats.append(jnp.asarray(aux)[None])
            if block_size is not None:
                self.rows.append(every_block(e, max_len, block_size, k, room=room))
                self.greedy.append(greedy)
                continue
            self.rows.append(cod.make_batch([e], every_anchor, step=0))
            self.greedy.append(next_rows(greedy))  # row t: the target at t + 1

    def anchor_lengths(self, drafter, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(anchors, acceptance lengths) of held-out sequence `i` under `drafter`."""
        mode = drafter.config.mode
        if (
            (mode == "dflash") != (self.block_size is not None)
            or (mode == "chain") != self.chain
            or (self.block_size is not None and drafter.config.block_size != self.block_size)
        ):
            raise ValueError(
                f"HeldoutSet of block_size {self.block_size}, chain {self.chain}: cannot score a {mode} head "
                f"(block_size {drafter.config.block_size})"
            )
        b = self.rows[i]
        d2t = jnp.asarray(drafter.d2t)
        if self.block_size is not None:
            return self.block_lengths(drafter, b, self.feats[i], self.greedy[i], d2t)
        hit = _row_hits(
            self.k, self.chain, drafter.graphdef, drafter.state, d2t, self.feats[i], self.greedy[i], batch_arrays(b)
        )
        sup = np.take_along_axis(b.sup, np.clip(b.anchor + b.depth, 0, b.sup.shape[1] - 1), axis=1)
        return anchor_acceptance(np.asarray(hit)[0], sup[0], b.anchor[0], b.depth[0], b.doc[0], self.k)

    def block_lengths(self, drafter, b, aux, greedy, d2t) -> tuple[np.ndarray, np.ndarray]:
        """(anchors, acceptance lengths) of one sequence's DFlash blocks `b` (a BlockBatch)."""
        hit = np.asarray(_block_hits(drafter.graphdef, drafter.state, d2t, aux, greedy, block_arrays(b)))[
            0, :, : self.k
        ]
        valid = b.anchor_valid[0]
        return b.anchor[0][valid].astype(np.int64), (1 + np.cumprod(hit[valid], axis=-1).sum(-1)).astype(np.float64)

    def acceptance(self, drafter) -> dict:
        """{"acceptance", "se", "anchors", "sequences", "by_depth", "per_round", "per_round_se",
        "rounds"} of `drafter`: the mean over anchors, by_depth[d] the share of anchors whose
        drafts 0..d are all right; per_round the engine's walk (the class docstring)."""
        sums, counts, ends, walked, rounds = [], [], np.zeros(self.k + 1), [], []
        offset = 0 if self.block_size is not None else 1  # a round's bonus token at p: DFlash anchor p, COD p - 1
        for i in range(len(self.rows)):
            anchors, lengths = self.anchor_lengths(drafter, i)
            sums.append(lengths.sum())
            counts.append(len(lengths))
            ends += np.bincount(lengths.astype(int) - 1, minlength=self.k + 1)
            tokens, n = walk_rounds(anchors, lengths, self.starts[i] - offset)
            walked.append(tokens)
            rounds.append(n)
        mean, se = clustered_mean(np.asarray(sums), np.asarray(counts))
        per_round, per_round_se = clustered_mean(np.asarray(walked), np.asarray(rounds))
        n = max(sum(counts), 1)
        reach = [float(ends[d + 1 :].sum() / n) for d in range(self.k)]
        out = {"acceptance": mean, "se": se, "anchors": int(sum(counts)), "sequences": len(counts), "by_depth": reach}
        return out | {"per_round": per_round, "per_round_se": per_round_se, "rounds": int(sum(rounds))}


def heldout_rounds(target, head, examples: list, *, k: int, max_len: int) -> dict:
    """`head`'s acceptance on held-out conversations as the engine would measure it answering
    them greedily at K = k (`HeldoutSet`'s per-round walk), with the mean over every anchor beside
    it: {"k", "conversations", "per_round", "per_round_se", "rounds", "per_anchor", "per_anchor_se"}."""
    feats = padded_features(target, head.config.aux_layer_ids, max_len)
    mode = head.config.mode
    block = head.config.block_size if mode == "dflash" else None
    held = HeldoutSet(target, examples, feats, k=k, max_len=max_len, block_size=block, chain=mode == "chain")
    score = held.acceptance(head)
    out = {"k": k, "conversations": len(examples), "per_anchor": score["acceptance"], "per_anchor_se": score["se"]}
    return out | {key: score[key] for key in ("per_round", "per_round_se", "rounds")}


def padded_features(target, aux_ids, max_len: int):
    """`features(example) -> (aux [max_len, n*H], y [max_len, H])` as `HeldoutSet` takes it: the
    target's states at `aux_ids` over the example padded to max_len (one compile for every example)."""
    aux_ids = tuple(int(i) for i in aux_ids)

    def feats(e):
        tokens = np.zeros((1, max_len), np.int32)
        positions = np.full((1, max_len), -1, np.int32)
        tokens[0, : len(e.ids)], positions[0, : len(e.ids)] = e.ids, np.arange(len(e.ids))
        aux, y = target_states(target.graphdef, target.state, tokens, positions, aux_ids)
        return np.asarray(aux[0], np.float32), np.asarray(y[0], np.float32)

    return feats


def answer_starts(mask) -> np.ndarray:
    """Positions where a supervised span (an answer) begins: its first token is a round's bonus."""
    m = np.asarray(mask, bool)
    return np.flatnonzero(m & ~np.concatenate([[False], m[:-1]]))


def walk_rounds(anchors, lengths, starts) -> tuple[float, int]:
    """(tokens, rounds) of the greedy rounds walked from each anchor of `starts`: the round from
    anchor a accepts lengths[a] tokens and the next starts at a + lengths[a], as the engine's
    rounds do on the target's greedy text; a walk ends at an anchor with no complete round."""
    at = dict(zip(np.asarray(anchors).tolist(), np.asarray(lengths).tolist()))
    tokens, rounds = 0.0, 0
    for a in np.asarray(starts).tolist():
        while a in at:
            tokens, rounds, a = tokens + at[a], rounds + 1, a + int(at[a])
    return tokens, rounds


def every_block(example, length: int, block_size: int, k: int, room: int | None = None) -> BlockBatch:
    """One sequence's DFlash blocks for scoring: an anchor at every position a whose next k
    tokens are supervised and from which a block of `room` (default block_size) stays in the
    sequence (one anchor slot per position)."""
    n = len(example.ids)
    sup = np.zeros(length, bool)
    sup[:n] = example.mask
    ok = np.zeros(length, bool)
    for a in range(max(0, n - (room or block_size) + 1)):
        ok[a] = sup[a + 1 : a + k + 1].all()
    anchors = np.flatnonzero(ok).astype(np.int32)
    b = BlockBatch(
        np.zeros((1, length), np.int32),
        np.full((1, length), -1, np.int32),
        sup[None],
        np.full((1, length), -1, np.int32),
        np.zeros((1, length), np.int32),
        np.zeros((1, length), bool),
        n,
    )
    b.tokens[0, :n], b.positions[0, :n], b.doc[0, :n] = example.ids, np.arange(n), 0
    b.anchor[0, : len(anchors)], b.anchor_valid[0, : len(anchors)] = anchors, True
    return b


@functools.partial(jax.jit, static_argnums=(2,))
def _greedy_at(y, w, softcap):
    """[1, L] the target's greedy token after each position (its logits there), over the full
    vocabulary (`w`: all of lm_head's rows)."""
    return top_index(teacher_logits(y, w, None, softcap=softcap))


@functools.partial(jax.jit, static_argnums=(0,))
def _block_hits(graphdef, state, d2t, aux, greedy, batch):
    """[1, n, B - 1] whether each block's draft at slot j (as a target id) is the target's greedy
    token after position a + j - 1 (batch: `train.blocks.block_arrays`)."""
    model = nnx.merge(graphdef, state)
    bs = model.config.block_size
    tokens, anchor = batch["tokens"], batch["anchor"]
    rows = (batch["positions"], batch["doc"], anchor, batch["anchor_valid"])
    logits = block_rows_states(model, tokens, aux, *rows, mask="kernels").logits
    top = top_index(logits.reshape(*anchor.shape, bs, -1)[:, :, 1:])  # [1, n, B - 1]
    drafted = top + jnp.take(d2t, top)
    ref = jnp.clip(anchor[..., None] + jnp.arange(bs - 1), 0, tokens.shape[1] - 1)  # a + j - 1, j = 1..B-1
    return drafted == jnp.take_along_axis(greedy, ref.reshape(1, -1), axis=1).reshape(ref.shape)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _row_hits(k, chain, graphdef, state, d2t, aux, greedy, batch):
    """[1, N] whether each row's draft (as a target id) is the target's greedy token: COD rows
    in one pass, or (`chain`) the training-time test's rows, step by step (batch:
    `train.step.batch_arrays`)."""
    model = nnx.merge(graphdef, state)
    tokens, anchor, depth, doc = batch["tokens"], batch["anchor"], batch["depth"], batch["doc"]
    if chain:
        states = chain_steps(model, next_rows(tokens), aux, batch, k, "kernels")
        logits = model.head(jnp.concatenate(states, axis=1))
    else:
        logits = cod_rows_forward(model, next_rows(tokens), aux, anchor, depth, doc, mask="kernels", chain_depth=k - 1)
    top = top_index(logits)
    drafted = top + jnp.take(d2t, top)
    ref = jnp.clip(anchor + depth, 0, tokens.shape[1] - 1)
    return drafted == take_rows(greedy, ref)
