"""``tiny-mla``: a numpy MLA decoder shaped like the engine's oracle glm_tiny (docs/reference.md §1.8).

Vocab 256, hidden 128, 5 layers, 4 heads, q_lora 64, kv_lora 32, qk_nope 24, qk_rope 8, v_head 32,
rope theta 1e4, RMSNorm, interleaved RoPE, dense SiLU MLPs (intermediate 64) in every layer.

Weights are drawn from ``numpy.random.default_rng(seed)``, N(0, 0.05) for every matrix (norm
weights 1), in the fixed order of :func:`weight_shapes`. The engine's oracle draws its weights from
torch's generator and cannot be reproduced without torch: this model is of the same shape and
measures the same kind of perturbation, not the engine's exact numbers.

Per layer the cache holds two streams of rows: the normalized latent L (kv_lora wide) and the
roped key part R (qk_rope wide, in the engine's de-interleaved "halves" layout). They are encoded
as they are appended, before attention reads them, in prefill too. Attention is the absorbed form
for every query (prefill included, with a causal mask):

    score_t = scale * (q_abs . L_t + q_rope . R_t),   q_abs = W_kb[h]^T q_nope
    ctx_h   = W_vb[h] (sum_t w_t L_t)

where W_kb[h] / W_vb[h] are the key / value blocks of head h in kv_b. The dot products with L and R
and the weighted sum over L are the codecs' compressed-domain consumers (``codec.scores`` /
``codec.context`` through :class:`~kvquant.cache.QuantizedKVCache`), in prefill and decode alike.

The layout of the weights is that of transformers' MLA classes (DeepseekV3 / GlmMoeDsa), so that
``tools/make_oracle.py`` can load them there unchanged; like those classes, the q_a and kv_a
layernorms use eps 1e-6 (their default) and the block norms ``rms_norm_eps`` (1e-5).
"""
import hashlib
from dataclasses import asdict, dataclass

import numpy as np

from kvquant.cache import QuantizedKVCache
from kvquant.models import causal_mask, masked_softmax, rms_norm, silu
from kvquant.specs import PairSpec, parse_cache_spec

__all__ = ["ORACLE_PROMPT", "ORACLE_NEW_TOKENS", "TinyMLA", "TinyMLAConfig", "new_mla_cache",
           "weight_shapes"]

ORACLE_PROMPT = (3, 14, 159, 26, 53, 58, 200, 11, 77, 240, 5, 99)
ORACLE_NEW_TOKENS = 20


@dataclass(frozen=True)
class TinyMLAConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    n_layers: int = 5
    n_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 24
    qk_rope_head_dim: int = 8
    v_head_dim: int = 32
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    latent_norm_eps: float = 1e-6
    init_std: float = 0.05
    seed: int = 1234

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attn_scale(self):
        return float(self.qk_head_dim) ** -0.5


