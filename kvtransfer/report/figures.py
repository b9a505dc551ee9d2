"""PNG figures of a run: retention bars, R² heatmaps, R² vs k, speedup vs tokens, multi-turn drift."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..io import atomic_write_bytes  # noqa: E402


def _save(fig, path: Path) -> Path:
    import io

    if path.exists():
        raise FileExistsError(f"{path} exists; figures are never overwritten (use a new out_dir)")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def retention_bars(summary: dict, path: Path) -> Path | None:
    """Bars of target / transfer / source score per task (retention % annotated)."""
    tasks = {t: r for t, r in summary.get("tasks", {}).items() if r.get("target") is not None}
    if not tasks:
        return None
    names = list(tasks)
    modes = [m for m in ("target", "transfer", "source", "no_context") if any(tasks[t].get(m) is not None for t in names)]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(names), 3.6))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [tasks[t].get(mode) or 0 for t in names], width, label=mode)
    for j, t in enumerate(names):
        if tasks[t].get("retention") is not None:
            ax.annotate(f"{100 * tasks[t]['retention']:.0f}%", (j, max(tasks[t].get(m) or 0 for m in modes)),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("score")
    ax.set_title(f"{summary['pair']}: retention per task (k={summary['mapper']['k']})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def r2_heatmaps(matrices: dict[str, dict], path: Path) -> Path | None:
    """Source x target single-source R² (mean of K and V) per key space, side by side.

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
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    return _save(fig, path)


def r2_vs_k(rows: list[dict], path: Path) -> Path | None:
    """Mean R² (K, V; train and held-out) against k."""
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
    return _save(fig, path)


def speedup_vs_tokens(rows: list[dict], path: Path, title: str = "") -> Path | None:
    """Speedup of mapping over re-prefill against context length (log-x)."""
    rows = [r for r in rows if r.get("speedup")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["tokens"] for r in rows], [r["speedup"] for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("speedup (re-prefill / mapper)")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def drift_per_turn(rows: list[dict], path: Path) -> Path | None:
    """Per-turn F1 of target and transfer (each protocol) in the multi-turn task."""
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    series: dict = {}
    for r in rows:
        series.setdefault(r["series"], []).append((r["turn"], r["f1"]))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("F1")
    ax.legend(fontsize=8)
    return _save(fig, path)


def fidelity_per_layer(fidelity: dict, path: Path) -> Path | None:
    """Per target layer: attention-output cosine (mapped vs native cache) and K/V R², with KL in the title."""
    per = fidelity.get("per_layer") or {}
    if not per.get("attn_cosine"):
        return None
    layers = range(len(per["attn_cosine"]))
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(layers, per["attn_cosine"], marker="o", label="attention-output cosine")
    ax.plot(layers, per["key_r2"], marker=".", label="key R² (content space)")
    ax.plot(layers, per["value_r2"], marker=".", label="value R²")
    ax.set_xlabel("target layer")
    ax.set_ylim(min(0.0, min(per["key_r2"] + per["value_r2"])), 1.02)
    ax.set_title(f"mapped vs native cache (native sink {fidelity.get('native_sink', 0)}): "
                 f"KL {per['kl']:.3f} nats/token, top-1 {100 * per['top1_agreement']:.0f}%", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)
