#!/usr/bin/env python3
"""freight's GPU benchmark figures against the ceilings and NIXL, measured in the same run.

Reads three JSON documents whose "rows" share one shape,

  {"system": "freight"|"nixl"|"ceiling", "test": ..., "op": "WRITE"|"READ", "block": bytes,
   "count": n, "gbps": float|null, "p50_us": float|null, "p99_us": float|null}

(freight's from its GPU benchmark, NIXL's from bench/peers/nixl_p2p.py, the ceilings from
bench/peers/ceilings.py), checks each target, prints a short table last, writes the same
as markdown and plots GB/s against the block size.

    python3 bench/gpu_report.py --freight freight.json --nixl nixl.json \\
        --ceilings ceilings.json --out-md gpu.md --plot gpu.png --machine "2 x H200"

Targets (same host, two processes, one GPU each):
  bw       VRAM->VRAM WRITE and READ at each block size >= 95% of the SM copy kernel's
           ceiling at that block size (>= 90% at 4 KiB); the READ ceiling is the pulling
           kernel's where measured, else the WRITE one
  bw       freight / NIXL >= 1.15 at 32 MiB blocks, >= 1.3 at 16 KiB and 4 KiB
  oneshot  128 x 32 MiB created and posted each time: >= 1.3x NIXL, same lists as bw
  lat4k    one 4 KiB WRITE, post to DONE: p50 <= 12 us, p99 <= 25 us
  notif4k  notification seen by the target after a 4 KiB WRITE: p50 <= 20 us
  h2d/d2h  DRAM -> VRAM and VRAM -> DRAM across processes >= 90% of pinned cudaMemcpyAsync
  tcp      VRAM -> VRAM over tcp loopback >= 80% of DRAM -> DRAM over tcp loopback

Where one figure has several rows (bw in sequential and in random block order, say), the
lowest of freight's and the highest of NIXL's and of the ceilings' are used, so that no
choice of rows flatters freight; the notes name the order of the rows used.

A figure that is missing from the inputs (or recorded with an error) is shown as "-" with
"not measured"; the report never fails on it. Needs matplotlib only for --plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import BW_CASES, KIB, MIB, PERCENTILE, human, logger  # noqa: E402

NIXL_RATIOS = {32 * MIB: 1.15, 16 * KIB: 1.3, 4 * KIB: 1.3}
ONESHOT = (32 * MIB, 128)


log = logger("gpu_report")


def load(path: Path | None, what: str) -> dict:
    """The document at path, or an empty one (with a note) if it cannot be read."""
    if path is None:
        log(f"no {what} file given: its figures are not measured")
        return {"rows": []}
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        log(f"cannot read {what} file {path}: {e}")
        return {"rows": []}
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        log(f"{what} file {path} has no list of rows")
        return {"rows": []}
    return doc


class Rows:
    """Rows of all inputs, looked up by system, test, op and block."""

    def __init__(self, *docs: dict):
        self.rows = [r for d in docs for r in d["rows"] if isinstance(r, dict)]

    def find(self, system: str, test: str, op: str | None = None, block: int | None = None,
             count: int | None = None, engine: str | None = None, order: str | None = None) -> dict | None:
        """The matching row. Among several: those with `count` blocks if any, else those with
        the most blocks; then, where they differ in GB/s (e.g. sequential and random block
        order), freight's lowest figure and the peer's or the ceiling's highest, so that no
        choice of rows flatters freight. A row with an error is returned only when no row
        has a figure (value() then gives None and the note says why)."""
        hits = [r for r in self.rows
                if r.get("system") == system and r.get("test") == test
                and (op is None or r.get("op") == op)
                and (block is None or r.get("block") == block)
                and (engine is None or r.get("engine", engine) == engine)
                and (order is None or r.get("order", order) == order)]
        if not hits:
            return None
        pool = [r for r in hits if count is not None and r.get("count") == count] or hits
        good = [r for r in pool if value(r, "gbps") is not None or value(r, "p50_us") is not None]
        if not good:
            return pool[0]
        most = max(r.get("count") or 0 for r in good)
        good = [r for r in good if (r.get("count") or 0) == most]
        rated = [r for r in good if value(r, "gbps") is not None]
        if not rated:
            return good[0]
        pick = min if system == "freight" else max
        return pick(rated, key=lambda r: value(r, "gbps"))


def value(row: dict | None, key: str) -> float | None:
    if row is None or row.get("error"):
        return None
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def why_missing(*pairs: tuple[str, dict | None]) -> str:
    """'not measured' with which input lacked the figure."""
    parts = []
    for name, row in pairs:
        if row is None:
            parts.append(f"no {name} row")
        elif row.get("error"):
            parts.append(f"{name}: {str(row['error'])[:80]}")
        else:
            parts.append(f"no {name} figure")
    return "not measured (" + "; ".join(parts) + ")" if parts else "not measured"


def check(name: str, value_text: str, target: str, met: bool | None, note: str = "") -> dict:
    return {"check": name, "value": value_text, "target": target, "met": met, "note": note}


def ratio_check(name: str, target: str, threshold: float, num: tuple[str, dict | None, str],
                den: tuple[str, dict | None, str]) -> dict:
    """num / den >= threshold, where each is (label, row, key)."""
    a, b = value(num[1], num[2]), value(den[1], den[2])
    if a is None or b is None or b <= 0:
        missing = [(num[0], num[1])] if a is None else []
        missing += [(den[0], den[1])] if b is None or b <= 0 else []
        return check(name, "-", target, None, why_missing(*missing))
    r = a / b

    def order(row: dict) -> str:
        return f" ({row['order']} order)" if isinstance(row.get("order"), str) else ""

    return check(name, f"{r:.3f}x", target, r >= threshold,
                 f"{num[0]} {a:.1f} GB/s{order(num[1])}, {den[0]} {b:.1f} GB/s{order(den[1])}")


def limit_check(name: str, target: str, limit: float, row: dict | None, key: str) -> dict:
    v = value(row, key)
    if v is None:
        return check(name, "-", target, None, why_missing(("freight", row)))
    return check(name, f"{v:.1f} us", target, v <= limit)


def same_lists(rows: Rows, test: str, op: str, block: int, count: int) -> tuple[dict | None, dict | None]:
    """freight's and NIXL's rows for the same descriptor lists: for each block order both
    measured, the pair; the order where freight's ratio to NIXL is lowest decides."""
    pairs = [(rows.find("freight", test, op, block, count, order=o),
              rows.find("nixl", test, op, block, count, order=o)) for o in ("sequential", "random")]
    pairs = [(f, n) for f, n in pairs if value(f, "gbps") and value(n, "gbps")]
    if pairs:
        return min(pairs, key=lambda p: value(p[0], "gbps") / value(p[1], "gbps"))
    return rows.find("freight", test, op, block, count), rows.find("nixl", test, op, block, count)


