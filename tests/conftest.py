"""Test configuration: strict dtype promotion and eight simulated CPU devices.

Strict promotion turns every silent float16 -> float32 promotion (the bug class a
loss scaler invites) into an error. The device count must be set before JAX
creates its backends, hence before anything imports jax.
"""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

# JAX's persistent compilation cache, shared by the workers of a run and by the processes
# the tests start (notebook kernels, multi-process jobs inherit the variable): many tests
# compile a program another test compiled already (one model under several assertions,
# the same recipe in two layers' tests), and a cache hit loads the executable XLA made
# the first time. Every program is compiled as before on a clean clone; a later run on
# the same machine compiles only what changed. A cache set in the environment wins.
_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def _threefry_unrolled_on_the_cpu() -> None:
    """JAX lowers its Threefry hash on the CPU as a loop over the rounds (elsewhere, as
    the rounds written out). The loop is slow to compile, the more so the higher the
    draw's rank: every parameter initialiser and random input in the suite draws with it
    (measured: `lecun_normal` of a (3, 3, 8, 16) kernel compiled in 0.75 s with the loop
    and 0.09 s without). The tests compile JAX's other lowering instead: the same hash,
    so the same bits."""
    import importlib

    from jax._src.interpreters import mlir

    for name in ("jax._src.random.threefry2x32", "jax._src.prng"):  # JAX >= 0.10.1, before
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        rule = getattr(module, "_threefry2x32_lowering_rule", None)
        primitive = getattr(module, "threefry2x32_p", None)
        if rule is not None and primitive is not None:
            mlir.register_lowering(primitive, rule, platform="cpu", inline=False)
            return
    # elsewhere in another JAX: its own lowering stays


_threefry_unrolled_on_the_cpu()


# -- a run without PyTorch, asked for explicitly ----------------------------------------------
#
# PyTorch's CPU build exists for the Python the main CI stage uses; on others (the stage
# on the newest JAX) only its multi-gigabyte CUDA build does. With
# JAXSCALE_TESTS_WITHOUT_TORCH=1 the modules that import PyTorch at the top are not
# collected, and the tests that take PyTorch from a fixture (`torch`, `torch_reference`)
# or are marked `torch` are deselected; the header says how many. Without the variable a
# missing torch is an import error, never a silent skip.

import functools  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from support import paths  # noqa: E402

# The model tests' fixtures (support/model_training.py), available to every module.
pytest_plugins = ["support.model_training"]

WITHOUT_TORCH = os.environ.get("JAXSCALE_TESTS_WITHOUT_TORCH") == "1"
_TORCH_SUPPORT = r"(?:torch_reference|torch_twins|torch_transformer|facade_drivers)\b"
_NEEDS_TORCH = re.compile(
    r"^(?:(?:import|from) (?:torch|torchao|optimi)\b"
    rf"|from support\.{_TORCH_SUPPORT}"
    rf"|from support import [^\n]*\b{_TORCH_SUPPORT})",
    re.MULTILINE,
)


def pytest_ignore_collect(collection_path: pathlib.Path, config):
    is_test_module = collection_path.suffix == ".py" and collection_path.name.startswith("test_")
    if WITHOUT_TORCH and is_test_module and _NEEDS_TORCH.search(collection_path.read_text()):
        return True
    return None


_TORCH_FIXTURES = {"torch", "torch_reference"}


def pytest_collection_modifyitems(config, items):
    # a test that takes PyTorch from a fixture needs it, whether or not it says so
    for item in items:
        if _TORCH_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.torch)
    # The longest tests first, so that the workers end together: xdist's work stealing
    # moves tests that have not started, and a minute-long test started last by one
    # worker would leave the other idle for that minute.
    items.sort(key=_heavy_first)
    if not WITHOUT_TORCH:
        return
    deselected = [item for item in items if item.get_closest_marker("torch")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("torch")]


def _heavy_first(item) -> int:
    """0 for the long end-to-end runs (marked slow), 1 for the other end-to-end tests,
    2 for the rest; a stable sort keeps each group in its collected order."""
    if item.get_closest_marker("slow"):
        return 0
    return 1 if item.nodeid.startswith("tests/system/") else 2


@pytest.fixture
def torch():
    """PyTorch, for a test in a module that runs without it too (the test is marked torch)."""
    import torch

    return torch


@pytest.fixture
def torch_reference():
    """``support/torch_reference.py``, PyTorch's own kernels driven with NumPy inputs."""
    from support import torch_reference

    return torch_reference


def pytest_report_header(config):
    if not WITHOUT_TORCH:
        return None
    here = pathlib.Path(__file__).parent
    left_out = sorted(
        path.name for path in here.rglob("test_*.py") if _NEEDS_TORCH.search(path.read_text())
    )
    return (
        f"JAXSCALE_TESTS_WITHOUT_TORCH=1: {len(left_out)} modules comparing with PyTorch are "
        f"not collected ({', '.join(left_out)}), and tests marked torch are deselected"
    )


@pytest.fixture(scope="module")
def char_lm():
    """The flagship example's module (``examples/char_lm.py``), importable for a test."""
    examples = paths.EXAMPLES
    sys.path.insert(0, str(examples))
    try:
        import char_lm

        yield char_lm
    finally:
        sys.path.remove(str(examples))


# -- comparisons with PyTorch on a GPU ----------------------------------------------------------
#
# PyTorch's CPU, which the tests compare with, multiplies float32 matrices in float32; XLA's
# GPU backend defaults to TF32 for them. Off the CPU the modules and tests that compare with
# PyTorch run JAX's matmuls at float32 ("highest"); on the CPU XLA computes float32 anyway and
# nothing is changed.


@pytest.fixture(autouse=True)
def float32_matmuls_against_pytorch(request):
    module = getattr(request, "module", None)
    source = pathlib.Path(module.__file__) if module is not None else None
    compares = request.node.get_closest_marker("torch") is not None or (
        source is not None and _compares_with_pytorch(source)
    )
    if jax.default_backend() == "cpu" or not compares:
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


# a module in which some test takes PyTorch from a fixture compares with it as a whole, as
# one that imports it does: its other tests check jaxscale against results computed alike
_TAKES_TORCH = re.compile(r"^def test_\w+\([^)]*\b(?:torch|torch_reference)\b", re.MULTILINE)


@functools.cache
def _compares_with_pytorch(source: pathlib.Path) -> bool:
    text = source.read_text()
    return bool(_NEEDS_TORCH.search(text) or _TAKES_TORCH.search(text))
