#!/usr/bin/env python3
"""Make the small golden fixtures for lily's model tests.

Two fixtures, both from a random-initialised Qwen3.5/3.6-MoE of a small geometry (see SMALL_CONFIG):

  tests/fixtures/golden/hf_small/   transformers' own `Qwen3_5MoeForCausalLM.save_pretrained` output (bf16
                                    safetensors + config.json) and the transformers reference logits
                                    (fp32 math on the bf16-rounded weights, eager attention).
  tests/fixtures/golden/mlx_small/  mlx-lm's own `convert` of the same checkpoint (4-bit affine, group 64,
                                    mlx-lm's quant predicate) and mlx-lm's own greedy decode and logits
                                    (fp32 activations on the quantized weights) for the same prompt.

Every number is deterministic (fixed seeds, CPU). The file formats are described in docs/GOLDEN.md.

Usage:
  python3 tools/reference/make_golden.py            # both fixtures
  python3 tools/reference/make_golden.py --only hf  # transformers fixture only
  python3 tools/reference/make_golden.py --only mlx # mlx fixture only (needs hf_small to exist)
"""

import argparse
import importlib.util
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO / "tests" / "fixtures" / "golden"
HF_DIR = GOLDEN_DIR / "hf_small"
MLX_DIR = GOLDEN_DIR / "mlx_small"

INIT_SEED = 20260901
PROMPT_SEED = 7
N_PROMPT = 64
N_GENERATE = 16
LOGITS_FILE = "logits.f32"
LOGITS_DTYPE = "float32 little-endian row-major [n_positions, vocab_size]"

# The geometry keeps the real model's structure (hybrid 3:1 layer pattern, 2 full-attention layers, GQA,
# 2 value heads per key head, partial RoPE of 1/4 of head_dim, packed experts + shared expert) while
# staying small enough to commit. Every dimension that is the input of a matrix is a multiple of 64, so
# MLX group-64 quantization applies to all linear layers, and hidden_size is 2 groups wide.
SMALL_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    # partial_rotary_factor 0.25 of head_dim 64 -> 16 rotary dims = 8 frequencies; the real
    # mrope_section [11, 11, 10] (sums to 32 frequencies) is scaled down to [3, 3, 2] (sums to 8).
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        mrope_interleaved=True,
        mrope_section=[3, 3, 2],
    ),
)

ROUTER_LOGIT_STD = 4.0  # router logits ~N(0, 4^2): top-k choice is decisive, not a coin toss
LM_HEAD_LOGIT_STD = 3.0  # final logits std ~3: clear top-1 margins


# ----------------------------------------------------------------------------------------------
# transformers fixture
# ----------------------------------------------------------------------------------------------


def build_config():
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**SMALL_CONFIG)


def _init_rule(name, shape):
    """(kind, arg) for parameter `name`: how it is re-initialised. See docs/GOLDEN.md."""
    zero_centred_norms = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                          "k_norm.weight")
    if name == "model.norm.weight" or name.endswith(zero_centred_norms):
        return "normal", 0.1  # stored ~0, applied as (1 + w)
    if name.endswith("linear_attn.norm.weight"):
        return "one_plus_normal", 0.1  # plain multiplier (RMSNormGated)
    if name.endswith("A_log"):
        return "log_uniform", (1.0, 16.0)
    if name.endswith("dt_bias"):
        return "normal", 0.5
    if name.endswith("conv1d.weight"):
        return "normal", 0.5
    if name == "model.embed_tokens.weight":
        return "normal", 1.0
    if name == "lm_head.weight":
        return "normal", LM_HEAD_LOGIT_STD / math.sqrt(shape[-1])
    if name.endswith("mlp.gate.weight"):
        return "normal", ROUTER_LOGIT_STD / math.sqrt(shape[-1])
    # Linear weights (2-D [out, in]) and packed experts (3-D [E, out, in]): N(0, 1 / fan_in). This keeps the
    # residual stream O(1): its RMS grows from 1.0 (embedding) to 2.3 (before the final norm) over 8 layers.
    return "normal", 1.0 / math.sqrt(shape[-1])


