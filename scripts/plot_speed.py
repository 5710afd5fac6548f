"""Draw docs/speed.png: hfspec's defaults against plain transformers and llama.cpp, from the numbers in
docs/benchmarks.md (the Qwen2.5-Coder pair on an Intel Xeon, Sapphire Rapids; the offline SmolLM2 pair on an AMD
EPYC; 2 threads each). Edit the table below when a new run replaces them, then run `python scripts/plot_speed.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Speed-up over plain transformers generate() (median of per-prompt ratios), as docs/benchmarks.md gives them.
# None: not run in that setting (llama.cpp runs greedy only, and only on the GGUF pair).
SETTINGS = ["Qwen 1.5B + 0.5B\ncode, greedy", "Qwen 1.5B + 0.5B\ncode, T = 0.7", "Qwen 1.5B + 0.5B\nedits, greedy",
            "SmolLM2-135M + head\nchat, greedy", "SmolLM2-135M + head\nchat, T = 0.7"]  # fmt: skip
CONTENDERS = {
    "plain transformers": [1.0, 1.0, 1.0, 1.0, 1.0],
    "transformers assisted": [None, None, None, 0.73, 0.62],
    "llama.cpp": [3.04, None, 3.45, None, None],
    "hfspec (defaults)": [3.37, 3.62, 3.92, 2.37, 2.33],
}
COLOURS = {"plain transformers": "#9e9e9e", "transformers assisted": "#c7a26b", "llama.cpp": "#6b8fc7",
           "hfspec (defaults)": "#2e7d32"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "speed.png")
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    width = 0.8 / len(CONTENDERS)
    for i, (name, values) in enumerate(CONTENDERS.items()):
        xs = [x + (i - (len(CONTENDERS) - 1) / 2) * width for x, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        bars = ax.bar(xs, ys, width, label=name, color=COLOURS[name])
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=1)
    ax.set_xticks(range(len(SETTINGS)), SETTINGS, fontsize=8)
    ax.set_ylabel("× plain transformers")
    ax.set_title("Tokens per second over plain transformers generate(), 2 CPU threads", fontsize=10)
    ax.legend(fontsize=8, frameon=False, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_ylim(0, 4.6)
    fig.tight_layout()
    fig.savefig(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
