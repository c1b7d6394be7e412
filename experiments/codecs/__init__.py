"""Codecs from the 3-bit literature, built on kvquant's public codec API as any user would.

Each module defines one codec and a ``factory(dim, **options)`` (``simulated.py``: the probes'
simulated fp8 and QJL codecs, one named factory per spec); the package's metadata
registers them in the entry-point group ``kvquant.codecs`` (setup.cfg), so ``get_codec``,
the models' cache specs, ``kvquant flips``/``tasks``, the frontier and every worker process find
them by name. The papers, the bytes each spends and what we measured: docs/field-codecs.md.

=========  ==============================================================================
``ds``     dense-and-sparse: the k largest magnitudes of each row kept exactly (index, fp16),
           the rest through an inner codec (KVQuant, Hooper et al. 2024)
``tokmean`` per-token centring: the row's own mean removed and stored, the rest through an
           inner codec (the per-token half of a variance normalization)
``qjl``    an inner codec plus a 1-bit sign sketch of its residual, unbiased for dot products
           (QJL, Zandieh et al. 2024; TurboQuant_prod)
``vq``     rotated rows, coordinates in pairs, each pair one code of a 2-D k-means codebook
           (vector quantization as in CQ, Zhang et al. 2024)
``chsplit`` a calibrated half of the channels at one bit width, the other half at another
           (TurboQuant's outlier-channel split, Zandieh et al. 2025)
=========  ==============================================================================
"""
