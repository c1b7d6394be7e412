"""Attention inside a forward: decode steps of a SmolLM2-shaped decoder at 32k cached tokens.

A GGUF file of SmolLM2-135M's shape (30 layers, width 576, 9 query heads sharing 3 KV heads of
64, FFN 1536, vocab 49152, tied embeddings) with RANDOM weights (float16; the speed of a step
does not depend on their values) is written once where ``--file`` says. Its context length is
set to 65536 so that 32k cached tokens are allowed (SmolLM2-135M was trained to 8192). Decode
steps run through kvquant's own forward (:meth:`GGUFDecoder.forward`: RMSNorm, the Q/K/V
projections, RoPE, attention, the output projection and the SwiGLU FFN, every layer, then the
logits), so the BLAS matrix products sit between the attentions as in any model.

Each cache holds ``--tokens`` cached tokens of random Gaussian K/V rows (appended directly, not
by a prefill). Methods, all in the same process and the same forward:

- ``numpy``: numpy f32 attention, the yardstick: float32 rows per layer and KV head, and per KV
  head ``S = X @ Q.T``, softmax, ``W @ X`` (BLAS) for the 3 query heads that share it; run as
  numpy runs unaided (BLAS at its default thread count);
- ``kv8``, ``tq4``, ``q4_0+rot``: the decoder's own :class:`~kvquant.cache.QuantizedKVCache`,
  read by the codecs' consumers with the remedy's threads (``DECODE_ATTENTION_THREADS`` of
  :mod:`kvquant.models.gguf_decoder`; its own decode setting is put aside for the run). The
  step's products are numpy's (BLAS) in every method and remedy but ``pool``, where the codecs'
  steps run them on kvquant's OpenMP threads (``DECODE_PROJECTIONS = "pool"``).

The time spent inside ``cache.attend`` (every layer) is summed per step: the attention time;
the step time is the whole forward. Beside the wall clock, the CPU time of the whole process
(every thread) is summed over the same spans: a thread that spins while another works adds CPU
time and no progress, and on a machine shared with other jobs the CPU time still says what the
step cost (the wall clock then mostly says how long the process waited for a core). Each method
is timed in its own block of steps (warm-up steps first), blocks in rotated rounds, medians
reported.

**Remedies.** OpenBLAS's workers busy-wait after a call (about 2^28 cycles, a tenth of a second)
and libgomp's after a parallel region (GOMP_SPINCOUNT spins): a forward alternates the two, so
each spins on the core the other needs. A remedy is one way to share the 2 cores; each runs in a
process of its own (the environment knobs are read when the libraries load), see REMEDIES.

    python -m kvquant_experiments.bench.forward_attention --file /tmp/smollm2-shape.gguf \
        --out /tmp/fwd
    python -m kvquant_experiments.bench.forward_attention --file F --remedies cache1,cache2+blas1 \
        --tokens 8k --steps 3
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from kvquant_experiments.bench.timing import blas_limited, rotated

# SmolLM2-135M's shape (its GGUF's metadata), context raised to allow 32k cached tokens.
SMOLLM2_SHAPE = dict(n_layers=30, hidden=576, ffn=1536, n_heads=9, n_kv=3, head_dim=64,
                     vocab=49152, rope_base=100000.0, context=65536)
DEFAULT_CODECS = ("kv8", "tq4", "q4_0+rot")
# name: (environment, attention threads, BLAS threads for the whole step, BLAS threads around
# each attention, the step's products: DECODE_PROJECTIONS); None: left as the libraries start.
REMEDIES = {
    "cache1": ({}, 1, None, None, "blas"),
    "auto": ({}, "auto", None, None, "blas"),
    "pool": ({}, "auto", None, None, "pool"),
    "cache2": ({}, 2, None, None, "blas"),
    "cache2+blas1-attend": ({}, 2, None, 1, "blas"),
    "cache2+blas1": ({}, 2, 1, None, "blas"),
    "cache2+openblas-timeout": ({"OPENBLAS_THREAD_TIMEOUT": "4"}, 2, None, None, "blas"),
    "cache2+omp-passive": ({"OMP_WAIT_POLICY": "passive"}, 2, None, None, "blas"),
    "cache2+both-passive": ({"OPENBLAS_THREAD_TIMEOUT": "4", "OMP_WAIT_POLICY": "passive"}, 2,
                            None, None, "blas"),
}
REMEDY_NOTES = {
    "cache1": "attention on 1 thread (the decoders' decode steps below LONG_CONTEXT_RATIO)",
    "auto": "DECODE_ATTENTION_THREADS = \"auto\" with numpy's products: cache1's setting or "
            "cache2+blas1's from the step's long-context ratio",
    "pool": "the decoders' default on 2 cores: the step's products on kvquant's OpenMP threads "
            "(DECODE_PROJECTIONS = \"pool\"), attention and projections on the threads OpenMP "
            "allows",
    "cache2": "attention on 2 threads, nothing else",
    "cache2+blas1-attend": "2 threads; BLAS held to 1 thread around each attention "
                           "(threadpoolctl)",
    "cache2+blas1": "2 threads; BLAS held to 1 thread for the whole step (the decode "
                    "projections are matrix-vector products; the decoders' decode steps with "
                    "DECODE_ATTENTION_THREADS = 2, DECODE_BLAS_THREADS = 1, and with \"auto\" "
                    "past LONG_CONTEXT_RATIO)",
    "cache2+openblas-timeout": "2 threads; OPENBLAS_THREAD_TIMEOUT=4 (OpenBLAS's workers sleep "
                               "after 2^4 cycles instead of 2^28)",
    "cache2+omp-passive": "2 threads; OMP_WAIT_POLICY=passive (libgomp's workers sleep at once)",
    "cache2+both-passive": "2 threads; both of the above",
}


def write_shape_gguf(path, shape=SMOLLM2_SHAPE, seed=0, weight_type=None):
    """A llama-architecture GGUF of the given shape with random weights: float16 matrices, or
    ``weight_type`` (a ``gguf.GGMLQuantizationType`` name such as ``"Q8_0"``) through
    ``gguf.quants.quantize``; norms in float32."""
    import gguf
    s = shape
    rng = np.random.default_rng(seed)
    qtype = None if weight_type is None else gguf.GGMLQuantizationType[weight_type]
    D, F, H, G, hd, V = s["hidden"], s["ffn"], s["n_heads"], s["n_kv"], s["head_dim"], s["vocab"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(s["n_layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(V)

    def add(name, shape_, scale):
        arr = rng.standard_normal(shape_, dtype=np.float32) * np.float32(scale)
        if len(shape_) == 1:
            w.add_tensor(name, arr + np.float32(1.0))
        elif qtype is None:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    add("token_embd.weight", (V, D), 0.02)
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (D,), 0.05)
        add(p + "ffn_norm.weight", (D,), 0.05)
        for name, shape_ in [("attn_q", (H * hd, D)), ("attn_k", (G * hd, D)),
                             ("attn_v", (G * hd, D)), ("attn_output", (D, H * hd)),
                             ("ffn_gate", (F, D)), ("ffn_up", (F, D)), ("ffn_down", (D, F))]:
            add(p + name + ".weight", shape_, 1.0 / np.sqrt(shape_[1]))
    add("output_norm.weight", (D,), 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class NumpyAttentionCache:
    """float32 K/V rows per layer and KV head; :meth:`attend` is plain numpy (the yardstick).

    Serves the decoder's decode step (``append``, ``attend``, ``len``), nothing more.
    """

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity):
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.K, self.V = np.empty(shape, np.float32), np.empty(shape, np.float32)
        self._lengths = [0] * n_layers

    def append(self, layer, n_threads=None, k=None, v=None):
        """k, v : (n_new, n_kv_heads, head_dim)."""
        T, n = self._lengths[layer], k.shape[0]
        if T + n > self.K.shape[2]:
            raise ValueError(f"the cache holds {self.K.shape[2]} tokens; {T + n} asked")
        self.K[layer, :, T:T + n] = np.swapaxes(k, 0, 1)
        self.V[layer, :, T:T + n] = np.swapaxes(v, 0, 1)
        self._lengths[layer] = T + n

    def attend(self, layer, q, scale=None, n_threads=None):
        """q : (n_heads, head_dim) -> (n_heads, head_dim): numpy's X @ Q.T, softmax, W @ X."""
        from kvquant.reference import softmax
        T, G = self._lengths[layer], self.K.shape[1]
        group = q.shape[0] // G
        out = np.empty_like(q)
        for h in range(G):
            S = self.K[layer, h, :T] @ q[h * group:(h + 1) * group].T     # (T, group)
            S *= np.float32(scale)
            out[h * group:(h + 1) * group] = softmax(S.T) @ self.V[layer, h, :T]
        return out

    def length(self, layer):
        return self._lengths[layer]

    def __len__(self):
        return self._lengths[-1]