def weight_shapes(cfg):
    """Names (transformers' DeepseekV3ForCausalLM state-dict names) and shapes (out, in), in the
    order the weights are drawn."""
    H, D = cfg.n_heads, cfg.hidden_size
    shapes = [("model.embed_tokens.weight", (cfg.vocab_size, D))]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_a_proj.weight", (cfg.q_lora_rank, D)),
            (p + "self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,)),
            (p + "self_attn.q_b_proj.weight", (H * cfg.qk_head_dim, cfg.q_lora_rank)),
            (p + "self_attn.kv_a_proj_with_mqa.weight",
             (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)),
            (p + "self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
            (p + "self_attn.kv_b_proj.weight",
             (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
            (p + "self_attn.o_proj.weight", (D, H * cfg.v_head_dim)),
            (p + "mlp.gate_proj.weight", (cfg.intermediate_size, D)),
            (p + "mlp.up_proj.weight", (cfg.intermediate_size, D)),
            (p + "mlp.down_proj.weight", (D, cfg.intermediate_size)),
            (p + "input_layernorm.weight", (D,)),
            (p + "post_attention_layernorm.weight", (D,)),
        ]
    shapes += [("model.norm.weight", (D,)), ("lm_head.weight", (cfg.vocab_size, D))]
    return shapes


def make_weights(cfg):
    """Seeded weights: N(0, init_std) float32 for matrices, ones for norm weights."""
    rng = np.random.default_rng(cfg.seed)
    weights = {}
    for name, shape in weight_shapes(cfg):
        if len(shape) == 1:
            weights[name] = np.ones(shape, np.float32)
        else:
            weights[name] = rng.normal(0.0, cfg.init_std, size=shape).astype(np.float32)
    return weights


def weights_checksum(weights):
    """SHA-256 over the weights in name order (detects a change of the generator's stream)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name], dtype="<f4").tobytes())
    return h.hexdigest()


def rope_interleaved(X, positions, theta):
    """Interleaved RoPE: pairs (x[2j], x[2j+1]) rotate by pos * theta^(-2j/d); the output is in
    the de-interleaved "halves" layout [a cos - b sin | b cos + a sin] (engine and transformers).

    X : (n, ..., d) float32, positions : (n,) int. Returns float32 of the same shape.
    """
    d = X.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    shape = (X.shape[0],) + (1,) * (X.ndim - 2) + (d // 2,)
    cos = np.cos(ang).astype(np.float32).reshape(shape)
    sin = np.sin(ang).astype(np.float32).reshape(shape)
    a, b = X[..., 0::2], X[..., 1::2]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def new_mla_cache(cfg, pair_spec="f32"):
    """A :class:`~kvquant.cache.QuantizedKVCache` with streams ``L`` (kv_lora) and ``R`` (qk_rope).

    ``pair_spec`` is ``"tq4"`` for both streams or ``"kv8/tq4"`` for L / R (a pair spec,
    :class:`~kvquant.specs.PairSpec`, or its string). As in the engine's KV8 mode, a lone grouped
    ``kv8-g<N>`` (or ``kv8:group=N``) applies to L while R keeps one scale per row (``kv8``, the
    spec's other options kept: :meth:`~kvquant.streams.spec.StreamSpec.with_row_scales`).
    """
    spec = parse_cache_spec(pair_spec)
    if not isinstance(spec, PairSpec):
        raise ValueError(f"{spec.text!r}: the MLA model's cache takes a pair spec (L/R stream "
                         f"specs), not a {spec.kind} spec")
    dims = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    l_spec, r_spec = spec.streams
    if l_spec == r_spec:
        r_spec = l_spec.with_row_scales()   # the engine's R keeps a row scale
    l_spec, r_spec = PairSpec(l_spec, r_spec).checked(dims, ("L (latent)", "R (rope)"))
    streams = {"L": (l_spec, dims[0]), "R": (r_spec, dims[1])}
    return QuantizedKVCache(cfg.n_layers, streams, capacity=64)


class TinyMLA:
    """The tiny MLA decoder.

    Parameters
    ----------
    config : TinyMLAConfig, optional
    weights : dict of name -> ndarray, optional
        Defaults to :func:`make_weights` of the config.
    """

    name = "tiny-mla"

    def __init__(self, config=None, weights=None):
        self.config = cfg = config or TinyMLAConfig()
        self.weights = weights if weights is not None else make_weights(cfg)
        w = self.weights
        H = cfg.n_heads
        nope, vh, kvl = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.vocab_size = cfg.vocab_size
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head_t = np.ascontiguousarray(w["lm_head.weight"].T)
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            kv_b = w[p + "self_attn.kv_b_proj.weight"].reshape(H, nope + vh, kvl)
            self.layers.append({
                "input_norm": w[p + "input_layernorm.weight"],
                "q_a_t": np.ascontiguousarray(w[p + "self_attn.q_a_proj.weight"].T),
                "q_a_norm": w[p + "self_attn.q_a_layernorm.weight"],
                "q_b_t": np.ascontiguousarray(w[p + "self_attn.q_b_proj.weight"].T),
                "kv_a_t": np.ascontiguousarray(w[p + "self_attn.kv_a_proj_with_mqa.weight"].T),
                "kv_a_norm": w[p + "self_attn.kv_a_layernorm.weight"],
                "w_kb": np.ascontiguousarray(kv_b[:, :nope, :]),   # (H, nope, kv_lora)
                "w_vb": np.ascontiguousarray(kv_b[:, nope:, :]),   # (H, v_head, kv_lora)
                "o_t": np.ascontiguousarray(w[p + "self_attn.o_proj.weight"].T),
                "post_norm": w[p + "post_attention_layernorm.weight"],
                "gate_t": np.ascontiguousarray(w[p + "mlp.gate_proj.weight"].T),
                "up_t": np.ascontiguousarray(w[p + "mlp.up_proj.weight"].T),
                "down_t": np.ascontiguousarray(w[p + "mlp.down_proj.weight"].T),
            })

    @property
    def checksum(self):
        return weights_checksum(self.weights)

    attention = "codec consumers (decode and prefill)"

    def describe(self):
        return {"model": self.name, **asdict(self.config), "weights_sha256": self.checksum,
                "attention": self.attention}

    def new_cache(self, pair_spec="f32"):
        return new_mla_cache(self.config, pair_spec)

    # The context that tools/make_oracle.py declares to transformers (max_position_embeddings);
    # longer chunks are refused.
    context_length = 4096
    bos_token_id = None      # the oracle's prompts start with no BOS token

    @property
    def n_layers(self):
        return self.config.n_layers

    n_kv_heads = 1

    @property
    def head_dim(self):
        """Width of the cached latent rows (the R rows are ``qk_rope_head_dim`` wide)."""
        return self.config.kv_lora_rank

    def forward(self, tokens, cache, last_only=False):
        """Run tokens after those already in ``cache``: :meth:`logits` of :meth:`forward_hidden`,
        float32 (n_tokens, vocab), or (1, vocab) with ``last_only``."""
        hidden = self.forward_hidden(tokens, cache)
        return self.logits(hidden[-1:] if last_only else hidden)

    def logits(self, hidden_rows):
        """Logits (m, vocab) float32 of final hidden states (m, hidden) from
        :meth:`forward_hidden`."""
        X = np.asarray(hidden_rows, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.config.hidden_size:
            raise ValueError(f"hidden rows must have shape (m, {self.config.hidden_size}), got "
                             f"{X.shape}")
        return X @ self.lm_head_t

    def forward_hidden(self, tokens, cache):
        """Run tokens after those already in ``cache``; returns the final hidden states after the
        output norm, float32 (n_tokens, hidden)."""
        cfg = self.config
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in 0..{cfg.vocab_size - 1}")
        if len(cache) + tokens.size > self.context_length:
            raise ValueError(f"{len(cache)} cached + {tokens.size} new tokens exceed the model's "
                             f"context of {self.context_length} tokens; use shorter chunks")
        S, H = tokens.size, cfg.n_heads
        nope, kvl = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        start = len(cache)
        pos = start + np.arange(S)
        # Query rows are (position, head) in that order; row t is hidden when t > position.
        hidden = causal_mask(np.repeat(pos, H), start + S)
        scale = np.float32(cfg.attn_scale)
        x = self.embed[tokens]
        for li, lw in enumerate(self.layers):
            h = rms_norm(x, lw["input_norm"], cfg.rms_norm_eps)
            q = rms_norm(h @ lw["q_a_t"], lw["q_a_norm"], cfg.latent_norm_eps) @ lw["q_b_t"]
            q = q.reshape(S, H, cfg.qk_head_dim)
            q_nope = q[:, :, :nope]
            q_rope = rope_interleaved(q[:, :, nope:], pos, cfg.rope_theta)
            comp = h @ lw["kv_a_t"]
            L = rms_norm(comp[:, :kvl], lw["kv_a_norm"], cfg.latent_norm_eps)
            R = rope_interleaved(comp[:, kvl:], pos, cfg.rope_theta)
            # The rows enter the cache (quantized) before anything reads them.
            cache.append(li, n_threads=1, L=L, R=R)
            # Absorbed attention on the codes: the consumers score L and R, then sum over L.
            q_abs = np.einsum("shd,hdc->shc", q_nope, lw["w_kb"]).reshape(S * H, kvl)
            if S > 1 and cache.recent:
                latent_ctx = self._windowed_prefill(cache, li, q_abs, q_rope, start, scale)
            else:
                scores = cache.scores(li, "L", q_abs, n_threads=1)
                scores += cache.scores(li, "R", q_rope.reshape(S * H, -1), n_threads=1)
                scores *= scale
                weights = masked_softmax(scores, hidden)
                latent_ctx = cache.context(li, "L", weights, n_threads=1).reshape(S, H, kvl)
            ctx = np.einsum("shc,hvc->shv", latent_ctx, lw["w_vb"]).reshape(S, -1)
            x = x + ctx @ lw["o_t"]
            h = rms_norm(x, lw["post_norm"], cfg.rms_norm_eps)
            x = x + (silu(h @ lw["gate_t"]) * (h @ lw["up_t"])) @ lw["down_t"]
        return rms_norm(x, self.final_norm, cfg.rms_norm_eps)

    @staticmethod
    def _windowed_prefill(cache, layer, q_abs, q_rope, start, scale):
        """Latent contexts (S, H, kv_lora) of a prefill whose cache keeps a recent window:
        each position reads its own window (the rows before it, as a decode step would), so
        one consumer call per position."""
        S, H = q_rope.shape[:2]
        q_abs = q_abs.reshape(S, H, -1)
        out = np.empty_like(q_abs)
        for j in range(S):
            n = start + j + 1
            scores = cache.scores(layer, "L", q_abs[j], n_threads=1, length=n)
            scores += cache.scores(layer, "R", q_rope[j], n_threads=1, length=n)
            scores *= scale
            out[j] = cache.context(layer, "L", masked_softmax(scores, np.zeros_like(
                scores, dtype=bool)), n_threads=1)
        return out
