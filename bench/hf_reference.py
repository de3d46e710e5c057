#!/usr/bin/env python3
"""transformers' Qwen3_5MoeForCausalLM on the very weights lily runs: the reference of bench/run_bench.py and
bench/fidelity.py.

The model is built from a lily checkpoint directory (`lily synth ... --layout mlx|hf`, or a real checkpoint):
  - config: config.json's text_config (the released file nests it under "text_config"; docs/MODEL.md 1.1);
  - mlx 4-bit layout: every affine triple (weight uint32, scales/biases bf16, group 64; 8 bits where the
    config's "quantization" overrides say so, i.e. mlp.gate and shared_expert_gate) is dequantized as
    w = scale * q + bias (MODEL.md 2.4) in fp32 on the target device, then cast to the compute dtype; the names
    are mapped back to transformers' (MODEL.md 2.1 sanitize inverted): language_model.model.X -> model.X,
    language_model.lm_head -> lm_head, switch_mlp.{gate,up}_proj -> experts.gate_up_proj [E, 2I, H] (gate rows
    first, MODEL.md 1.2), switch_mlp.down_proj -> experts.down_proj [E, H, I], conv1d [C, K, 1] -> [C, 1, K], and
    the +1 that mlx bakes into the zero-centred norms is taken out again;
  - hf bf16 layout: model.language_model.X -> model.X, tensors as stored.
The model is created on the meta device and every parameter is assigned directly (no second copy: the full
35B model is ~70 GB in bf16), then the rotary buffers are rebuilt on the device.

attn_implementation is "sdpa". flash-linear-attention and causal-conv1d are not installed on the GPU machine,
so transformers runs its torch Gated DeltaNet path (torch_chunk_gated_delta_rule for prefill,
torch_recurrent_gated_delta_rule for cached decode, F.conv1d for the conv); `gdn_path()` says which.

Functions: `load_reference(dir)` -> HFReference with prefill timing at a length, decode timing at a context
(prefill once, then N cached steps), and teacher-forced logits for an id list.
"""

import glob
import importlib.util
import inspect
import json
import os
import time
from pathlib import Path

import torch

ZERO_CENTRED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                      "k_norm.weight")


def pick_device(device=None):
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gdn_path():
    """Which Gated DeltaNet / conv implementation transformers can use here."""
    found = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
    if found:
        return f"optional kernel packages present ({', '.join(found)}): transformers may use them"
    return ("torch fallback (flash-linear-attention and causal-conv1d not installed): torch_chunk_gated_delta_rule "
            "for prefill, torch_recurrent_gated_delta_rule for cached decode, F.conv1d causal conv")


