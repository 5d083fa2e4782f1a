"""``proxykv calibrate``: a trained mapper with the global budget's quantile table of a dataset's oracle scores
(:mod:`proxykv_hf.train.quantiles`), written as a new checkpoint directory; the mapper read is left as it is.

    proxykv calibrate --mapper proxykv-qwen2.5-coder-1.5b-instruct --data data/qwen-pair --out runs/qwen-calibrated
"""

from __future__ import annotations

from pathlib import Path

from .helpers import add_out_arg, checkpoint_arg


def cmd_calibrate(ns) -> int:
    from ..mapper.checkpoint import save_checkpoint
    from ..mapper.hub import load_checkpoint
    from ..models.file_errors import writing
    from ..train.quantiles import calibrated
    from ..train.shards import write_whole

    ckpt = calibrated(load_checkpoint(ns.mapper), ns.data)
    out = Path(ns.out)
    with writing(out):  # --out was checked to be new or empty; it appears whole or not at all
        write_whole(out, lambda tmp: save_checkpoint(ckpt, tmp))
    table = ckpt.global_quantiles
    print(f"{out}: {ns.mapper} with the quantile table of {ns.data} ({table.shape[0]} layers x {table.shape[1]} "
          f"KV heads x {table.shape[2]} points)")
    return 0


def add_calibrate(sub) -> None:
    """The ``calibrate`` subcommand's parser."""
    p = sub.add_parser("calibrate", help="add the global budget's quantile table, fitted on a dataset's oracle "
                                         "scores, to a mapper trained without one (written as a new checkpoint)")
    p.add_argument("--mapper", required=True, type=checkpoint_arg,
                   help="mapper checkpoint: a directory, a bundled checkpoint's name or a Hub id")
    p.add_argument("--data", required=True, help="a dataset from build-data for the mapper's target (its oracle "
                                                 "scores; the train split)")
    add_out_arg(p, "calibrate", "directory of the calibrated checkpoint", required=True)
    p.set_defaults(fn=cmd_calibrate)
