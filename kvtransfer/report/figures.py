"""PNG figures of a run: retention bars, R² heatmaps, R² vs k, speedup vs tokens, multi-turn drift.

Every figure that has a standard error draws it (error bars or bands), uses distinct colours and
markers per series, and is titled with the pair, the machine and n (`title`), so a figure read alone
says what it shows."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..core.io import atomic_write_bytes  # noqa: E402


def _save(fig, path: Path) -> Path:
    import io

    if path.exists():
        raise FileExistsError(f"{path} exists; figures are never overwritten (use a new out_dir)")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


# one colour + marker + hatch per mode, the same in every figure
MODE_STYLE = {"target": ("#1f77b4", "o", ""), "transfer": ("#d62728", "s", "//"), "source": ("#2ca02c", "^", ".."),
              "no_context": ("#7f7f7f", "v", "xx"), "native_injected": ("#9467bd", "D", "--")}
SERIES_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
                  "#7f7f7f")
SERIES_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


def series_style(i: int) -> dict:
    """Distinct colour and marker of the i-th series (cycles after 10)."""
    return {"color": SERIES_COLOURS[i % len(SERIES_COLOURS)], "marker": SERIES_MARKERS[i % len(SERIES_MARKERS)]}


def machine_label(summary: dict) -> str:
    """"AMD EPYC, 2 threads" (or "H200") from a summary's environment; older summaries: device + cpu_count."""
    env = summary.get("environment") or {}
    mach = env.get("machine") or {}
    if env.get("device", "cpu") != "cpu":
        return str(env["device"])
    cpu = mach.get("cpu") or "CPU"
    threads = mach.get("torch_threads") or env.get("cpu_count")
    return f"{cpu}, {threads} threads" if threads else cpu


def title(summary: dict, what: str, n: str | None = None) -> str:
    """"<pair>: <what> (<machine>[, n])" -- the first line of every figure's title."""
    extra = f", {n}" if n else ""
    return f"{summary.get('pair', '?')}: {what}\n({machine_label(summary)}{extra})"