def checks(rows: Rows) -> list[dict]:
    out = []
    for op in ("WRITE", "READ"):
        for block, count in BW_CASES:
            need = 0.90 if block == 4 * KIB else 0.95
            # The ceiling kernel visits blocks in random order: compare like with like.
            fr = rows.find("freight", "bw", op, block, count, order="random")
            ceil = rows.find("ceiling", "bw", op, block, count, engine="sm")
            label = f"SM ceiling ({op})"
            if value(ceil, "gbps") is None and op == "READ":
                ceil = rows.find("ceiling", "bw", "WRITE", block, count, engine="sm")
                label = "SM ceiling (WRITE)"
            out.append(ratio_check(f"bw {op} {human(block)} vs SM ceiling", f">= {need:.2f}x", need,
                                   ("freight", fr, "gbps"), (label, ceil, "gbps")))
    for op in ("WRITE", "READ"):
        for block, count in BW_CASES:
            if block not in NIXL_RATIOS:
                continue
            need = NIXL_RATIOS[block]
            fr, nx = same_lists(rows, "bw", op, block, count)
            out.append(ratio_check(f"bw {op} {human(block)} vs NIXL", f">= {need:.2f}x", need,
                                   ("freight", fr, "gbps"), ("NIXL", nx, "gbps")))
    block, count = ONESHOT
    fr, nx = same_lists(rows, "oneshot", "WRITE", block, count)
    out.append(ratio_check(f"oneshot {count} x {human(block)} vs NIXL", ">= 1.30x", 1.3,
                           ("freight", fr, "gbps"), ("NIXL", nx, "gbps")))
    lat = rows.find("freight", "lat4k", "WRITE", 4 * KIB)
    out.append(limit_check("lat4k WRITE post to DONE, p50", "<= 12 us", 12.0, lat, "p50_us"))
    out.append(limit_check("lat4k WRITE post to DONE, p99", "<= 25 us", 25.0, lat, "p99_us"))
    nixl_lat = rows.find("nixl", "lat4k", "WRITE", 4 * KIB)
    for c, key in ((out[-2], "p50_us"), (out[-1], "p99_us")):
        if c["met"] is not None and value(nixl_lat, key) is not None:
            c["note"] = f"NIXL {key[:3]} {value(nixl_lat, key):.1f} us"
    notif = limit_check("notif4k seen by the target, p50", "<= 20 us", 20.0,
                        rows.find("freight", "notif4k", "WRITE", 4 * KIB), "p50_us")
    nixl_notif = rows.find("nixl", "notif4k", "WRITE", 4 * KIB)
    if value(nixl_notif, "p50_us") is not None and notif["met"] is not None:
        notif["note"] = f"NIXL p50 {value(nixl_notif, 'p50_us'):.1f} us"
    out.append(notif)
    for test, op, what in (("h2d", "WRITE", "DRAM -> VRAM"), ("d2h", "READ", "VRAM -> DRAM")):
        out.append(ratio_check(f"{test} {what} vs pinned {test.upper()}", ">= 0.90x", 0.9,
                               ("freight", rows.find("freight", test, op), "gbps"),
                               (f"pinned {test.upper()}", rows.find("ceiling", test, op), "gbps")))
        nixl = value(rows.find("nixl", test, op), "gbps")
        if nixl is not None and out[-1]["met"] is not None:
            out[-1]["note"] += f"; NIXL {nixl:.2f} GB/s"
    for op in ("WRITE", "READ"):
        out.append(ratio_check(f"tcp {op} VRAM<->VRAM vs DRAM<->DRAM", ">= 0.80x", 0.8,
                               ("VRAM", rows.find("freight", "tcp_vram", op), "gbps"),
                               ("DRAM", rows.find("freight", "tcp_dram", op), "gbps")))
    return out


