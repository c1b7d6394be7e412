"""kvquant: what a KV-cache codec really costs (bytes, error, speed, next-token flips)."""
from kvquant import _kernels  # noqa: F401  (fails loudly when the compiled kernels are missing)
from kvquant.codecs import (Codec, EncodedRows, available_codecs, get_codec, parse_spec,
                            register_codec, unregister_codec)
from kvquant.specs import CacheSpec, PairSpec, SpecKind, parse_cache_spec, register_spec_kind

__version__ = "0.1.0"
__all__ = ["CacheSpec", "Codec", "EncodedRows", "PairSpec", "SpecKind", "available_codecs",
           "get_codec", "parse_cache_spec", "parse_spec", "register_codec", "register_spec_kind",
           "unregister_codec", "__version__"]
