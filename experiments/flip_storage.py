"""Every byte in a flip table's sizes: the fixed bytes of stream options spread over the context
the table is read at (:func:`storage_context`), bits per value and compression against f32
(:func:`add_storage`)."""

__all__ = ["add_storage", "storage_context"]


def storage_context(meta):
    """Tokens over which a table spreads the fixed bytes of stream options: the text chunk's
    context, or the protocol's sequence (prompt + greedy tokens) without text."""
    if "text" in meta:
        return int(meta["text"]["chunk_tokens"])
    return int(meta["protocol"]["prompt_tokens"]) + int(meta["protocol"]["new_tokens"])


def add_storage(rows, meta):
    """Every byte in the rows' sizes: ``marginal_bytes_per_token`` (what each further token
    adds), ``fixed_bytes`` (stream options: f32 sink rows, recent-window copies, offsets and
    scales), ``context_tokens`` (:func:`storage_context`), ``bytes_per_token`` = marginal +
    fixed / context (all the cache stores, per token of that context), ``bits_per_value`` and
    ``compression`` (f32 bytes per token over it). Rows of older results, whose
    ``bytes_per_token`` was the marginal one, are read as such."""
    from kvquant.specs import parse_cache_spec
    context = storage_context(meta)
    specs = [parse_cache_spec(r["codec"]) for r in rows]
    for r, spec in zip(rows, specs):
        if "marginal_bytes_per_token" not in r:
            r["marginal_bytes_per_token"] = r["bytes_per_token"]
        r["fixed_bytes"] = int(r.get("fixed_bytes", 0))
        if hasattr(spec, "fixed_bytes"):
            # a cache whose fixed rows depend on the length (a simulation's float32 residual):
            # counted at this context
            m = meta["model"]
            r["fixed_bytes"] = int(round(spec.fixed_bytes(
                m["n_layers"], m["n_kv_heads"], m["head_dim"], context)))
        r["context_tokens"] = context
        r["bytes_per_token"] = r["marginal_bytes_per_token"] + r["fixed_bytes"] / context
    # the f32 reference's row (its spec asked: "f32", or another spelling of it)
    f32 = next(r for r, spec in zip(rows, specs) if spec.is_reference)
    values_per_token = f32["marginal_bytes_per_token"] / 4.0
    for r in rows:
        r["compression"] = f32["bytes_per_token"] / r["bytes_per_token"]
        r["bits_per_value"] = 8.0 * r["bytes_per_token"] / values_per_token
    return rows
