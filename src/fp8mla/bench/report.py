"""The bench's output: a markdown table (stdout and ``<suite>.md``), every number in ``<suite>.json``, and for
a timed suite (speed, sparse) a plot of TFLOPS against batch size (``tflops_vs_batch.png``) and one of each fp8mla
method's speedup over the peers of its kind (``speedup_vs_peers.png``), if matplotlib is installed."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform

import torch

from .. import __version__
from .metrics import format_speed

FORMULAS = {
    "flops": "2 * s_q * sum(seqlens) * h_q * (576 + 512), causal masking not subtracted",
    "bytes": "sum(seqlens) * h_kv * cache_bytes_per_token + b * s_q * h_q * 576 * q_bytes_per_elem "
             "+ b * s_q * h_q * 512 * 2",
    "cache_bytes_per_token": "bf16 1152, fp8 576 (FlashMLA's formula); fp8_rope_bf16 656, its real row size",
    "q_bytes_per_elem": "1 for an e4m3 q (fp8 rows, FlashMLA dense FP8), else 2",
    "speedup": "peer ms / fp8mla ms, same run, peers of the same kind (bf16 rows: BF16 peers; fp8 rows: FP8 peer)",
    "accuracy": "out vs the fp32 reference on the unquantized bf16 inputs: cal_diff (cos_diff, RMSE, amax) and "
                "the largest |lse - lse_ref| over rows that see a key",
    "needle": "rows whose output is the planted key's V (cosine > 0.99), against the reference's count",
}


def environment(device: torch.device, command: str) -> dict:
    import triton

    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU {platform.machine()} (Triton interpreter: timings mean nothing)")
    return dict(device=name, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                fp8mla=__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command)


def describe(e: BaseException, limit: int = 240) -> str:
    """An exception as one table-safe line: its type and the first line of its message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def sci(x) -> str:
    """An error metric for a table cell."""
    return "n/a" if x is None else f"{x:.2e}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _metrics_cells(row: dict, suite: str) -> list[str]:
    if suite != "accuracy":   # speed, sparse
        speedup = ", ".join(f"{v:.2f}× {k}" for k, v in row.get("speedup", {}).items())
        cells = [format_speed(row["ms"], row["tflops"], row["gbps"]) if "ms" in row else "",
                 f"{row['eager_ms']:.3f} ms" if "eager_ms" in row else "",
                 f"{row['host_us']:.0f}" if "host_us" in row else "", speedup]
    else:
        cells = []
    cells += [sci(row.get(k)) if k in row else "" for k in ("cos_diff", "rmse", "amax", "lse_err")]
    if suite == "accuracy":
        cells.append(f"{row['needle_hits']}/{row['needle_rows']} (reference {row['needle_ref_hits']}), "
                     f"cos_diff {sci(row['needle_cos_diff'])}" if "needle_rows" in row else "")
    if row.get("error"):  # the message takes the first empty cell, so a partial row keeps what it measured
        blank = cells.index("") if "" in cells else len(cells) - 1
        cells[blank] = f"**failed**: {row['error']}"
    return cells