class TimedAttention:
    """A cache whose ``attend`` (and ``append``) time is summed; the rest goes to the cache.

    ``blas_threads``: BLAS held to that many threads around each attention (None: untouched).
    """

    def __init__(self, cache, blas_threads=None):
        self.cache, self.blas_threads = cache, blas_threads
        self.attend_s = self.append_s = self.attend_cpu_s = 0.0
        self._controller = None
        if blas_threads is not None:
            from threadpoolctl import ThreadpoolController
            self._controller = ThreadpoolController()

    def append(self, layer, n_threads=None, **rows):
        t0 = time.perf_counter()
        self.cache.append(layer, n_threads=n_threads, **rows)
        self.append_s += time.perf_counter() - t0

    def attend(self, layer, q, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        if self._controller is None:
            out = self.cache.attend(layer, q, **kwargs)
        else:
            with blas_limited(self.blas_threads, self._controller):
                out = self.cache.attend(layer, q, **kwargs)
        self.attend_s += time.perf_counter() - t0
        # CPU time of every thread of the process: threads spinning while others work add to it
        self.attend_cpu_s += time.process_time() - c0
        return out

    def __len__(self):
        return len(self.cache)

    def __getattr__(self, name):
        return getattr(self.cache, name)


def fill(caches, n_layers, n_kv, head_dim, tokens, seed=0):
    """Append ``tokens`` random Gaussian K/V rows to every cache, layer by layer (the same rows
    in each)."""
    rng = np.random.default_rng(seed)
    for li in range(n_layers):
        k = rng.standard_normal((tokens, n_kv, head_dim), dtype=np.float32)
        v = rng.standard_normal((tokens, n_kv, head_dim), dtype=np.float32)
        for cache in caches:
            cache.append(li, k=k, v=v)


def run_remedy(path, remedy, codecs=DEFAULT_CODECS, tokens=32768, steps=5, warmup=2, rounds=3,
               seed=0):
    """One remedy, in this process (its environment set before the process started): the
    median step and attention times of numpy f32 and of each codec.

    Returns
    -------
    dict
        ``{"remedy", "methods": {name: {"step_ms", "attention_ms", "append_ms", "step_cpu_ms",
        "attention_cpu_ms", "attention_speedup", "step_speedup"}}, ...}`` (medians; the
        speedups against numpy's).
    """
    from threadpoolctl import ThreadpoolController, threadpool_info
    from kvquant.models import gguf_decoder
    env, cache_threads, blas_step, blas_attend, projections = REMEDIES[remedy]
    for key, value in env.items():
        if os.environ.get(key) != value:
            raise RuntimeError(f"remedy {remedy!r} needs {key}={value} in the environment of the "
                               "process (run it through main(), which starts one per remedy)")
    model = gguf_decoder.GGUFDecoder(path)
    cfg = model.config
    capacity = tokens + rounds * (warmup + steps) + 1
    raw = {"numpy": NumpyAttentionCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity)}
    for spec in codecs:
        raw[spec] = model.new_cache(spec)
        raw[spec].reserve(capacity)
    fill(raw.values(), cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, tokens, seed)
    timed = {name: TimedAttention(c, None if name == "numpy" else blas_attend)
             for name, c in raw.items()}
    controller = ThreadpoolController()
    rng = np.random.default_rng(seed + 1)
    keys = ("step_ms", "attention_ms", "append_ms", "step_cpu_ms", "attention_cpu_ms")
    samples = {name: {key: [] for key in keys} for name in timed}
    names = list(timed)

    def one_step(cache):
        cache.attend_s = cache.append_s = cache.attend_cpu_s = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        model.forward(rng.integers(0, model.vocab_size, 1), cache, last_only=True)
        return (time.perf_counter() - t0, cache.attend_s, cache.append_s,
                time.process_time() - c0, cache.attend_cpu_s)

    # the remedy alone sets the threads: the decoders' own decode setting is put aside meanwhile
    settings = ("DECODE_ATTENTION_THREADS", "DECODE_BLAS_THREADS", "DECODE_PROJECTIONS")
    previous = {key: getattr(gguf_decoder, key) for key in settings}
    gguf_decoder.DECODE_BLAS_THREADS = None
    try:
        for r in range(rounds):
            for name in rotated(names, r):
                codec = name != "numpy"
                gguf_decoder.DECODE_ATTENTION_THREADS = cache_threads if codec else 1
                # numpy f32 attention keeps numpy's products: the yardstick is plain numpy
                gguf_decoder.DECODE_PROJECTIONS = projections if codec else "blas"
                # each step times several spans (step, attention, appends, CPU times), so the
                # block is its own loop rather than timing.block_times
                with blas_limited(blas_step if codec else None, controller):
                    for i in range(warmup + steps):
                        measured = one_step(timed[name])
                        if i >= warmup:
                            for key, seconds in zip(keys, measured):
                                samples[name][key].append(1e3 * seconds)
    finally:
        for key, value in previous.items():
            setattr(gguf_decoder, key, value)
    methods = {name: {key: float(np.median(v)) for key, v in s.items()} for name, s in
               samples.items()}
    for name, m in methods.items():
        m["attention_speedup"] = methods["numpy"]["attention_ms"] / m["attention_ms"]
        m["step_speedup"] = methods["numpy"]["step_ms"] / m["step_ms"]
    blas = [f"{lib['internal_api']} {lib.get('version')} ({lib.get('threading_layer')})"
            for lib in threadpool_info() if lib.get("user_api") == "blas"]
    shape = {"n_layers": cfg.n_layers, "hidden": cfg.hidden_size, "ffn": cfg.intermediate_size,
             "n_heads": cfg.n_heads, "n_kv": cfg.n_kv_heads, "head_dim": cfg.head_dim,
             "vocab": cfg.vocab_size}
    return {"remedy": remedy, "note": REMEDY_NOTES[remedy], "environment": env,
            "file": os.path.basename(path), "shape": shape,
            "cache_threads": cache_threads, "blas_step_threads": blas_step,
            "blas_attend_threads": blas_attend, "projections": projections, "tokens": tokens,
            "steps": steps,
            "warmup": warmup, "rounds": rounds, "codecs": list(codecs), "methods": methods,
            "blas": blas, "load_average": list(os.getloadavg())}


