#!/usr/bin/env python3
"""Checks that mlx-lm itself loads and runs a directory written by `lily quantize`.

Usage: lily quantize tests/fixtures/golden/hf_small /tmp/q && python3 tools/reference/check_quantize_with_mlx.py /tmp/q
Needs `pip install mlx[cpu] mlx-lm`. Prints mlx-lm's greedy continuation of the golden prompt; on 2026-11-29 it was
identical to the greedy ids of tests/fixtures/golden/mlx_small (mlx-lm's own convert of the same checkpoint) and to
`lily generate --model /tmp/q --prompt-ids <prompt>`, i.e. lily's quantizer reproduces mlx-lm's conversion.
"""
import json
import pathlib
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

root = pathlib.Path(__file__).resolve().parents[2]
model, _ = load_model(pathlib.Path(sys.argv[1]))
model.set_dtype(mx.float32)
golden = json.load(open(root / "tests/fixtures/golden/hf_small/golden.json"))
seq = list(golden["prompt_ids"])
for _ in range(16):
    logits = np.array(model(mx.array([seq]))[0, -1].astype(mx.float32))
    seq.append(int(logits.argmax()))
mlx_golden = json.load(open(root / "tests/fixtures/golden/mlx_small/golden.json"))["greedy_ids"]
print("mlx-lm greedy on the lily-quantized model:", seq[64:])
print("mlx-lm greedy on its own conversion:      ", mlx_golden)
sys.exit(0 if seq[64:] == mlx_golden else 1)