def read_checkpoint_config(model_dir):
    """(text_config dict, quantization dict or None) of a lily / HF / mlx checkpoint directory."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = dict(cfg.get("text_config", cfg))
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    return text, quant


def hf_config(text, attn_implementation="sdpa", experts_implementation=None):
    from transformers import Qwen3_5MoeTextConfig

    drop = ("model_type", "architectures", "quantization", "quantization_config", "transformers_version",
            "text_config", "vision_config", "dtype", "torch_dtype")
    kwargs = {k: v for k, v in text.items() if k not in drop}
    config = Qwen3_5MoeTextConfig(**kwargs)
    config._attn_implementation = attn_implementation
    if experts_implementation:
        config._experts_implementation = experts_implementation
    return config


def _checkpoint_files(model_dir):
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [str(Path(model_dir) / n) for n in names]
    files = sorted(glob.glob(str(Path(model_dir) / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return files


def dequantize(wq, scales, biases, bits, group_size, out_dtype, max_elems=1 << 26):
    """MLX affine dequantization (docs/MODEL.md 2.4): w = scale * q + bias, groups along the last axis,
    q packed LSB first in uint32 words. Computed in fp32 in row blocks of at most `max_elems` outputs."""
    wq = wq.view(torch.int32)
    lead = wq.shape[:-1]
    n_in = wq.shape[-1] * 32 // bits
    groups = n_in // group_size
    if scales.shape[-1] != groups or biases.shape[-1] != groups:
        raise ValueError(f"scales {tuple(scales.shape)} do not match {n_in} inputs in groups of {group_size}")
    wq2, s2, b2 = wq.reshape(-1, wq.shape[-1]), scales.reshape(-1, groups), biases.reshape(-1, groups)
    rows = wq2.shape[0]
    out = torch.empty(rows, n_in, dtype=out_dtype, device=wq.device)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=wq.device)
    mask = (1 << bits) - 1
    step = max(1, max_elems // n_in)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q = ((wq2[r0:r1, :, None] >> shifts) & mask).reshape(r1 - r0, groups, group_size).float()
        w = q * s2[r0:r1, :, None].float() + b2[r0:r1, :, None].float()
        out[r0:r1] = w.reshape(r1 - r0, n_in).to(out_dtype)
    return out.reshape(*lead, n_in)


class _Tensors:
    """Lazy access to every tensor of a checkpoint directory, loaded straight onto `device`."""

    def __init__(self, model_dir, device):
        from safetensors import safe_open

        self.handles, self.where = [], {}
        # Straight onto the GPU when there is one (no host copy of the full model); else the CPU.
        if device.type == "cuda":
            load_device = f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
        else:
            load_device = "cpu"
        for f in _checkpoint_files(model_dir):
            h = safe_open(f, framework="pt", device=load_device)
            self.handles.append(h)
            for k in h.keys():
                self.where[k] = h
        self.device = device

    def keys(self):
        return list(self.where)

    def __contains__(self, k):
        return k in self.where

    def get(self, k):
        return self.where[k].get_tensor(k).to(self.device)


def iter_hf_tensors(model_dir, device, dtype, layers=None):
    """(transformers name, tensor) for every text-model weight of the checkpoint, dequantized to `dtype`.

    `layers`: keep only the first `layers` decoder layers (None: all)."""
    text, quant = read_checkpoint_config(model_dir)
    src = _Tensors(model_dir, device)
    keys = src.keys()
    mlx = any(k.startswith("language_model.") for k in keys)

    def qparams(module):
        q = dict(quant or {})
        over = q.get(module)
        if isinstance(over, dict):
            q.update(over)
        return int(q.get("bits", 4)), int(q.get("group_size", 64))

    def load(module):
        """Module path (no suffix) -> dequantized or plain weight."""
        wkey = module + ".weight"
        if module + ".scales" in src:
            bits, group = qparams(module)
            return dequantize(src.get(wkey), src.get(module + ".scales"), src.get(module + ".biases"), bits, group,
                              dtype)
        return src.get(wkey)

    def hf_name(key):
        if mlx:
            name = key[len("language_model."):] if key.startswith("language_model.") else key
        else:
            name = key.replace("model.language_model.", "model.", 1)
        return name

    def keep(name):
        if layers is None or not name.startswith("model.layers."):
            return True
        return int(name.split(".")[2]) < layers

    for key in keys:
        if key.endswith((".scales", ".biases")) or "mtp." in key or "visual" in key or "vision_tower" in key:
            continue
        name = hf_name(key)
        if not keep(name):
            continue
        if mlx and ".switch_mlp." in key:
            if ".switch_mlp.up_proj." in key:
                continue  # joined with gate_proj below
            base = key[: key.index(".switch_mlp.")]
            hbase = hf_name(base)
            if ".switch_mlp.gate_proj." in key:
                gate = load(base + ".switch_mlp.gate_proj")
                up = load(base + ".switch_mlp.up_proj")
                t = torch.cat([gate, up], dim=1)
                del gate, up
                yield hbase + ".experts.gate_up_proj", t
            else:
                yield hbase + ".experts.down_proj", load(base + ".switch_mlp.down_proj")
            continue
        module = key[: -len(".weight")] if key.endswith(".weight") else key
        t = load(module) if key.endswith(".weight") else src.get(key)
        if mlx and name.endswith("conv1d.weight") and t.dim() == 3 and t.shape[-1] == 1:
            t = t.permute(0, 2, 1).contiguous()
        if mlx and t.dim() == 1 and (name.endswith(ZERO_CENTRED_NORMS) or name == "model.norm.weight"):
            t = (t.float() - 1.0)
        yield name, t


def build_model(model_dir, device=None, dtype=torch.bfloat16, attn_implementation="sdpa",
                experts_implementation=None, layers=None):
    """Qwen3_5MoeForCausalLM with the checkpoint's weights; returns (model, info dict)."""
    from transformers import Qwen3_5MoeForCausalLM

    device = pick_device(device)
    text, quant = read_checkpoint_config(model_dir)
    if layers is not None:
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
    config = hf_config(text, attn_implementation, experts_implementation)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    model.eval()
    pending = {n for n, _ in model.named_parameters()}
    n_bytes = 0
    for name, t in iter_hf_tensors(model_dir, device, dtype, layers):
        mod_name, _, pname = name.rpartition(".")
        try:
            mod = model.get_submodule(mod_name)
        except AttributeError as e:
            raise KeyError(f"{model_dir}: tensor {name} has no module in transformers' model") from e
        old = mod._parameters.get(pname)
        if old is None:
            raise KeyError(f"{model_dir}: tensor {name} is not a parameter of transformers' model")
        if tuple(old.shape) != tuple(t.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)}, transformers expects {tuple(old.shape)}")
        t = t.to(device=device, dtype=dtype)
        mod._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
        n_bytes += t.numel() * t.element_size()
        pending.discard(name)
    if pending:
        raise KeyError(f"{model_dir}: no weights for {sorted(pending)[:8]} ({len(pending)} in all)")
    # Non-persistent buffers (the rotary inverse frequencies) were created on meta: rebuild them on the device.
    for mod_name, mod in model.named_modules():
        if not any(b is not None and b.is_meta for b in mod._buffers.values()):
            continue
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            raise RuntimeError(f"buffers of {mod_name} ({type(mod).__name__}) left on the meta device")
        fresh = type(mod)(config)
        for bname, b in fresh._buffers.items():
            mod._buffers[bname] = b.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info = {
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": config._attn_implementation,
        "experts_implementation": getattr(config, "_experts_implementation", None),
        "gated_delta_path": gdn_path(),
        "weights": ("mlx 4-bit affine dequantized (w = scale*q + bias, fp32) then cast to "
                    + str(dtype).replace("torch.", "")) if quant else "checkpoint tensors as stored",
        "weight_bytes": n_bytes,
        "load_s": time.perf_counter() - t0,
        "layers": config.num_hidden_layers,
    }
    return model, info


