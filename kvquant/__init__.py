"""kvquant: what a KV-cache codec really costs (bytes, error, speed, next-token flips)."""
from kvquant import _kernels  # noqa: F401  (fails loudly when the compiled kernels are missing)
from kvquant.codecs import (Codec, EncodedRows, available_codecs, get_codec, parse_spec,
                            register_codec, unregister_codec)

__version__ = "0.1.0"
__all__ = ["Codec", "EncodedRows", "available_codecs", "get_codec", "parse_spec",
           "register_codec", "unregister_codec", "__version__"]
