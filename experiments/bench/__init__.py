"""Speed measurements: which module answers which speed question, and its command.

The library (``kvquant``) holds the codecs, caches and kernels; how fast they run is measured
here, outside it (as scikit-learn's ``benchmarks/`` and faiss's ``benchs/``). Every module is a
command (``python -m kvquant_experiments.bench.<module> --help``) except the report's cells and
the shared timing. Each writes or prints the ratios it reports from methods timed in the same
run; nothing here is a reproducible number.

Modules
-------
timing             how a call is timed: warm-up, a block of timed calls, rounds in rotated or
                   mirrored order, BLAS held to a thread count (threadpoolctl), the BLAS record
attention_step     one attention decode step on the compressed cache against numpy f32, each
                   time beside its byte limit (read bandwidth, cold rows, GQA groups):
                   ``kvquant bench``
attention_targets  that step on the fixed grids (single query, GQA) with the verdict on the
                   speed targets: ``python -m kvquant_experiments.bench.attention_targets``
forward_attention  attention inside a decoder's forward (a SmolLM2-shaped GGUF at 32k tokens),
                   under the ways of sharing the cores between BLAS and OpenMP:
                   ``python -m kvquant_experiments.bench.forward_attention --file F``
decode_threads     a GGUF model's decode step under the decoders' thread settings:
                   ``python -m kvquant_experiments.bench.decode_threads --model smollm2``
matvec             the products of one decode step: kvquant's matvec against numpy's BLAS:
                   ``python -m kvquant_experiments.bench.matvec``
softmax            the compiled softmax against numpy's:
                   ``python -m kvquant_experiments.bench.softmax``
gqa_reads          the consumers' reads (scores, context) against numpy's, per SIMD path, warm
                   or cold rows: ``python -m kvquant_experiments.bench.gqa_reads``
codec_throughput   encode and decode rows/s against the numpy references, with a yardstick
                   timed around each codec: ``python -m kvquant_experiments.bench.codec_throughput``
encode_paths       encode rows/s on each vector path of the encoders, by thread CPU time:
                   ``python -m kvquant_experiments.bench.encode_paths``
gguf_prefill       a 1B GGUF model's prefill: seconds and peak memory per 1k tokens:
                   ``python -m kvquant_experiments.bench.gguf_prefill --file F``
hf_decode          decode tokens/s in transformers: KVQuantCache against DynamicCache + sdpa:
                   ``python -m kvquant_experiments.bench.hf_decode`` (the hf extra)
task_scoring       task-scoring items/s against lm-eval's own Hugging Face run:
                   ``python -m kvquant_experiments.bench.task_scoring`` (hf and lmeval extras)
report_cells       the speed section of ``kvquant report`` (encode throughput, decode-step cells
                   with resume); not a command

docs/speed.md gives the results and the commands that made them.
"""
