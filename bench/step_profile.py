"""Per-op profiles of one training step, ours (XLA's trace, summed by HLO instruction) and
speculators' (torch.profiler), split by what each op works on (`python -m bench.train_speed --profile`)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def category(name: str, shapes: list[tuple[int, ...]], info: dict) -> str:
    """What an op works on, from the shapes it reads and writes: the draft vocabulary (lm_head,
    teacher, KL, argmax), the full vocabulary (embed_tokens' gradient and update), attention
    (a [rows, rows] score or mask, per-head [.., rows, heads | head_dim ..] tensors, or our
    blockwise kernels' loops), or the rest (projections, MLP, norms, gathers, optimizer)."""
    h = info["head"]
    dims = {d for sh in shapes for d in sh}
    rows = {info["rows"], info["rows_padded"]}
    if h["draft_vocab"] in dims:
        return "draft vocab"
    if h["vocab"] in dims:
        return "embedding"
    per_head = {h["heads"], h["kv_heads"]} - {1}
    if (
        "/while/" in name
        or "[attention block loop]" in name
        or any(sum(d in rows for d in sh) >= 2 for sh in shapes)
        or any(len(sh) >= 3 and rows & set(sh) and per_head & set(sh) for sh in shapes)
    ):
        return "attention"
    return "other"


def op_profile(ops: dict[str, tuple[float, list]], info: dict, top: int) -> dict:
    """{name: (ms, shapes)} -> total, per category, the top ops."""
    total = sum(ms for ms, _ in ops.values()) or 1.0
    cats: dict[str, float] = {}
    for name, (ms, shapes) in ops.items():
        c = category(name, shapes, info)
        cats[c] = cats.get(c, 0.0) + ms
    rows = sorted(ops.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {
        "total_ms": total,
        "categories": {c: {"ms": ms, "share": ms / total} for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top": [{"op": n, "ms": ms, "share": ms / total, "category": category(n, sh, info)} for n, (ms, sh) in rows],
    }


def profile_theirs(step, info: dict, top: int) -> dict:
    """torch.profiler over one step: self CPU time by (op, input shapes)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    ops: dict[str, tuple[float, list]] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = [tuple(sh) for sh in e.input_shapes if isinstance(sh, (list, tuple)) and sh]
        name = f"{e.key} {shapes[:3]}" if shapes else e.key
        ms = ops.get(name, (0.0, shapes))[0] + e.self_cpu_time_total / 1e3
        ops[name] = (ms, shapes)
    return op_profile(ops, info, top)


def profile_ours(step, hlo: str, info: dict, top: int) -> dict | str:
    """XLA's trace of one step summed by HLO instruction (thread-ms over the CPU client's
    threads), each with the shapes it reads and writes (its fused computation's signature)
    and the JAX op it came from, from the compiled module's text."""
    import re

    import jax

    try:
        from jax.profiler import ProfileData
    except ImportError:
        return "jax.profiler.ProfileData unavailable"
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        step()
        jax.profiler.stop_trace()
        files = list(Path(tmp).rglob("*.xplane.pb"))
        if not files:
            return "no trace written"
        data = ProfileData.from_file(str(files[0]))
    skip = ("ThunkExecutor", "ThreadpoolListener", "end: ")
    sums: dict[str, float] = {}
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                if not ev.name.startswith(skip):
                    sums[ev.name] = sums.get(ev.name, 0.0) + ev.duration_ns / 1e6

    def dims(text: str) -> list[tuple[int, ...]]:
        return [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\w+\[([\d,]*)\]", text)]

    sigs = {m[0]: m[1] for m in re.findall(r"^%([\w.\-]+) \((.*)\) -> ", hlo, re.M)}
    instr, calls, comp = {}, [], ""
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            comp = head.group(1)
        m = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$", line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        out = rest.split(" ")[0] if not rest.startswith("(") else rest[: rest.index(")") + 1]
        called = re.search(r"calls=%([\w.\-]+)", rest)
        op = re.search(r'op_name="([^"]*)"', rest)
        shapes = dims(out) + (dims(sigs.get(called.group(1), "")) if called else [])
        layout_free = re.sub(r"\{[^}]*\}", "", out)
        label = f"{name} {layout_free}" + (f" <{op.group(1).split('/', 1)[-1][:60]}>" if op else "")
        opcode = rest[len(out) :].strip().split("(", 1)[0]
        instr[name] = (label, shapes, opcode, comp)
        if opcode in ("while", "conditional", "call"):
            refs = re.findall(r"(?:body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)", rest)
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            refs += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
            calls.append((comp, opcode, refs))
    # computations run inside a while loop (and whatever they call)
    looped = {r for _, opcode, refs in calls if opcode == "while" for r in refs}
    grew = True
    while grew:
        new = {r for c, _, refs in calls if c in looped for r in refs} - looped
        looped |= new
        grew = bool(new)
    ops = {}
    for n, ms in sums.items():
        label, shapes, opcode, comp = instr.get(n, (n, [], "", ""))
        if opcode in ("while", "conditional", "call"):  # their bodies' thunks are traced too
            continue
        if comp in looped:  # the only loops in the step: the blockwise attention kernels' block loops
            label += " [attention block loop]"
        ops[label] = (ms, shapes)
    return op_profile(ops, info, top)
