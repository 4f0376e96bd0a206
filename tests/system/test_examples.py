"""Every example runs: short smoke runs of each script's main()."""

import importlib
import sys

import numpy as np
import pytest
from support import machine, paths, third_party

EXAMPLES = paths.EXAMPLES


@pytest.fixture(scope="module", autouse=True)
def examples_on_path():
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


def run(module_name, argv):
    module = importlib.import_module(module_name)
    with third_party.standard_promotion():  # examples are user code
        return module.main(argv)


def test_every_example_is_covered():
    helpers = {"char_lm", "multi_host_training"}  # modules the scripts import
    scripts = {p.stem for p in EXAMPLES.glob("*.py")} - helpers
    covered = {
        "train_char_lm",
        "compare_precisions",
        "compare_low_precision",
        "float8_policy",
        "linen_train_state",
        "clip_gradients",
        "pytorch_side_by_side",
        "optax_loop",
        "data_parallel",
        "multi_host",
        "fsdp_low_precision",
        "gpu_lowering",
    }  # multi_host and fsdp_low_precision run in tests/system/test_multiprocess.py
    assert scripts == covered


@pytest.mark.slow
def test_flagship_trains_and_writes_a_plot(tmp_path, capsys):
    plot = tmp_path / "training.png"
    summary = run("train_char_lm", ["--steps", "30", "--plot", str(plot), "--sample", "20"])
    assert plot.stat().st_size > 10_000
    assert summary["val_loss"] < 4.0
    out = capsys.readouterr()
    assert "Summary" in out.out
    assert "skipped steps" in out.out
    assert "30/30" in out.err  # the progress bar reached the end
    table = plot.with_suffix(".md").read_text().splitlines()
    assert table[:3] == ["| | |", "|---|---|", "| configuration | float16 + jaxscale |"]
    assert "| steps | 30 of 32x64 characters |" in table
    assert "| data-parallel devices | 256 |" in table
    assert f"| validation loss | {summary['val_loss']:.3f} nats/char |" in table
    assert f"| skipped steps | {int(summary['skipped_steps'])} |" in table


@pytest.mark.slow
def test_flagship_flags(tmp_path):
    summary = run(
        "train_char_lm",
        [
            "--steps",
            "12",
            "--precision",
            "float32",
            "--plot",
            str(tmp_path / "a.png"),
            "--sample",
            "0",
        ],
    )
    assert summary["final_scale"] == 1.0
    summary = run(
        "train_char_lm",
        [
            "--steps",
            "12",
            "--no-scaler",
            "--batch-size",
            "8",
            "--plot",
            str(tmp_path / "b.png"),
            "--sample",
            "0",
        ],
    )
    assert summary["final_scale"] == 1.0


@pytest.mark.slow
def test_low_precision_comparison(tmp_path):
    report = run("compare_low_precision", ["--steps", "8", "--plot", str(tmp_path / "d.png")])
    assert report.count("\n") == 6  # header, rule, five settings
    assert "bfloat16, float32 master weights" in report
    assert (tmp_path / "d.png").exists()
    assert (tmp_path / "d.md").read_text().strip() == report


@pytest.mark.slow
def test_float8_policy(tmp_path, capsys):
    argv = ["--recipe", "rowwise", "--steps", "4", "--bound", "0.0", "--keep-at-most", "0.2"]
    table = run("float8_policy", [*argv, "--table", str(tmp_path / "p.md")])
    lines = table.splitlines()
    assert len(lines) == 5  # header, rule, three settings
    assert lines[2].startswith("| bfloat16 | 0.0% |")
    assert lines[3].startswith("| rowwise, every layer | 89.5% |")
    assert "layers kept in bfloat16" in lines[4]
    assert (tmp_path / "p.md").read_text().strip() == table
    assert "proposal:" in capsys.readouterr().out


@pytest.mark.slow
def test_precision_comparison(tmp_path):
    report = run(
        "compare_precisions", ["--steps", "15", "--devices", "4", "--plot", str(tmp_path / "c.png")]
    )
    assert report.count("\n") == 4  # header, rule, three settings
    assert "float16 + jaxscale" in report
    assert (tmp_path / "c.png").exists()
    assert (tmp_path / "c.md").read_text() == report + "\n"


def test_gpu_lowering_reports_each_step(capsys):
    text = run("gpu_lowering", ["--platforms", "cuda", "tpu", "--steps",
                                "facade: optax triple, unscale_ + clip"])  # fmt: skip
    rows = [line for line in text.splitlines() if line.startswith("| facade")]
    # platform, loops, conditionals on data (on constants), host transfers, converts: the
    # conditionals on constants are what JAX leaves for XLA to fold (4 before JAX 0.12.1)
    cells = [row.split(" | ")[1:6] for row in rows]
    assert [[c[0], c[1], c[2].split()[0], c[3], c[4]] for c in cells] == [
        ["cuda", "0", "0", "0", "0 (0)"],
        ["tpu", "0", "0", "0", "0 (0)"],
    ]
    assert text in capsys.readouterr().out


def test_linen_train_state():
    result = run("linen_train_state", ["--steps", "20"])
    assert result["scale"] == 65536.0
    assert 0.0 < result["accuracy"] < 1.0


@pytest.mark.slow
def test_clip_gradients():
    results = run("clip_gradients", ["--steps", "10"])
    assert len(results) == 2


@pytest.mark.torch
def test_pytorch_side_by_side_trajectories_are_identical():
    torch_scales, jax_scales = run("pytorch_side_by_side", ["--steps", "40"])
    assert torch_scales == jax_scales
    assert len(set(jax_scales)) > 5  # the scale really moved


def test_optax_loop(capsys):
    module = importlib.import_module("optax_loop")
    sys.argv = ["optax_loop.py", "--steps", "20"]
    with third_party.standard_promotion():
        module.main()
    assert "step   19" in capsys.readouterr().out


def test_data_parallel_over_every_device(capsys):
    count = len(machine.every_device())  # 8 simulated on the CPU
    summary = run("data_parallel", ["--steps", "12", "--batch-size", "16"])
    out = capsys.readouterr().out
    assert f"{count} devices ({machine.PLATFORM}), global batch 16" in out
    assert f"(equal on all {count} devices: True)" in out
    assert summary["loss"] < 5.0
    assert summary["scale"] == 2.0**16


@pytest.mark.slow
def test_the_main_example_trains_in_nvfp4_with_a_key_for_each_step():
    char_lm = importlib.import_module("char_lm")  # the examples' folder is on the path
    config = char_lm.Config(precision="float8-nvfp4", scaler=False, steps=3)
    with third_party.standard_promotion():
        _, history, summary = char_lm.train(config)
    assert len(history.loss) == 3
    assert np.isfinite(history.loss).all()
    assert summary["val_loss"] < 5.0
