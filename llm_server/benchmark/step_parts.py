"""Where a compiled decode step's time goes: its parts timed alone, each as one compiled graph.

    python -m llm_server.native.blas python -m llm_server.benchmark.step_parts [--model DIR] [--rows 1]

Parts, at the step's shapes (rows, the span attention reads), each replayed `--reps` times
and alternated with the whole step so a shared machine's load hits them alike:
- products: every layer's q/k/v, o, gate/up and down products and the output head, split
  across the two CPU streams as the step splits them, each waiting for the one before (as in
  the step; a slice and a product per layer join them);
- attention: every layer's `decode_attention.attend` over the span (with the decode ops,
  llm_server.native.decode_ops, their `attend` over each row's history);
- norms: every RMSNorm of the step (two per layer and the final one);
- whole step: `MLXEngine.decode`, graph replay and evaluation included.
What the parts do not cover (rotation, SiLU, residual adds, KV writes, dispatching the graph's
ops, Python) is the whole step minus their sum.
"""

from __future__ import annotations

import statistics
import time

from llm_server.benchmark.settings import probe_parser


def _timed(fn, reps: int) -> list[float]:
    import mlx.core as mx

    out = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - start) * 1e3)
    return out


def measure(model: str, rows: int, prompt_len: int, reps: int) -> dict[str, list[float]]:
    import mlx.core as mx

    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.native import decode_attention

    engine = MLXEngine(model, EngineSettings(rows=rows, compiled_decode=True))
    fused = engine.fused
    if fused is None or fused.compiled is None:
        raise SystemExit(f"{model}: the compiled decode step does not apply to this model")
    ids = list(range(rows))
    for r in ids:
        engine.prefill(r, [(7 * i + 3 * r) % 1000 + 10 for i in range(prompt_len + 5 * r)])
    context = engine.forward.context(rows)  # the step's kernels (products split or not)
    layers, dim = fused.layers, fused.layers[0].qkv.weight.shape[1]
    x = mx.random.normal((rows, dim), key=mx.random.key(0))
    width = decode_attention.span(
        max(engine.cursor(r) for r in ids) + 1, engine.row_table.store.capacity
    )
    first = layers[0]
    queries = mx.random.normal((rows, first.heads, 1, first.head_dim), key=mx.random.key(1))
    keys = mx.random.normal((rows, first.kv_heads, width, first.head_dim), key=mx.random.key(2))
    mask = decode_attention.mask(mx.array([width - 1] * rows, dtype=mx.int32), 1, width)

    def products():  # chained as in the step: each product waits for the one before
        k, h = context, x  # the engine's kernel set's products
        for layer in layers:
            qkv = k.product(layer.qkv, h)
            o = k.product(layer.o, qkv[:, : layer.heads * layer.head_dim])
            gate, up = k.pair(layer.gate_up, o)
            h = k.product(layer.down, gate * up)
        return k.head(fused.lm_head, h)

    def attention():
        return [decode_attention.attend(queries, keys, keys, mask, layer.scale) for layer in layers]

    ops = getattr(fused.k, "ops", None)  # the linux_cpu set's native decode ops
    if ops is not None:  # the step attends with the decode ops: time their `attend`
        width = (first.heads + 2 * first.kv_heads) * first.head_dim
        qkv = mx.random.normal((rows, width), key=mx.random.key(3))
        row_ids = mx.array(ids, dtype=mx.int32)
        pos = mx.array([engine.cursor(r) for r in ids], dtype=mx.int32)
        store, rot = engine.row_table.store, fused.rotation
        geometry = (row_ids, pos, rot.cos2, rot.sin2, first.heads, first.kv_heads)

        def attention():
            return [
                ops.attend(qkv, k, v, *geometry, first.head_dim, 1, first.scale)
                for k, v in zip(store.keys, store.values, strict=True)
            ]

    def norms():
        out = [fused.model.model.norm(x)]
        for layer in layers:
            out += [layer.norm_in(x), layer.norm_post(x)]
        return out

    parts = {"products": mx.compile(products), "attention": mx.compile(attention)}
    parts["norms"] = mx.compile(norms)
    times: dict[str, list[float]] = {k: [] for k in [*parts, "whole step"]}
    tokens = [5] * rows
    with context:
        for fn in parts.values():
            mx.eval(fn())  # trace
    for _ in range(reps):
        with context:
            for name, fn in parts.items():
                times[name] += _timed(fn, 1)
        start = time.perf_counter()
        tokens = engine.decode(ids, tokens).argmax(-1).tolist()
        times["whole step"].append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    p = probe_parser("step_parts", __doc__)
    p.add_argument("--rows", default="1", help="comma-separated row counts (default 1)")
    p.add_argument("--reps", type=int, default=30, help="measured replays per part")
    p.add_argument("--prompt", type=int, default=150, help="prompt tokens of row 0")
    args = p.parse_args(argv)
    from llm_server.model_source import resolve_model

    model = str(resolve_model(args.model))
    print("| rows | part | ms (median) | ms (best) |")
    print("|---:|---|---:|---:|")
    for rows in [int(r) for r in args.rows.split(",")]:
        times = measure(model, rows, args.prompt, args.reps)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, ts in times.items():
            print(f"| {rows} | {name} | {med[name]:.2f} | {min(ts):.2f} |")
        rest = med["whole step"] - sum(v for k, v in med.items() if k != "whole step")
        print(f"| {rows} | rest (whole step - parts, medians) | {rest:.2f} | |", flush=True)


if __name__ == "__main__":
    main()
