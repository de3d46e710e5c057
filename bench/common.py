"""Shared by the bench/ scripts: the lily binary, synthetic checkpoints, and the provenance stamp (git SHA, GPU,
driver, clocks, date) every result JSON carries."""

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def log(msg):
    print(f"[{datetime.datetime.now(datetime.timezone.utc).strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
          flush=True)


def find_lily(explicit=None):
    """--lily, else build-cuda/lily, else build/lily."""
    if explicit:
        return str(Path(explicit).resolve())
    for cand in (REPO / "build-cuda" / "lily", REPO / "build" / "lily"):
        if cand.exists():
            return str(cand)
    sys.exit("no lily binary: build it (cmake --preset cuda && cmake --build build-cuda --target lily) or pass --lily")


def git_sha(fallback=None):
    """`git rev-parse HEAD` of the repository (with -dirty when the tree has changes), else `fallback`."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return fallback or "unknown"


def gpu_info():
    """name, driver, current SM and memory clocks of GPU 0 (nvidia-smi), or None without a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
                              "clocks.max.mem,power.limit", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    f = [x.strip() for x in out[0].split(",")]
    keys = ["name", "driver", "clocks_sm", "clocks_mem", "clocks_max_sm", "clocks_max_mem", "power_limit"]
    return dict(zip(keys, f))


def stamp(sha=None):
    """Provenance of a run."""
    import torch

    return {
        "git_sha": git_sha(sha),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": gpu_info(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def ensure_checkpoint(lily, preset, layout, out_dir, seed=0):
    """`lily synth --preset P --layout L --out DIR` unless DIR already holds a complete one (marker file)."""
    out_dir = Path(out_dir)
    marker = out_dir / ".lily_synth_complete"
    want = {"preset": preset, "layout": layout, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == want:
        log(f"checkpoint {out_dir} present ({preset}, {layout})")
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    log(f"writing checkpoint {out_dir}: lily synth --preset {preset} --layout {layout}")
    subprocess.run([lily, "synth", "--preset", preset, "--layout", layout, "--out", str(out_dir), "--seed",
                    str(seed), "--no-tokenizer"], check=True)
    marker.write_text(json.dumps(want))
    return out_dir


def write_json(path, obj):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)