def retention_bars(summary: dict, path: Path) -> Path | None:
    """Bars of each mode's score per task with paired-bootstrap SE error bars; gap closed (vs the no-context
    floor) ± SE, else retention, annotated. Every task of the summary is drawn (GSM8K included)."""
    tasks = {t: r for t, r in summary.get("tasks", {}).items() if r.get("target") is not None}
    if not tasks:
        return None
    names = list(tasks)
    modes = [m for m in ("target", "transfer", "source", "no_context") if any(tasks[t].get(m) is not None for t in names)]
    fig, ax = plt.subplots(figsize=(2.2 + 1.7 * len(names), 4.0))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        colour, _, hatch = MODE_STYLE[mode]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [tasks[t].get(mode) or 0 for t in names], width, label=mode, color=colour, hatch=hatch,
               edgecolor="white", yerr=[tasks[t].get(f"stderr_{mode}") or 0 for t in names], capsize=2,
               error_kw={"elinewidth": 0.8})
    for j, t in enumerate(names):
        r = tasks[t]
        top = max((r.get(m) or 0) + (r.get(f"stderr_{m}") or 0) for m in modes)
        if r.get("gap_closed") is not None:
            se = r.get("stderr_gap_closed")
            text = f"gap {100 * r['gap_closed']:.0f}" + (f"±{100 * se:.0f}%" if se is not None else "%")
        elif r.get("retention") is not None:
            text = f"ret. {100 * r['retention']:.0f}%"
        else:
            continue
        ax.annotate(text, (j, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), [f"{t}\n(n={tasks[t].get('n')})" for t in names], rotation=0, fontsize=8)
    ax.set_ylabel("score (± paired bootstrap SE)")
    ax.set_title(title(summary, f"score per task, k={summary.get('mapper', {}).get('k')}"), fontsize=9)
    ax.legend(fontsize=8, ncol=len(modes), loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return _save(fig, path)


def r2_heatmaps(matrices: dict[str, dict], path: Path, heading: str = "") -> Path | None:
    """Source x target single-source R² (K and V) per key space, side by side; `heading` (pair, machine,
    calibration) is the figure's title.

    matrices: {label: {"k": [L_t, L_s], "v": [L_t, L_s]}} e.g. {"stripped keys": ..., "rotated keys": ...}.
    """
    if not matrices:
        return None
    fig, axes = plt.subplots(1, 2 * len(matrices), figsize=(4.2 * 2 * len(matrices), 3.8), squeeze=False)
    col = 0
    for label, m in matrices.items():
        for kind in ("k", "v"):
            ax = axes[0, col]
            im = ax.imshow(m[kind].numpy(), aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis")
            ax.set_title(f"{'K' if kind == 'k' else 'V'} R², {label}", fontsize=9)
            ax.set_xlabel("source layer")
            ax.set_ylabel("target layer")
            col += 1
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="held-in R²")
    if heading:
        fig.suptitle(heading, fontsize=10, y=1.02)
    return _save(fig, path)


def r2_vs_k(rows: list[dict], path: Path, heading: str = "") -> Path | None:
    """Mean R² (K, V; train and held-out) against k (means over every target head: no SE, the fit is
    deterministic given the calibration)."""
    rows = [r for r in rows if "k_train" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = [str(r["k"]) for r in rows]
    for key, style in (("k_train", "o-"), ("k_heldout", "o--"), ("v_train", "s-"), ("v_heldout", "s--")):
        if key in rows[0]:
            ax.plot(labels, [r[key] for r in rows], style, label=key.replace("_", " "))
    ax.set_xlabel("k (source layers per target layer)")
    ax.set_ylabel("mean R²")
    ax.legend(fontsize=8)
    if heading:
        ax.set_title(heading, fontsize=9)
    return _save(fig, path)


def speedup_vs_tokens(rows: list[dict], path: Path, heading: str = "") -> Path | None:
    """Two panels against context length (log-x): the mapper's and the re-prefill's time (median, with the
    measured min-max as error bars), and the speedup (median ratio; bars from the extreme ratios
    prefill_min / mapper_max .. prefill_max / mapper_min)."""
    rows = [r for r in rows if r.get("speedup")]
    if not rows:
        return None
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(9, 3.6))
    tokens = [r["tokens"] for r in rows]

    def bars(key: str) -> tuple[list, list] | None:
        if not all(f"{key}_min" in r and f"{key}_max" in r for r in rows):
            return None
        return ([r[key] - r[f"{key}_min"] for r in rows], [r[f"{key}_max"] - r[key] for r in rows])

    for i, (key, label) in enumerate((("mapper_ms", "mapper"), ("prefill_ms", "target re-prefill"))):
        ax_t.errorbar(tokens, [r[key] for r in rows], yerr=bars(key), capsize=3, label=label, **series_style(i))
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("context tokens")
    ax_t.set_ylabel("ms (median, min–max)")
    ax_t.legend(fontsize=8)
    if bars("mapper_ms") and bars("prefill_ms"):
        lo = [r["speedup"] - r["prefill_ms_min"] / r["mapper_ms_max"] for r in rows]
        hi = [r["prefill_ms_max"] / r["mapper_ms_min"] - r["speedup"] for r in rows]
        yerr = [lo, hi]
    else:
        yerr = None
    ax_s.errorbar(tokens, [r["speedup"] for r in rows], yerr=yerr, capsize=3, label="measured", **series_style(1))
    if all(r.get("flop_ratio") for r in rows):
        ax_s.plot(tokens, [r["flop_ratio"] for r in rows], linestyle="--", label="FLOP ratio", **series_style(2))
    ax_s.set_xscale("log", base=2)
    ax_s.set_xlabel("context tokens")
    ax_s.set_ylabel("speedup (re-prefill / mapper)")
    ax_s.axhline(1, color="grey", lw=0.8)
    ax_s.set_ylim(bottom=0)
    ax_s.legend(fontsize=8)
    if heading:
        fig.suptitle(heading, fontsize=9)
    return _save(fig, path)


def drift_per_turn(rows: list[dict], path: Path, heading: str = "") -> Path | None:
    """Per-turn F1 of target and transfer (each protocol) in the multi-turn task, with ± SE bands over
    conversations where the rows carry `f1_se`. Series with identical points (the target's protocols read the
    same token stream) are drawn once, labelled with every protocol, so no legend entry is hidden."""
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.8))
    series: dict = {}
    for r in rows:
        series.setdefault(r["series"], []).append((r["turn"], r["f1"], r.get("f1_se")))
    merged: dict = {}
    for label, pts in series.items():
        key = tuple(sorted(pts))
        merged.setdefault(key, []).append(label)
    for i, (pts, labels) in enumerate(merged.items()):
        label = labels[0] if len(labels) == 1 else f"{labels[0].split(' (')[0]} ({', '.join(lb.split('(')[-1].rstrip(')') for lb in labels)})"
        style = series_style(i)
        turns, f1 = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(turns, f1, label=label, linestyle="-" if "target" in label else "--", **style)
        if all(p[2] is not None for p in pts):
            ax.fill_between(turns, [a - p[2] for a, p in zip(f1, pts)], [a + p[2] for a, p in zip(f1, pts)],
                            color=style["color"], alpha=0.15)
    n = sorted({r.get("n") for r in rows if r.get("n") is not None})
    ax.set_xlabel("turn")
    ax.set_ylabel("F1" + (" (± SE over conversations)" if all(r.get("f1_se") is not None for r in rows)
                          else " (no per-turn SE in this summary)"))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title((heading + ", " if heading else "") + f"conversations per turn: {'-'.join(map(str, n[:1] + n[-1:]))}",
                 fontsize=9)
    return _save(fig, path)


def fidelity_per_layer(fidelity: dict, path: Path, heading: str = "") -> Path | None:
    """Per target layer: attention-output cosine (mapped vs native cache) and K/V R², with KL in the title
    (means over the held-out sequences' tokens; no per-sequence SE is kept)."""
    per = fidelity.get("per_layer") or {}
    if not per.get("attn_cosine"):
        return None
    layers = range(len(per["attn_cosine"]))
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(layers, per["attn_cosine"], label="attention-output cosine", **series_style(0))
    ax.plot(layers, per["key_r2"], label="key R² (content space)", **series_style(1))
    ax.plot(layers, per["value_r2"], label="value R²", **series_style(2))
    ax.set_xlabel("target layer")
    ax.set_ylim(min(0.0, min(per["key_r2"] + per["value_r2"])), 1.02)
    ax.set_title((heading + "\n" if heading else "") + f"mapped vs native cache on {fidelity.get('sequences', '?')} "
                 f"held-out sequences (native sink {fidelity.get('native_sink', 0)}): "
                 f"KL {per['kl']:.3f} nats/token, top-1 {100 * per['top1_agreement']:.0f}%", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)
