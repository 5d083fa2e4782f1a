"""Overlay the validation curves of several mapper training runs (one ``log.jsonl`` each) in one figure.

    python examples/plot_training_runs.py runs/mapper-self runs/mapper-layers --labels self layers \
        --out docs/proxy_comparison.png

One panel per keep ratio: validation mass recovery (solid) and top-K recall (dashed) against the optimizer step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from proxykv_hf.train.evaluate import read_log


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="training run directories (each holds log.jsonl)")
    p.add_argument("--labels", nargs="*", default=None)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.3, 0.5])
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)
    labels = ns.labels or [Path(r).name for r in ns.runs]
    if len(labels) != len(ns.runs):
        raise SystemExit("give one label per run")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ns.ratios), figsize=(4 * len(ns.ratios), 3.4), sharey=True)
    axes = [axes] if len(ns.ratios) == 1 else list(axes)
    for run, label, color in zip(ns.runs, labels, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        epochs = [r for r in read_log(Path(run) / "log.jsonl") if r["kind"] == "epoch"]
        steps = [r["step"] for r in epochs]
        for ax, ratio in zip(axes, ns.ratios):
            ax.plot(steps, [r[f"val_mass_recovery@{ratio:g}"] for r in epochs], "-o", color=color, ms=3,
                    label=f"{label} mass")
            ax.plot(steps, [r[f"val_topk_recall@{ratio:g}"] for r in epochs], "--s", color=color, ms=3,
                    label=f"{label} recall")
    for ax, ratio in zip(axes, ns.ratios):
        ax.set(title=f"rho = {ratio:g}", xlabel="optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ns.out, dpi=120)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