def reinit_weights(model):
    gen = torch.Generator().manual_seed(INIT_SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            kind, arg = _init_rule(name, tuple(p.shape))
            if kind == "normal":
                v = torch.randn(p.shape, generator=gen) * arg
            elif kind == "one_plus_normal":
                v = 1.0 + torch.randn(p.shape, generator=gen) * arg
            else:  # log_uniform
                lo, hi = arg
                v = torch.log(lo + (hi - lo) * torch.rand(p.shape, generator=gen))
            p.copy_(v.to(p.dtype))


def make_hf_checkpoint(out_dir):
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(INIT_SEED)
    config = build_config()
    model = Qwen3_5MoeForCausalLM(config).eval()
    reinit_weights(model)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    # save_original_format=False keeps the packed experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    # [E, H, I]) that the released checkpoint and mlx-lm use. transformers 5 would otherwise "revert" them to
    # the legacy qwen2_moe per-expert keys (mlp.experts.{e}.{gate,up,down}_proj.weight) for this CausalLM class.
    model.to(torch.bfloat16).save_pretrained(out_dir, save_original_format=False)
    check_hf_layout(out_dir, config)
    print(f"[hf] saved checkpoint to {out_dir}")


def check_hf_layout(out_dir, config):
    """Fail loudly if transformers ever changes the names, shapes or dtypes the C++ loader is tested on."""
    from safetensors import safe_open

    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    with safe_open(out_dir / "model.safetensors", "pt") as f:
        shapes = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    n_full = config.layer_types.count("full_attention")
    expected_count = 18 * (config.num_hidden_layers - n_full) + 15 * n_full + 3
    checks = {
        "tensor count": (len(shapes), expected_count),
        "gate_up_proj": (shapes.get("model.layers.0.mlp.experts.gate_up_proj"), ([E, 2 * I, H], "BF16")),
        "down_proj": (shapes.get("model.layers.0.mlp.experts.down_proj"), ([E, H, I], "BF16")),
        "dtypes": ({d for _, d in shapes.values()}, {"BF16"}),
    }
    for what, (got, want) in checks.items():
        if got != want:
            sys.exit(f"[hf] unexpected checkpoint layout: {what}: got {got}, expected {want}")


def load_reference_model(model_dir):
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def prompt_ids(vocab_size):
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab_size, (N_PROMPT,), generator=gen).tolist()


class RouterRecorder:
    """Collects router logits of every MoE layer so the script can report routing margins."""

    def __init__(self, model):
        self.logits = []
        self.handles = [layer.mlp.gate.register_forward_hook(self._hook) for layer in model.model.layers]

    def _hook(self, module, inputs, output):
        self.logits.append(output[0].detach().float())

    def remove(self):
        for h in self.handles:
            h.remove()


def router_gap(router_logits, k):
    """Smallest router-logit gap between the k-th and (k+1)-th expert over all tokens and layers.

    An engine whose router logits differ from the reference by less than this picks the same experts.
    """
    gaps = []
    for logits in router_logits:
        top = logits.topk(k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps)


def top1_margins(logits):
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def gdn_implementation():
    """Which gated-delta / conv implementations transformers could pick (see docs/GOLDEN.md)."""
    found = {pkg: importlib.util.find_spec(pkg) is not None for pkg in ("fla", "causal_conv1d", "kernels")}
    if any(found.values()):
        return f"optional kernel packages present: {found} (check that the torch path was used)"
    return ("torch fallback: torch_chunk_gated_delta_rule (chunk_size 64) for prefill / full forward, "
            "torch_recurrent_gated_delta_rule for single-token cached decode; F.conv1d causal conv "
            "(flash-linear-attention, causal-conv1d and kernels not installed)")


def run_hf_reference(model_dir):
    import transformers

    model = load_reference_model(model_dir)
    cfg = model.config
    ids = prompt_ids(cfg.vocab_size)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        # The attention mask is explicit: left to itself, generate() infers padding from pad_token_id, and a
        # prompt token equal to it would be masked out.
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N_GENERATE,
                             min_new_tokens=N_GENERATE, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    greedy = out.sequences[0, N_PROMPT:].tolist()
    step_logits = torch.cat([l.float() for l in out.logits], dim=0)  # [N_GENERATE, V]
    tokens = ids + greedy

    recorder = RouterRecorder(model)
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()  # [80, V]
    recorder.remove()

    # Cached (incremental) greedy and the uncached full forward must agree.
    full_argmax = logits[N_PROMPT - 1:N_PROMPT - 1 + N_GENERATE].argmax(-1).tolist()
    if full_argmax != greedy:
        sys.exit(f"[hf] cached greedy {greedy} != full-forward argmax {full_argmax}")
    cached_vs_full = (step_logits - logits[N_PROMPT - 1:N_PROMPT - 1 + N_GENERATE]).abs().max().item()
    margins = top1_margins(logits)
    stats = {
        "cached_vs_full_max_abs_diff": cached_vs_full,
        "min_top1_margin_all_positions": margins.min().item(),
        "min_top1_margin_greedy_steps": margins[N_PROMPT - 1:N_PROMPT - 1 + N_GENERATE].min().item(),
        "min_router_topk_logit_gap": router_gap(recorder.logits, cfg.num_experts_per_tok),
    }
    meta = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "attn_implementation": "eager",
        "compute_dtype": "float32 (bf16 checkpoint upcast at load)",
        "gated_delta_path": gdn_implementation(),
    }
    write_golden(model_dir, ids, greedy, logits.numpy(), stats, meta)