VERDICT = {True: "met", False: "MISSED", None: "-"}


def text_table(cs: list[dict]) -> str:
    rows = [("Target", "Value", "Required", "Result", "Note")] + [
        (c["check"], c["value"], c["target"], VERDICT[c["met"]], c["note"]) for c in cs]
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return "\n".join(lines)


def bandwidth_table(rows: Rows) -> list[str]:
    """Markdown: GB/s of each system at each block size."""
    out = ["| op | blocks | freight | NIXL | SM ceiling | freight / NIXL | freight / ceiling |",
           "| --- | --- | --- | --- | --- | --- | --- |"]

    def f(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:.1f}{unit}"

    for op in ("WRITE", "READ"):
        for block, count in BW_CASES:
            fr = value(rows.find("freight", "bw", op, block, count), "gbps")
            nx = value(rows.find("nixl", "bw", op, block, count), "gbps")
            ce = value(rows.find("ceiling", "bw", op, block, count, engine="sm"), "gbps")
            if ce is None:
                ce = value(rows.find("ceiling", "bw", "WRITE", block, count, engine="sm"), "gbps")
            out.append(f"| {op} | {count} x {human(block)} | {f(fr)} | {f(nx)} | {f(ce)} | "
                       f"{'-' if fr is None or not nx else f'{fr / nx:.2f}x'} | "
                       f"{'-' if fr is None or not ce else f'{fr / ce:.2f}x'} |")
    return out


