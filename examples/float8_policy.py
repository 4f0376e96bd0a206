"""Which layers to keep in bfloat16: every layer in a recipe, against the layers
jaxscale.float8_report proposes, against bfloat16.

Trains the character-level transformer of ``char_lm.py`` three times: in bfloat16,
with every linear layer in the recipe, and with the layers ``float8_report`` proposes
kept in bfloat16 (measured on the model as initialised, on one training batch). Prints
the report and writes a markdown table (validation loss, its gap to bfloat16's, and the
share of matmul FLOPs in the recipe).

    python examples/float8_policy.py --recipe nvfp4 --keep-at-most 0.15
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import char_lm
import jax
from compare_precisions import train_with_progress

import jaxscale


def proposal(recipe: str, bound: float, keep_at_most: float,
             dataset: char_lm.Dataset) -> jaxscale.casting.Float8Report:  # fmt: skip
    """``float8_report`` of the model as initialised, on the first training batch."""
    config = char_lm.Config(precision="bfloat16", scaler=False)
    model, _, _ = char_lm.build(config, dataset)
    x, y = next(dataset.batches("train", config.batch_size, config.seq_len, seed=config.seed))
    key = jax.random.key(0) if recipe == "nvfp4" else None
    return jaxscale.float8_report(char_lm.loss_fn, model, x, y, recipe=recipe, bound=bound,
                                  keep_at_most=keep_at_most, key=key)  # fmt: skip


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="nvfp4",
                        choices=[p.removeprefix("float8-") for p in char_lm.PRECISIONS
                                 if p.startswith("float8-")])  # fmt: skip
    parser.add_argument("--bound", type=float, default=0.0,
                        help="the largest relative error left in the recipe")  # fmt: skip
    parser.add_argument("--keep-at-most", type=float, default=0.15,
                        help="the largest share of matmul FLOPs kept in bfloat16")  # fmt: skip
    parser.add_argument("--steps", type=int, default=char_lm.Config().steps)
    parser.add_argument("--table", type=pathlib.Path, default=None,
                        help="the table's path (default float8_policy_RECIPE.md)")  # fmt: skip
    args = parser.parse_args(argv)
    dataset = char_lm.Dataset.load()
    report = proposal(args.recipe, args.bound, args.keep_at_most, dataset)
    print(report.table())
    precision = f"float8-{args.recipe}"
    runs = [
        ("bfloat16", char_lm.Config(precision="bfloat16", scaler=False, steps=args.steps), 0.0),
        (f"{args.recipe}, every layer",
         char_lm.Config(precision=precision, scaler=False, steps=args.steps),
         sum(m.flops for m in report.matmuls)),
        (f"{args.recipe}, {len(report.kept)} layers kept in bfloat16",
         char_lm.Config(precision=precision, scaler=False, steps=args.steps,
                        float8_filter=report.proposed_filter(),
                        float8_filter_label="proposed"),
         report.float8_flops),
    ]  # fmt: skip
    rows = []
    for label, config, flops in runs:
        print(f"  training {label} ...", flush=True)
        _, _, summary = train_with_progress(config, dataset)
        rows.append((label, summary, flops))
    reference = rows[0][1]["val_loss"]
    lines = [
        "| setting | matmul FLOPs in the recipe | val loss | against bfloat16 | val accuracy |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {label} | {flops:.1%} | {s['val_loss']:.4f} | {s['val_loss'] - reference:+.4f} | "
        f"{s['val_accuracy']:.1%} |"
        for label, s, flops in rows
    ]
    table = "\n".join(lines)
    print("\n" + table)
    path = args.table or pathlib.Path(f"float8_policy_{args.recipe}.md")
    path.write_text(table + "\n")
    print(f"\ntable: {path}")
    return table


if __name__ == "__main__":
    main()