def write_golden(out_dir, ids, greedy, logits, stats, meta):
    logits = np.ascontiguousarray(logits, dtype="<f4")
    n_positions, vocab = logits.shape
    (out_dir / LOGITS_FILE).write_bytes(logits.tobytes())
    golden = {
        "prompt_ids": ids,
        "greedy_ids": greedy,
        "token_ids": ids + greedy,
        "n_positions": n_positions,
        "vocab_size": vocab,
        "logits_file": LOGITS_FILE,
        "logits_dtype": LOGITS_DTYPE,
        **meta,
        "logits_std": float(logits.std()),
        **stats,
    }
    (out_dir / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"[golden] {out_dir.name}: greedy {greedy}")
    summary = {k: v for k, v in golden.items() if k in stats or k == "logits_std"}
    print(f"[golden] {out_dir.name}: {json.dumps(summary)}")


# ----------------------------------------------------------------------------------------------
# mlx fixture
# ----------------------------------------------------------------------------------------------


def write_placeholder_tokenizer(dst, vocab_size):
    """mlx-lm's convert() loads and re-saves a tokenizer; the fixture has none, so give it a word-level one.

    Its files are removed from the output again: they are not part of the model fixture.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def stage_vlm_style(hf_dir, staging):
    """Copy the CausalLM checkpoint into `staging` with the released (VLM-style) config around it.

    mlx-lm has no module for model_type "qwen3_5_moe_text" (what Qwen3_5MoeForCausalLM writes); it needs
    "qwen3_5_moe". The released Qwen3.6 config nests the text config under "text_config", so the staged
    config does the same; mlx-lm's sanitize maps `model.layers.*` / `lm_head` to `language_model.*`.
    """
    text_config = json.loads((hf_dir / "config.json").read_text())
    for key in ("architectures", "transformers_version"):
        text_config.pop(key, None)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": text_config,
    }
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(hf_dir / "model.safetensors", staging / "model.safetensors")
    write_placeholder_tokenizer(staging, text_config["vocab_size"])


def convert_mlx(hf_dir, out_dir):
    from mlx_lm.convert import convert

    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "hf_vlm_style"
        stage_vlm_style(hf_dir, staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        convert(str(staging), str(out_dir), quantize=True, q_group_size=64, q_bits=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "README.md"):
        (out_dir / name).unlink(missing_ok=True)
    print(f"[mlx] converted to {out_dir}: {sorted(p.name for p in out_dir.iterdir())}")


def mlx_model_fp32(model):
    """Cast every float parameter (bf16 scales/biases, norms, conv, A_log, dt_bias) to fp32.

    bf16 -> fp32 is exact, so the weights are unchanged; only the activation math becomes fp32, which is
    what lily's fp32 CPU engine computes on the dequantized weights.
    """
    import mlx.core as mx
    from mlx.utils import tree_map

    def up(p):
        return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(up, model.parameters()))
    return model


def mlx_greedy(model, ids, n):
    """Greedy decode through mlx-lm's caches (prefill, then one token per step)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return out


