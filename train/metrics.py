"""Host-side training metrics: per-depth and conditional accuracy of a step, and the run's log
(OUT/metrics.jsonl + TensorBoard events).

Conditional accuracy at depth d: the share of supervised rows whose drafts at depths 0..d (the
same anchor) are all right; 1 + its sum over the first K depths is the simulated acceptance
length at K.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from train import distributed as dist

__all__ = ["MetricsLog", "conditional_hits", "step_stats", "add_stats", "stats_record"]

SUMMED = ("correct", "total", "cond", "ctot", "loss", "n")  # what `add_stats` sums over batches
BLOCK_SUMMED = ("eal_sum", "eal_blocks")  # DFlash steps' too (`train.blocks.block_stats`)


class MetricsLog:
    """OUT/metrics.jsonl (lines past a restored step are dropped) + TensorBoard events; written
    by process 0 only (`enabled`)."""

    def __init__(self, out: Path, resume_step: int, enabled: bool = True):
        self.path = out / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        if self.path.exists():
            keep = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= resume_step
            ]
            tmp = self.path.with_name("metrics.jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, self.path)
        self.f = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        self.f.write(json.dumps(rec, default=float) + "\n")
        self.f.flush()
        if self.tb is None:
            return
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k != "step":
                self.tb.add_scalar(k, v, rec["step"])
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    self.tb.add_scalar(f"{k}/{i}", x, rec["step"])

    def records(self) -> list[dict]:
        """The training steps' records so far (a resumed run's whole history)."""
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if '"loss"' in ln]

    def close(self) -> None:
        if not self.enabled:
            return
        self.f.close()
        if self.tb is not None:
            self.tb.close()


def conditional_hits(
    hit: np.ndarray, sup: np.ndarray, anchor: np.ndarray, depth: np.ndarray, doc: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per depth: supervised rows whose whole chain (same anchor, depths 0..d) is right, and
    the supervised rows (host numpy; rows sorted by (depth, anchor) within a sequence)."""
    cond = np.zeros(k)
    tot = np.zeros(k)
    for b in range(hit.shape[0]):
        ok: dict[int, bool] = {}
        for h, s, a, d, c in zip(hit[b], sup[b], anchor[b], depth[b], doc[b]):
            if c < 0:
                continue
            chain = bool(h) and (d == 0 or ok.get(int(a), False))
            ok[int(a)] = chain  # rows come depth by depth: this is what depth d + 1 reads
            if s:
                tot[d] += 1
                cond[d] += chain
    return cond, tot


def step_stats(m: dict, batch, k: int, eval_k: int, first_row: int | None = None) -> dict:
    """Host metrics of one step's outputs `m`: per-depth accuracy, conditional accuracy, simulated
    acceptance at eval_k, and the counts behind them. first_row: `batch` holds this process's rows
    only, from that global row (hit / sup are then split over processes): their conditional counts
    are summed over processes."""
    rows_split = first_row is not None
    correct, total = np.asarray(m["correct"]), np.asarray(m["total"])
    hit, sup = (dist.local_rows(m[n]) if rows_split else np.asarray(m[n]) for n in ("hit", "sup"))
    cond, ctot = conditional_hits(hit, sup, batch.anchor, batch.depth, batch.doc, k)
    if rows_split:
        cond, ctot = dist.sum_over_processes(cond, first_row), dist.sum_over_processes(ctot, first_row)
    return {"loss": float(m["loss"]), "n": 1, "correct": correct, "total": total, "cond": cond, "ctot": ctot}


def add_stats(a: dict | None, b: dict) -> dict:
    """The counts of two `step_stats` summed (a held-out pass over several batches)."""
    return b if a is None else {key: a[key] + b[key] for key in (*SUMMED, *BLOCK_SUMMED) if key in b}


def stats_record(s: dict, eval_k: int) -> dict:
    """{loss, acc, cond_acc, sim_tau} of (summed) `step_stats`; the loss is the mean over batches.
    DFlash stats add eal: speculators' expected accepted length (1 + leading right drafts per block)."""
    acc = np.where(s["total"] > 0, s["correct"] / np.maximum(s["total"], 1), 0.0)
    cacc = np.where(s["ctot"] > 0, s["cond"] / np.maximum(s["ctot"], 1), 0.0)
    rec = {
        "loss": s["loss"] / s["n"],
        "acc": acc.tolist(),
        "cond_acc": cacc.tolist(),
        "sim_tau": float(1.0 + cacc[:eval_k].sum()),
    }
    if "eal_sum" in s:
        rec["eal"] = float(s["eal_sum"] / s["eal_blocks"]) if s["eal_blocks"] else 0.0
    return rec


def anchor_acceptance(hit, sup, anchor, depth, doc, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per anchor whose rows of depths 0..k-1 all exist and are supervised: the simulated
    acceptance length 1 + (leading depths whose draft is right), what one greedy round from
    that position would accept. Host numpy rows of one sequence -> (anchors, lengths)."""
    chains: dict[int, list] = {}
    for h, s, a, d, c in zip(hit, sup, anchor, depth, doc):
        if c >= 0 and d < k:
            chains.setdefault(int(a), [None] * k)[int(d)] = bool(h) if s else None
    anchors, lengths = [], []
    for a, chain in sorted(chains.items()):
        if any(x is None for x in chain):
            continue  # a depth missing or unsupervised: no full round measurable from here
        lead = next((i for i, x in enumerate(chain) if not x), k)
        anchors.append(a)
        lengths.append(1 + lead)
    return np.asarray(anchors, np.int64), np.asarray(lengths, np.float64)


def clustered_mean(sums: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    """(mean, standard error) of a ratio of per-cluster sums over per-cluster counts (positions
    of one sequence are correlated; sequences are the independent units)."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    total = counts.sum()
    if total == 0:
        return float("nan"), float("nan")
    mean = sums.sum() / total
    n = int((counts > 0).sum())
    resid = sums - mean * counts
    se = np.sqrt(n / max(n - 1, 1) * np.sum(resid**2)) / total
    return float(mean), float(se)