def markdown(cs: list[dict], rows: Rows, machine: str, docs: dict) -> str:
    met = sum(1 for c in cs if c["met"] is True)
    missed = sum(1 for c in cs if c["met"] is False)
    absent = sum(1 for c in cs if c["met"] is None)
    lines = [f"### GPU targets on {machine}", "",
             f"{met} met, {missed} missed, {absent} not measured.", ""]
    nixl_v = docs["nixl"].get("nixl_version")
    if nixl_v:
        lines += [f"NIXL {nixl_v} over UCX "
                  f"(UCX_TLS={docs['nixl'].get('config', {}).get('ucx_tls', '?')}), "
                  "two processes, one GPU each.", ""]
    lines += [f"Percentiles and medians, freight's and NIXL's alike: {PERCENTILE}.", ""]
    lines += ["| target | value | required | result | note |", "| --- | --- | --- | --- | --- |"]
    for c in cs:
        result = {True: "met", False: "**MISSED**", None: "-"}[c["met"]]
        note = c["note"].replace("|", "\\|")
        lines.append(f"| {c['check']} | {c['value']} | {c['target']} | {result} | {note} |")
    lines += ["", "Bandwidth, GB/s (bytes / median time of one request):", ""]
    lines += bandwidth_table(rows)
    return "\n".join(lines) + "\n"


def plot(rows: Rows, path: Path, machine: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; no plot written to {path}")
        return False
    series = [("freight WRITE", "freight", "WRITE", None, "C0", "-", "o"),
              ("freight READ", "freight", "READ", None, "C0", "--", "s"),
              ("NIXL WRITE", "nixl", "WRITE", None, "C1", "-", "o"),
              ("NIXL READ", "nixl", "READ", None, "C1", "--", "s"),
              ("SM ceiling", "ceiling", "WRITE", "sm", "0.3", ":", "^")]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    drawn = 0
    for label, system, op, engine, color, style, marker in series:
        pts = []
        for block, count in sorted(BW_CASES):
            v = value(rows.find(system, "bw", op, block, count, engine=engine), "gbps")
            if v is not None:
                pts.append((block, v))
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=color, linestyle=style, marker=marker, label=label)
            drawn += 1
    blocks = sorted(b for b, _ in BW_CASES)
    ax.set_xscale("log", base=2)
    ax.set_xticks(blocks)
    ax.set_xticklabels([human(b).replace(" ", "") for b in blocks])
    ax.set_xlabel("block size")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"GPU 0 -> GPU 1, two processes: {machine}", fontsize=10)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no bandwidth figures", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--freight", type=Path, help="freight's GPU benchmark JSON (rows with system freight)")
    ap.add_argument("--nixl", type=Path, help="JSON of bench/peers/nixl_p2p.py")
    ap.add_argument("--ceilings", type=Path, help="JSON of bench/peers/ceilings.py")
    ap.add_argument("--out-md", type=Path, help="markdown file to write (the table and GB/s by block)")
    ap.add_argument("--plot", type=Path, help="PNG of GB/s against block size (needs matplotlib)")
    ap.add_argument("--machine", default="this machine", help="name of the machine for the report")
    args = ap.parse_args()

    docs = {"freight": load(args.freight, "freight"), "nixl": load(args.nixl, "NIXL"),
            "ceilings": load(args.ceilings, "ceilings")}
    rows = Rows(*docs.values())
    cs = checks(rows)
    if args.out_md:
        args.out_md.parent.mkdir(parents=True, exist_ok=True)
        args.out_md.write_text(markdown(cs, rows, args.machine, docs))
        log(f"wrote {args.out_md}")
    if args.plot and plot(rows, args.plot, args.machine):
        log(f"wrote {args.plot}")
    print(f"\nfreight GPU targets on {args.machine}\n")
    print(text_table(cs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