def mlx_forward_with_router(model, tokens):
    """Uncached forward over `tokens`; also returns every MoE layer's router logits."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_next

    block = qwen3_next.Qwen3NextSparseMoeBlock
    original = block.__call__
    router_logits = []

    def recording_call(self, x):
        gates = np.array(self.gate(x).astype(mx.float32)).reshape(-1, self.num_experts)
        router_logits.append(torch.from_numpy(gates))
        return original(self, x)

    block.__call__ = recording_call
    try:
        logits = np.array(model(mx.array([tokens]))[0].astype(mx.float32))
    finally:
        block.__call__ = original
    return logits, router_logits


def dequantized_hf_state_dict(mlx_dir):
    """The MLX fixture's weights mapped back to transformers' names and conventions, in fp32.

    Undoes what mlx-lm's convert did: dequantize (w = scale * q + bias), join `switch_mlp` back into packed
    experts, conv1d [C, K, 1] -> [C, 1, K], and the +1 that mlx-lm's sanitize folds into zero-centred norms.
    """
    import mlx.core as mx

    config = json.loads((mlx_dir / "config.json").read_text())
    quant = config["quantization"]
    raw = mx.load(str(mlx_dir / "model.safetensors"))
    out = {}
    for key in raw:
        if key.endswith((".scales", ".biases")):
            continue
        module = key[: -len(".weight")] if key.endswith(".weight") else key
        w = raw[key]
        if f"{module}.scales" in raw:
            q = quant.get(module, quant)
            # fp32 scales/biases: the dequantized weight is exact, not rounded back to bf16.
            scales, biases = (raw[f"{module}.{n}"].astype(mx.float32) for n in ("scales", "biases"))
            w = mx.dequantize(w, scales, biases, group_size=q["group_size"], bits=q["bits"], mode="affine")
        t = torch.from_numpy(np.array(w.astype(mx.float32)))
        name = key.replace("language_model.", "", 1)
        if name.endswith("conv1d.weight"):
            t = t.permute(0, 2, 1)
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                          "k_norm.weight")) or name == "model.norm.weight":
            t = t - 1.0
        out[name] = t
    for layer in range(config["text_config"]["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp"
        gate, up = out.pop(f"{p}.switch_mlp.gate_proj.weight"), out.pop(f"{p}.switch_mlp.up_proj.weight")
        out[f"{p}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{p}.experts.down_proj"] = out.pop(f"{p}.switch_mlp.down_proj.weight")
    return out


def transformers_on_mlx_weights(mlx_dir, hf_dir, tokens):
    """transformers' fp32 logits with the MLX fixture's (dequantized) weights: checks the two references agree."""
    model = load_reference_model(hf_dir)
    model.load_state_dict(dequantized_hf_state_dict(mlx_dir), strict=True)
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def run_mlx_reference(mlx_dir, hf_dir):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import load_model

    hf_golden = json.loads((hf_dir / "golden.json").read_text())
    hf_logits = np.fromfile(hf_dir / LOGITS_FILE, dtype="<f4").reshape(hf_golden["n_positions"], -1)
    ids = hf_golden["prompt_ids"]

    model_bf16, config = load_model(mlx_dir)  # as mlx-lm runs it: bf16 activations
    model = mlx_model_fp32(load_model(mlx_dir)[0])
    greedy = mlx_greedy(model, ids, N_GENERATE)
    tokens = ids + greedy
    logits, router_logits = mlx_forward_with_router(model, tokens)
    full_argmax = logits[N_PROMPT - 1:N_PROMPT - 1 + N_GENERATE].argmax(-1).tolist()
    if full_argmax != greedy:
        sys.exit(f"[mlx] cached greedy {greedy} != full-forward argmax {full_argmax}")
    logits_bf16 = np.array(model_bf16(mx.array([tokens]))[0].astype(mx.float32))
    logits_on_hf_tokens = np.array(model(mx.array([hf_golden["token_ids"]]))[0])

    hf_math_logits = transformers_on_mlx_weights(mlx_dir, hf_dir, tokens)

    margins = top1_margins(torch.from_numpy(logits))
    stats = {
        "transformers_on_dequantized_weights_max_abs_diff": float(np.abs(hf_math_logits - logits).max()),
        "min_top1_margin_all_positions": margins.min().item(),
        "min_top1_margin_greedy_steps": margins[N_PROMPT - 1:N_PROMPT - 1 + N_GENERATE].min().item(),
        "min_router_topk_logit_gap": router_gap(router_logits, config["text_config"]["num_experts_per_tok"]),
        "bf16_activation_run_max_abs_diff": float(np.abs(logits_bf16 - logits).max()),
        "greedy_matches_hf": greedy == hf_golden["greedy_ids"],
        "on_hf_token_ids_argmax_agreement_with_hf": int((logits_on_hf_tokens.argmax(-1) ==
                                                         hf_logits.argmax(-1)).sum()),
        "on_hf_token_ids_max_abs_diff_vs_hf": float(np.abs(logits_on_hf_tokens - hf_logits).max()),
    }
    meta = {
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "compute_dtype": "float32 activations (bf16 scales/biases/norms upcast exactly at load)",
        "quantization": "mlx-lm convert: affine 4-bit group 64; 8-bit for mlp.gate and shared_expert_gate",
    }
    write_golden(mlx_dir, ids, greedy, logits, stats, meta)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["hf", "mlx"], help="make one fixture only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.only in (None, "hf"):
        make_hf_checkpoint(HF_DIR)
        run_hf_reference(HF_DIR)
    if args.only in (None, "mlx"):
        convert_mlx(HF_DIR, MLX_DIR)
        run_mlx_reference(MLX_DIR, HF_DIR)


if __name__ == "__main__":
    main()
