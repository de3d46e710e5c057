#!/usr/bin/env python3
"""Sums an `ncu --csv --page raw` run (scripts/profile_decode.sh) per kernel name and grid size: launches, time, DRAM bytes read
and written, achieved DRAM bandwidth, mean L2 hit rate. Kernels profiled before the first `embed_lookup` (a
warm-up's tail) and from its second occurrence on (the next step) are left out, so the table is one step."""
import csv
import re
import sys
from collections import OrderedDict

UNITS = {"byte": 1, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3,
         "second": 1.0, "%": 1.0, "": 1.0}


def short(name):
    """`void lily::cuda::(anonymous namespace)::gemv_kernel<4, 2>(...)` -> `gemv_kernel<4, 2>`."""
    name = name.replace("(anonymous namespace)", "")
    name = name[len("void "):] if name.startswith("void ") else name
    return re.sub(r"\(.*$", "", name).split("::")[-1]


def main(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own lines around the CSV
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        sys.exit(f"{path}: no profiled kernels")
    head, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(head)}

    def val(r, metric):
        i = col.get(metric)
        if i is None or r[i] in ("", "n/a"):
            return 0.0
        return float(r[i].replace(",", "")) * UNITS.get(units[i], 1.0)

    # One step: from the first embed_lookup to the next.
    starts = [k for k, r in enumerate(data) if "embed_lookup" in r[col["Kernel Name"]]]
    if starts:
        data = data[starts[0]:starts[1]] if len(starts) > 1 else data[starts[0]:]
    agg = OrderedDict()
    for r in data:
        k = f"{short(r[col['Kernel Name']])} x{int(val(r, 'launch__grid_size'))}"  # one gemv per shape
        a = agg.setdefault(k, [0, 0.0, 0.0, 0.0, 0.0])
        a[0] += 1
        a[1] += val(r, "gpu__time_duration.sum")
        a[2] += val(r, "dram__bytes_read.sum")
        a[3] += val(r, "dram__bytes_write.sum")
        a[4] += val(r, "lts__t_sector_hit_rate.pct")
    total_t = sum(a[1] for a in agg.values())
    total_b = sum(a[2] + a[3] for a in agg.values())
    print(f"{'kernel':40s} {'launches':>8s} {'us':>9s} {'share':>6s} {'MB read':>9s} {'MB written':>10s} "
          f"{'GB/s':>7s} {'L2 hit %':>8s}")
    for k, (n, t, rd, wr, hit) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        gbs = (rd + wr) / t / 1e9 if t > 0 else 0.0
        print(f"{k[:40]:40s} {n:8d} {t * 1e6:9.1f} {100 * t / total_t:5.1f}% {rd / 1e6:9.2f} {wr / 1e6:10.2f} "
              f"{gbs:7.0f} {hit / n:8.1f}")
    print(f"{'one step, kernels back to back':40s} {sum(a[0] for a in agg.values()):8d} {total_t * 1e6:9.1f} "
          f"{'':6s} {total_b / 1e6:20.2f} {total_b / total_t / 1e9 if total_t else 0:7.0f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: ncu_summary.py NCU_RAW.csv")
    main(sys.argv[1])
