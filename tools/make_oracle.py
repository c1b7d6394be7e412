"""Write data/oracle/tiny_mla_oracle.json: the tiny MLA model's f32 forward by an independent
implementation, transformers' MLA model class (DeepseekV3ForCausalLM, eager attention, interleaved
RoPE), loaded with kvquant's seeded numpy weights.

Needs torch and transformers >= 5.11 (not dependencies of kvquant; this tool is not run in CI):

    pip install torch==2.13.0 "transformers>=5.11"
    python tools/make_oracle.py [--check-glm]

The fixture holds the engine protocol's prompt, the reference greedy continuation (20 tokens,
``generate`` with its cache), the argmax of one full-sequence forward over the 32 tokens
(teacher forcing), the logits of that forward (32 x 256) and the logits of each generation step,
plus the versions that made it and a checksum of the weights it was given.
``--check-glm`` also runs the same weights through GlmMoeDsaForCausalLM (the engine oracle's own
class; its DSA indexer keeps every token at this length) and records the largest difference.
"""
import argparse
import json
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvquant.models.tiny_mla import (ORACLE_NEW_TOKENS, ORACLE_PROMPT, TinyMLA,  # noqa: E402
                                     TinyMLAConfig, weight_shapes)

DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "data", "oracle", "tiny_mla_oracle.json")


def common_config_kwargs(cfg):
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
        first_k_dense_replace=cfg.n_layers, hidden_act="silu",
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def build_deepseek(cfg):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    hf_cfg = DeepseekV3Config(**common_config_kwargs(cfg), rope_interleave=True,
                              n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
    hf_cfg._attn_implementation = "eager"
    return DeepseekV3ForCausalLM(hf_cfg)


def build_glm(cfg):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    hf_cfg = GlmMoeDsaConfig(**common_config_kwargs(cfg), n_routed_experts=8,
                             num_experts_per_tok=2, n_group=1, topk_group=1, index_topk=4096,
                             index_head_dim=16, index_n_heads=2)
    hf_cfg._attn_implementation = "eager"
    return GlmMoeDsaForCausalLM(hf_cfg)


def load_weights(model, weights, extra_ok=()):
    """Copy our weights in; every one must land, and every model parameter must be ours except
    those named in ``extra_ok`` (the GLM indexer, a no-op at this length)."""
    import torch
    state = model.state_dict()
    missing = [k for k in weights if k not in state]
    if missing:
        raise SystemExit(f"weights without a place in {type(model).__name__}: {missing[:5]}")
    for k, v in weights.items():
        if tuple(state[k].shape) != v.shape:
            raise SystemExit(f"{k}: shape {tuple(state[k].shape)} in transformers, {v.shape} ours")
    untouched = [k for k in state if k not in weights and not any(e in k for e in extra_ok)]
    if untouched:
        raise SystemExit(f"parameters of {type(model).__name__} that our model lacks: {untouched}")
    with torch.no_grad():
        for k, v in weights.items():
            state[k].copy_(torch.from_numpy(v))
    model.eval()
    return model


def run_reference(model, prompt, n_new):
    import torch
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=n_new, do_sample=False, use_cache=True,
                             output_logits=True, return_dict_in_generate=True,
                             min_new_tokens=n_new, pad_token_id=0)
        full = gen.sequences[0].tolist()
        step_logits = torch.stack([lg[0] for lg in gen.logits]).float().numpy()
        tf_logits = model(torch.tensor([full], dtype=torch.long)).logits[0].float().numpy()
    return full, tf_logits, step_logits


def main(argv=None):
    import torch
    import transformers
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--check-glm", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)

    cfg = TinyMLAConfig()
    ours = TinyMLA(cfg)
    weights = ours.weights
    assert [k for k, _ in weight_shapes(cfg)] == list(weights)

    model = load_weights(build_deepseek(cfg), weights)
    full, tf_logits, step_logits = run_reference(model, ORACLE_PROMPT, ORACLE_NEW_TOKENS)
    out = {
        "what": "tiny-mla f32 forward by transformers DeepseekV3ForCausalLM (eager, interleaved "
                "RoPE) with kvquant's seeded numpy weights",
        "made_by": {
            "tool": "tools/make_oracle.py",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "model_class": type(model).__name__,
        },
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "weights_sha256": ours.checksum,
        "prompt_ids": list(ORACLE_PROMPT),
        "full_ids": full,
        "tf_pred": tf_logits.argmax(axis=1).tolist(),
        "tf_logits": np.round(tf_logits.astype(np.float64), 7).tolist(),
        "gen_logits": np.round(step_logits.astype(np.float64), 7).tolist(),
    }
    if args.check_glm:
        glm = load_weights(build_glm(cfg), weights, extra_ok=("indexer",))
        g_full, g_tf, _ = run_reference(glm, ORACLE_PROMPT, ORACLE_NEW_TOKENS)
        out["glm_moe_dsa_check"] = {
            "model_class": type(glm).__name__,
            "same_full_ids": g_full == full,
            "max_abs_logit_diff": float(np.abs(g_tf - tf_logits).max()),
        }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes): full_ids {full}")
    if "glm_moe_dsa_check" in out:
        print("GlmMoeDsa check:", out["glm_moe_dsa_check"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