def markdown(rows: list[dict], suite: str, env: dict) -> str:
    timed = suite != "accuracy"   # speed, sparse
    head = ["config" if timed else "case", "method"]
    head += ["CUDA graph (median)", "eager", "host µs/call", "speedup vs peers (graph)"] if timed else []
    head += ["cos_diff", "RMSE", "amax", "lse err"] + (["needle rows = its V"] if suite == "accuracy" else [])
    lines = [f"## fp8mla {suite}: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, {env['date']}; `{env['command']}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    previous = None
    for row in rows:
        label = row["label"] if row["label"] != previous else ""
        previous = row["label"]
        lines.append("| " + " | ".join(_cell(c) for c in [label, row["method"], *_metrics_cells(row, suite)]) + " |")
    if suite == "speed":
        lines += ["", f"FLOPs = {FORMULAS['flops']}; bytes = {FORMULAS['bytes']} "
                      f"({FORMULAS['cache_bytes_per_token']}; q: {FORMULAS['q_bytes_per_elem']}). "
                      f"Speedup = {FORMULAS['speedup']}."]
    else:
        lines += ["", f"Needle: {FORMULAS['needle']}."]
    lines.append(f"Accuracy: {FORMULAS['accuracy']}.")
    return "\n".join(lines) + "\n"


def _finite(x):
    """JSON without NaN/Infinity literals: non-finite floats become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _axes(width: float):
    """A figure's axes, 5 inches high (None without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(width, 5))
    FigureCanvasAgg(fig)
    return fig.subplots()


def _save(ax, path: str) -> str:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside the axes: it hides no point
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    return path


def plot_tflops(rows: list[dict], path: str) -> str | None:
    """TFLOPS vs b, one line per method, for the configs that differ only in b (the largest such group).
    Returns the path, or None without matplotlib or without a timed row."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "tflops" in row:
            key = tuple((k, v) for k, v in row["config"].items() if k != "b")
            groups.setdefault(key, []).append(row)
    if not groups:
        return None
    group = max(groups.values(), key=lambda g: len({r["config"]["b"] for r in g}))
    ax = _axes(10)
    if ax is None:
        return None
    for method in dict.fromkeys(r["method"] for r in group):
        mine = [r for r in group if r["method"] == method]
        points = sorted((r["config"]["b"], r["tflops"]) for r in mine)
        ax.plot(*zip(*points), marker="o", linestyle="--" if mine[0]["peer"] else "-", label=method)
    batches = sorted({r["config"]["b"] for r in group})
    if batches[-1] >= 8 * batches[0]:   # b = 1 ... 128: on a linear axis the small batches sit on one another
        ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size b")
    ax.set_ylabel("TFLOPS (FlashMLA's formula)")
    ax.set_title("MLA decode, " + group[0]["label"].split(" ", 1)[1])
    ax.grid(alpha=0.3)
    return _save(ax, path)


def plot_speedups(rows: list[dict], path: str) -> str | None:
    """Each fp8mla row's speedup over each peer of its kind (graph time), bars grouped by config, a line at 1x.
    Returns the path, or None without matplotlib or without a speedup."""
    bars = {}   # (fp8mla method, peer) -> {config label: speedup}
    for row in rows:
        for peer, x in row.get("speedup", {}).items():
            bars.setdefault((row["method"], peer), {})[row["label"]] = x
    if not bars:
        return None
    labels = list(dict.fromkeys(row["label"] for row in rows))
    width = 0.8 / len(bars)
    ax = _axes(max(8, 1.2 * len(labels)))
    if ax is None:
        return None
    for i, ((method, peer), by_label) in enumerate(bars.items()):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j, label in enumerate(labels) if label in by_label]
        ax.bar(xs, [by_label[label] for label in labels if label in by_label], width,
               label=f"{method} vs {peer}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    common = [w for w in labels[0].split() if all(w in label.split() for label in labels)]   # into the title
    ax.set_xticks(range(len(labels)), ["\n".join(w for w in label.split() if w not in common) for label in labels],
                  fontsize=8)
    ax.set_ylabel("speedup (peer's CUDA-graph time / fp8mla's)")
    ax.set_title(f"MLA decode{', ' + ' '.join(common) if common else ''}\n"
                 "fp8mla's speedup over each peer of its kind, same run", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _save(ax, path)


def write_report(rows: list[dict], suite: str, device: torch.device, command: str, out_dir: str, progress) -> str:
    """Write ``<suite>.md``, ``<suite>.json`` (and the plots of a timed suite) to ``out_dir``; return the
    markdown."""
    os.makedirs(out_dir, exist_ok=True)
    env = environment(device, command)
    table = markdown(rows, suite, env)
    with open(os.path.join(out_dir, f"{suite}.md"), "w") as f:
        f.write(table)
    plot = speedup_plot = None
    if suite != "accuracy":
        plot = plot_tflops(rows, os.path.join(out_dir, "tflops_vs_batch.png"))
        progress(f"plot: {plot}" if plot else "plot: skipped (matplotlib missing or nothing timed)")
        speedup_plot = plot_speedups(rows, os.path.join(out_dir, "speedup_vs_peers.png"))
        progress(f"plot: {speedup_plot}" if speedup_plot else
                 "speedup plot: skipped (matplotlib missing or no peer timed beside fp8mla)")
    with open(os.path.join(out_dir, f"{suite}.json"), "w") as f:
        json.dump(_finite(dict(environment=env, formulas=FORMULAS, suite=suite, plot=plot, speedup_plot=speedup_plot,
                               rows=rows)), f, indent=1)
    progress(f"wrote {suite}.md and {suite}.json to {out_dir}")
    return table
