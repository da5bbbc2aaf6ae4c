"""The one table `benchmarks/gpu_check.sh` ends with: P1-P4 of both paths and their targets.

Reads what the script's steps wrote under OUT: `kernels.csv` (the JAX kernels' P1: the
worst gather and scatter ratio per backend over the card's sizes, 8-64 KiB pages and
>= 256 blocks, or over every row when none is that large, as in a dry run) and
`gpu_paths.csv` (P1 of the vLLM worker path, P2-P4 of both). A missing file is a row
saying so. The verdict is only a verdict on a GPU; on CPU every row says "dry run".

    python benchmarks/_gpu_table.py OUT
"""

from __future__ import annotations

import csv
import pathlib
import sys


def _rows(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def kernel_rows(out: pathlib.Path) -> list[dict]:
    rows = _rows(out / "kernels.csv")
    card = [r for r in rows if int(r["blocks"]) >= 256 and 8 <= int(r["page_kib"]) <= 64]
    picked, note = (card, "card sizes") if card else (rows, "below the card's sizes")
    out_rows = []
    for backend in dict.fromkeys(r["backend"] for r in picked):
        mine = [r for r in picked if r["backend"] == backend]
        for kind in ("gather", "scatter"):
            worst = min(mine, key=lambda r: float(r[f"{kind}_vs_copy"]))
            case = f"{worst['layers']} L x {worst['page_kib']} KiB x {worst['blocks']}"
            out_rows.append({
                "check": "P1",
                "path": f"JAX kernels ({backend})",
                "what": f"{kind} vs device copy, worst of {len(mine)} ({note})",
                "case": case,
                "ratio": float(worst[f"{kind}_vs_copy"]),
                "target": 0.85,
            })  # fmt: skip
    return out_rows


def table(out: pathlib.Path, platform: str) -> str:
    rows = kernel_rows(out)
    for r in _rows(out / "gpu_paths.csv"):
        rows.append({**r, "ratio": float(r["ratio"]), "target": float(r["target"])})
    missing = [n for n in ("kernels.csv", "gpu_paths.csv") if not (out / n).exists()]
    lines = [
        f"{'check':<5} {'path':<30} {'what':<52} {'case':<20} {'ratio':>8} {'target':>7}  verdict"
    ]
    for r in sorted(rows, key=lambda r: r["check"]):
        if platform == "cpu":
            verdict = "dry run (CPU)"
        else:
            verdict = "meets" if r["ratio"] >= r["target"] else "MISSES"
        lines.append(
            f"{r['check']:<5} {r['path']:<30} {r['what']:<52} {r['case']:<20} "
            f"{r['ratio']:>7.2f}x {r['target']:>6.2f}x  {verdict}"
        )
    for name in missing:
        lines.append(f"(no {name}: its step failed or timed out; see its log under {out})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: _gpu_table.py OUT [PLATFORM]", file=sys.stderr)
        return 2
    out = pathlib.Path(argv[0])
    platform = argv[1] if len(argv) == 2 else "gpu"
    print(table(out, platform))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