class _Timer:
    """Wall time of a region: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t


class HFReference:
    def __init__(self, model, info, device):
        self.model, self.info, self.device = model, info, device
        self.vocab = model.config.vocab_size
        params = inspect.signature(model.forward).parameters
        # transformers renamed past_key_values -> cache (5.2x); accept either.
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def _ids(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab, (1, n), generator=g).to(self.device)

    def _cache_of(self, out):
        for k in ("past_key_values", "cache"):
            c = getattr(out, k, None)
            if c is not None:
                return c
        raise RuntimeError("transformers returned no cache")

    @torch.inference_mode()
    def prefill(self, n, seed=0):
        """One prefill of n random ids (cache filled, logits of the last row only); returns (seconds, cache, last
        logits)."""
        ids = self._ids(n, seed)
        with _Timer(self.device) as t:
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return t.s, self._cache_of(out), out.logits[:, -1]

    @torch.inference_mode()
    def decode(self, cache, last_logits, steps):
        """`steps` greedy decode steps through the cache, one token each; returns seconds for all steps."""
        tok = last_logits.argmax(-1, keepdim=True)
        with _Timer(self.device) as t:
            for _ in range(steps):
                out = self.model(input_ids=tok, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
                cache = self._cache_of(out)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return t.s

    def prefill_and_decode(self, n, steps, seed=0):
        """Prefill n ids (timed), then `steps` cached decode steps at context n (timed): (prefill s, decode s)."""
        p_s, cache, last = self.prefill(n, seed)
        d_s = self.decode(cache, last, steps) if steps > 0 else None
        del cache, last
        self.release()
        return p_s, d_s

    @torch.inference_mode()
    def sample(self, n, seed=0, temperature=1.0):
        """n ids drawn from the model itself (a random first id, then ancestral sampling at `temperature` through
        the cache, torch.Generator seeded on the CPU): text the model finds plausible, so the perplexity of the
        sequence means something, unlike that of uniformly random ids."""
        g = torch.Generator().manual_seed(seed)
        ids = [int(torch.randint(0, self.vocab, (1,), generator=g))]
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, logits_to_keep=1)
        while len(ids) < n:
            p = torch.softmax(out.logits[0, -1].float().cpu() / temperature, dim=-1)
            ids.append(int(torch.multinomial(p, 1, generator=g)))
            out = self.model(input_ids=torch.tensor([ids[-1:]], device=self.device), use_cache=True,
                             logits_to_keep=1, **{self.cache_kw: self._cache_of(out)})
        return ids

    @torch.inference_mode()
    def logits(self, ids):
        """Teacher-forced fp32 logits [T, V] of one uncached forward over `ids`."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=False)
        return out.logits[0].float().cpu()

    def release(self):
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def load_reference(model_dir, device=None, dtype=torch.bfloat16, attn_implementation="sdpa",
                   experts_implementation=None):
    device = pick_device(device)
    model, info = build_model(model_dir, device, dtype, attn_implementation, experts_implementation)
    return HFReference(model, info, device)


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="lily checkpoint directory")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prefill", type=int, default=256, help="time one prefill of this many random ids")
    ap.add_argument("--decode-steps", type=int, default=8)
    args = ap.parse_args()
    ref = load_reference(args.model, args.device, getattr(torch, args.dtype))
    print(json.dumps(ref.info, indent=1))
    ref.prefill_and_decode(min(args.prefill, 64), 2)  # warm-up
    p, d = ref.prefill_and_decode(args.prefill, args.decode_steps)
    print(f"prefill {args.prefill}: {args.prefill / p:.1f} tok/s; decode {args.decode_steps} steps at context "
          f"{args.prefill}: {args.decode_steps / d:.2f} tok/s")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
