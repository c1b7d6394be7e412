"""kvquant_experiments: sweeps, tables, figures and the report, built on the kvquant library.

Installed as the package ``kvquant_experiments`` (the folder ``experiments/`` of the source tree,
mapped in setup.cfg). The library never imports it; ``kvquant report`` imports it lazily.

Every sweep has the same shape (faiss ``benchs/`` style): a grid of *cells*, each a small dict of
parameters; a pure cell function of those parameters (inputs seeded from the parameters, never
from a global generator) that returns a dict of numbers; a runner that maps the cells over an
executor (local processes or a Dask cluster, :mod:`kvquant_experiments.executor`) and writes one
result file per cell, named by its parameters, skipping cells whose file exists (resume); and
plotting code that only reads those files (:mod:`kvquant_experiments.plots`).

Modules
-------
study           the studies' one command line (``python -m kvquant_experiments.<study>``):
                options, --out checked first, one-line errors, Ctrl-C
common          environment record, seeds from parameters, file names, codec availability
executor        local process pool or Dask executor; the resumable cell runner
inputs          rows to quantize: Gaussian, heavy-tailed with outlier channels, real K/V rows
distortion      codecs x bits x d x input kind: relative L2 against bits per value
inner_products  bias (slope) and error of q . k^ per codec
texts           named texts that ship with Python, UTF-8 files (``--text``)
models          a run's model: its name in file names, loaded once per worker process
flip_runs       whole flip tables over the executor (protocol tasks, text chunks, resume)
flip_storage    every byte in a flip table's sizes (bits per value, compression)
flip_tables     a flip table as markdown, llama.cpp's statistics under its names
flip_files      a flip table's JSON, CSV and by-position files
flip_command    ``kvquant flips``
kv_rows         ``kvquant dump-kv``: a model's cache rows on a text, and their reader
flip_report     the report's flip tables (flip_runs), Pareto chart data, per-position strip
frontier        quality per byte of codec pairs on a model and a text
probes          ideas measured with simulated codecs (fp8 formats, QJL, outliers, window)
bench           speed: ``kvquant bench`` and every other speed measurement, one module per
                question (its docstring lists them); bench.report_cells: the report's encode
                throughput and decode-step cells, one per (d, T)
memory          bytes per token and context per RAM budget (kvquant.budget)
cache_files     cache files of each tier written, reopened, refused (kvquant.kvfile)
plots           every figure, from result files only
stream_fixtures the recipes of the committed stream fixtures (data/streams/), shared by the test
                that rewrites them and tools/make_stream_fixtures.py
report          ``kvquant report``: runs the parts, writes REPORT.md + figures + data
report_sections each part's section of REPORT.md, from its results or the committed files

Set ``KVQUANT_SMOKE=1`` to shrink every default grid (CI runs the notebooks that way) and
``KVQUANT_RESULTS`` to choose where notebooks write (default ``results/``).
"""
__all__ = ["__version__"]

__version__ = "0.1.0"
