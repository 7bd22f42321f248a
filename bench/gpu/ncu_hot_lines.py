"""The SASS lines with the most warp-stall samples in an Nsight Compute source page
(ncu -i R --page source --csv --print-source sass), with each line's top stall reasons.

    python3 bench/gpu/ncu_hot_lines.py source.csv [N]
"""
import csv
import sys


def main():
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    text = open(sys.argv[1], errors="replace").read().splitlines()
    # The page may hold several kernels, each a header row and its lines: split on headers.
    start = [i for i, line in enumerate(text) if line.startswith('"#') or line.startswith('"Address"')]
    blocks = [text[a:b] for a, b in zip(start, start[1:] + [len(text)])] or [text]
    for lines in blocks:
        rows = list(csv.DictReader(lines))
        if not rows:
            continue
        col = next((c for c in rows[0] if c.startswith("Warp Stall Sampling (All")), None)
        if col is None:
            print("no stall-sampling column; columns:", list(rows[0])[:12])
            continue
        stall_cols = [c for c in rows[0] if c.startswith("stall_") or c.startswith("Stall")]
        total = sum(float(r[col] or 0) for r in rows)
        print(f"-- {len(rows)} SASS lines, {total:.0f} samples")
        for r in sorted(rows, key=lambda r: -float(r[col] or 0))[:n]:
            v = float(r[col] or 0)
            if v == 0:
                break
            why = sorted(((float(r[c] or 0), c) for c in stall_cols), reverse=True)[:3]
            why = " ".join(f"{c}={x:.0f}" for x, c in why if x > 0)
            print(f"{v / max(total, 1) * 100:5.1f}% {r.get('Address', '')[:8]:>8s} {r.get('Source', '')[:70]:70s} {why}")


if __name__ == "__main__":
    main()