def run_remedies(path, remedies, codecs=DEFAULT_CODECS, tokens=32768, steps=5, warmup=2,
                 rounds=3, seed=0, progress=None):
    """Each remedy in a fresh process with its environment; returns their results in order."""
    results = []
    for remedy in remedies:
        env = {**os.environ, **REMEDIES[remedy][0]}
        cmd = [sys.executable, "-m", "kvquant_experiments.bench.forward_attention", "--worker",
               "--file", path, "--remedies", remedy, "--codecs", ",".join(codecs),
               "--tokens", str(tokens), "--steps", str(steps), "--warmup", str(warmup),
               "--rounds", str(rounds), "--seed", str(seed)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"remedy {remedy!r} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if progress:
            progress(results[-1])
    return results


def format_markdown(results):
    r0 = results[0]
    codecs, shape = r0["codecs"], r0["shape"]
    lines = [
        f"Decode steps of a decoder of {shape['n_layers']} layers, width "
        f"{shape['hidden']}, {shape['n_heads']} query heads on {shape['n_kv']} KV heads of "
        f"{shape['head_dim']}, FFN {shape['ffn']}, vocab {shape['vocab']}; weights "
        f"of {r0['file']}, random when this benchmark wrote it) at {r0['tokens']} cached "
        "tokens, through kvquant's GGUF forward; medians of "
        f"{r0['rounds']} rounds x {r0['steps']} steps per method (after {r0['warmup']} warm-up "
        "steps each). Attention = time inside cache.attend, all layers; speedup = numpy f32 "
        "attention / codec attention in the same process and forward. BLAS: "
        + "; ".join(r0["blas"]) + ".",
        "",
        "| remedy | what | numpy attention ms | numpy step ms | "
        + " | ".join(f"{c} attention ms | {c} speedup" for c in codecs)
        + " | step ms (" + ", ".join(codecs) + ") | attention CPU ms (numpy, "
        + ", ".join(codecs) + ") | load average |",
        "|---|---|---:|---:|" + "---:|---:|" * len(codecs) + "---|---|---|",
    ]
    for r in results:
        m = r["methods"]
        lines.append(
            f"| {r['remedy']} | {r['note']} | {m['numpy']['attention_ms']:.1f} | "
            f"{m['numpy']['step_ms']:.1f} | "
            + " | ".join(f"{m[c]['attention_ms']:.1f} | **{m[c]['attention_speedup']:.2f}x**"
                         for c in codecs)
            + " | " + ", ".join(f"{m[c]['step_ms']:.1f}" for c in codecs)
            + " | " + ", ".join(f"{m[c]['attention_cpu_ms']:.1f}" for c in ["numpy"] + codecs)
            + f" | {', '.join(f'{x:.1f}' for x in r['load_average'])} |")
    return "\n".join(lines)


def write_results(results, out_dir, stem):
    """Markdown, CSV and JSON named by the run's parameters; returns their paths."""
    import csv
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(format_markdown(results) + "\n")
    rows = [{"remedy": r["remedy"], "method": name, **m}
            for r in results for name, m in r["methods"].items()]
    with open(base + ".csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump({"results": results}, f, indent=1)
    return [base + ext for ext in (".md", ".csv", ".json")]


def result_stem(tokens, remedies, steps, rounds):
    names = "-".join(r.replace("+", "_") for r in remedies)
    return f"bench_forward_T{tokens}_{names}_s{steps}x{rounds}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", required=True,
                   help="the random-weight GGUF (written when missing; ~270 MB, keep it out of "
                        "the repository)")
    p.add_argument("--remedies", default=",".join(REMEDIES),
                   help=f"comma-separated, of {', '.join(REMEDIES)}")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS))
    p.add_argument("--tokens", default="32768", help="cached tokens, e.g. 32k")
    p.add_argument("--steps", type=int, default=5, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default: a folder named for the "
                                               "run, under the current directory)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from kvquant.budget import parse_tokens
    from kvquant.specs import split_spec_text
    remedies = [r.strip() for r in args.remedies.split(",") if r.strip()]
    unknown = [r for r in remedies if r not in REMEDIES]
    if unknown or not remedies:
        p.error(f"unknown remedy {unknown}: choose from {', '.join(REMEDIES)}")
    codecs = split_spec_text(args.codecs)   # options stay with their spec
    tokens = parse_tokens(args.tokens)
    if args.worker:
        print(json.dumps(run_remedy(args.file, remedies[0], codecs, tokens, args.steps,
                                    args.warmup, args.rounds, args.seed)))
        return 0
    if not os.path.exists(args.file):
        t0 = time.perf_counter()
        write_shape_gguf(args.file)
        print(f"wrote {args.file} ({os.path.getsize(args.file) / 1e6:.0f} MB) in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)

    def progress(r):
        m = r["methods"]
        print(f"  {r['remedy']}: numpy attention {m['numpy']['attention_ms']:.1f} ms; "
              + ", ".join(f"{c} {m[c]['attention_ms']:.1f} ms ({m[c]['attention_speedup']:.2f}x)"
                          for c in codecs), file=sys.stderr, flush=True)

    results = run_remedies(args.file, remedies, codecs, tokens, args.steps, args.warmup,
                           args.rounds, args.seed, progress)
    stem = result_stem(tokens, remedies, args.steps, args.rounds)
    paths = write_results(results, args.out or stem, stem)
    print(format_markdown(results))
    print("\nwrote " + ", ".join(paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
