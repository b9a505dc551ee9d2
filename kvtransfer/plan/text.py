"""The plan as text (a table, plain or markdown) and on disk (plan.json + plan.md)."""
from __future__ import annotations

from pathlib import Path

from .knobs import shell_overrides


def dur(seconds: float) -> str:
    """A duration, short: '42 s', '17 min', '3.9 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _header(plan: dict) -> list[str]:
    n, pr = plan["node"], plan["protocol"]
    cap = f"{n['gpus']} x {n['gpu_gib']:.1f} GiB GPU" if n["gpus"] else "no GPU"
    return [f"node {n['name']}: {cap}, host {n['host_gib']:.0f} GiB, disk {n['disk_gib']:.0f} GiB; device {n['device']}; "
            f"a stage fits within {100 * n['headroom']:.0f} % of each and plan.max_hours={plan['max_hours']:g}"
            + ("; model weights counted on the local disk" if n.get("weights_on_disk") else ""),
            f"protocol: {pr['n_sequences']} x {pr['seq_len']} tokens, stride {pr['stride']}, batch {pr['batch_size']}, "
            f"k={pr['k']}; Dx {pr['dx']:,}, Dy {pr['dy']:,}, p {pr['p']:,}, n {pr['observations']:,} "
            f"(p/n {pr['p_over_n']:.3f}); moments {pr['calib_dtype']} on {pr['store_device']}, accumulated "
            f"{pr['accumulate']} ({pr['moments_split_gib']:.1f} GiB train; held-out {pr['heldout_observations']:,} rows "
            f"of raw features, {pr['heldout_gib']:.1f} GiB), products {pr['compute_dtype']}, capture {pr['capture']}; "
            f"weights {pr['source_weights_gib']:.1f} + {pr['target_weights_gib']:.1f} GiB",
            f"times are estimates; rates: {plan['rates']['source']}"]


def _knob_lines(plan: dict, markdown: bool) -> list[str]:
    bullet = "- " if markdown else "  "
    if not plan["recommended"]:
        return []
    head = ("applied (the run sets these itself, none changes a number; plan.auto=false refuses instead):"
            if plan["applied"] else "recommended, not applied (plan.auto=false):")
    lines = ["", f"{head} {shell_overrides(plan['recommended'])}"]
    for e in plan["recommended"]:
        lines.append(f"{bullet}{e['set']}: {e['note']}")
    return lines


def verdict_line(plan: dict) -> str:
    """One line: 'fits, as typed' (the command runs as typed; the run applies its number-neutral knobs itself),
    or the refusal with the smallest node preset that would run it."""
    if plan.get("verdict") == "fits, as typed":
        extra = f" (the run applies {shell_overrides(plan['applied'])} itself)" if plan["applied"] else ""
        return f"verdict: fits, as typed{extra}"
    if plan.get("verdict") == "fits":
        return "verdict: fits with the knobs above (plan.auto=false: type them)"
    who = plan.get("smallest_node")
    return (f"verdict: refused ({', '.join(plan['refused'])}); smallest node preset that runs it: {who}" if who else
            f"verdict: refused ({', '.join(plan['refused'])}); no node preset runs it")


def _table(plan: dict, markdown: bool) -> list[str]:
    head = ["stage", "GPU GiB", "host GiB", "disk GiB", "time (est.)", "fits", "as typed"]
    rows = []
    for name, st in plan["stages"].items():
        fits = "yes" if st["fits"] else "NO (" + ", ".join(st["over"]) + ")"
        if st["over_time"]:
            fits += f"; over {plan['max_hours']:g} h"
        typed = "fits" if st["as_typed"]["fits"] else "over (" + ", ".join(st["as_typed"]["over"]) + ")"
        rows.append([name + ("" if st["requested"] else " *"), f"{st['gpu_gib']:.1f}", f"{st['host_gib']:.1f}",
                     f"{st['disk_gib']:.1f}", dur(st["seconds"]), fits, typed])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        out = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in [head, *rows]]
    if any(not st["requested"] for st in plan["stages"].values()):
        out.append("* not requested by this run (planned as if run alone)")
    return out


def format_plan(plan: dict, *, markdown: bool = False, details: bool = True) -> str:
    """The plan as a table (plain text or markdown), the knobs applied, the refused stages and notes."""
    lines = [f"{'## ' if markdown else ''}Resource plan: {plan['pair']} ({plan['source']} -> {plan['target']})", "",
             *_header(plan), "", *_table(plan, markdown), *_knob_lines(plan, markdown), "", verdict_line(plan)]
    bullet = "- " if markdown else "  "
    for name, reason in plan["refused"].items():
        lines.append(f"{bullet}REFUSED {name}: {reason}")
    for name, st in plan["stages"].items():
        for note in st.get("notes", []):
            lines.append(f"{bullet}note ({name}): {note}")
    if details and markdown:
        lines += ["", "<details><summary>what each peak is made of (GiB; seconds)</summary>", ""]
        for name, st in plan["stages"].items():
            for res, part in st["parts"].items():
                if part:
                    lines.append(f"- {name} {res}: " + ", ".join(f"{k} {v:,.2f}" for k, v in part.items()))
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def write_plan(plan: dict, out_dir) -> None:
    """plan.json + plan.md into out_dir (atomic)."""
    from ..core.io import atomic_write_bytes, atomic_write_json

    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "plan.json", plan)
    atomic_write_bytes(out_dir / "plan.md", format_plan(plan, markdown=True).encode())
