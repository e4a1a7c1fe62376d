"""The lint's report as text (what `peagle-convert inspect` prints; `peagle_jax.formats.inspect`
builds the report and re-exports `format_report`). DFlash heads add their block size and the
drafts a pass (block_size - 1)."""

from __future__ import annotations

__all__ = ["format_report"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def format_report(r: dict) -> str:
    """The report as text (what `peagle-convert inspect` prints)."""
    mode = {"parallel": "parallel (P-EAGLE)", "chain": "chain (EAGLE-3)", "dflash": "dflash (DFlash)"}.get(
        r["mode"], r["mode"]
    )
    fmt = r["format"] + (f" ({r['architecture']})" if isinstance(r["architecture"], str) else "")
    if r.get("speculators_model_type"):
        fmt += f" (speculators_model_type {r['speculators_model_type']})"
    mask = "none" if r["mask_token_id"] is None else str(r["mask_token_id"])
    if r["mask_token_keys"]:
        mask += f" ({', '.join(r['mask_token_keys'])})"
    k = ", ".join(f"{a}={b}" for a, b in r["k_hints"].items()) or "none recorded"
    ints = [x for x in r["k_hints"].values() if _is_int(x)]
    if ints:
        k += f" (serve with num_speculative_tokens <= {max(ints)})"
    lines = [
        f"{r['path']}",
        f"  format       {fmt}",
        f"  mode         {mode}",
        f"  layers       {r['num_layers']}",
        f"  hidden       {r['hidden_size']} (target hidden {r['target_hidden_size']})",
        f"  vocab        {r['vocab_size']} (draft {r['draft_vocab_size']})",
        f"  mask id      {mask}",
        f"  aux ids      {r['aux_layer_ids']} (vLLM convention: residual stream entering those target layers)",
        f"  K hints      {k}",
        f"  max pos      {r['max_position_embeddings']}",
        f"  rope         {r['rope']}",
    ]
    if r.get("block_size") is not None:
        per_pass = r["block_size"] - 1 if _is_int(r["block_size"]) else "?"
        lines.append(f"  block        {r['block_size']} ({per_pass} drafts per pass)")
    if r.get("sliding_layers"):
        lines.append(f"  window       {r['sliding_window']} tokens on layers {r['sliding_layers']}")
    if r["files"]:
        lines.append(
            f"  tensors      {r['tensors']} in {len(r['files'])} file(s), {r['bytes'] / 1e6:.2f} MB, "
            f"{r['dtype']}" + (f", layer 0 as {r['layer0_prefix']}*" if r["layer0_prefix"] else "")
        )
    t = r["target"]
    lines.append(
        f"  target       {t['path']} ({t['model_type']}, {t['num_layers']} layers, hidden {t['hidden_size']}, "
        f"vocab {t['vocab_size']}, max pos {t['max_position_embeddings']})"
        if t
        else "  target       unknown"
    )
    if r.get("vllm_version"):
        lines.append(f"  vLLM         {r['vllm_version']} ({r.get('vllm_version_source') or 'checked against'})")
    if r.get("serve_note"):
        lines.append(f"  serving      {r['serve_note']}")
    for i, line in enumerate(r.get("serve_lines") or []):
        lines.append(f"  {'serve' if i == 0 else '':<12} {line}")
    for title, items in (("problems", r["problems"]), ("warnings", r["warnings"]), ("notes", r["notes"])):
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines += [f"  - {x}" for x in items]
    lines.append(f"{len(r['problems'])} problem(s)" if r["problems"] else "OK: no problems")
    return "\n".join(lines)
