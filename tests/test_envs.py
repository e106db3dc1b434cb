"""pagedllm/envs.py: the one table of PAGEDLLM_* environment variables, read lazily, parsed as before,
and no module outside it reading one of them from os.environ itself."""
import ast
from pathlib import Path

import pytest
import torch

from pagedllm import config, envs
from pagedllm.engine.arg_utils import resolve_dtype

PACKAGE = Path(envs.__file__).parent
# The one module allowed to read a PAGEDLLM_* variable itself.
ALLOWED = {"envs.py"}

EXPECTED_DEFAULTS = {
    "PAGEDLLM_DP_STARTUP_TIMEOUT_S": 600.0, "PAGEDLLM_TP_TIMEOUT_S": 300.0, "PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S": 120.0,
    "PAGEDLLM_CPU_AUTO_DTYPE": "", "PAGEDLLM_CPU_KVCACHE_SPACE": None, "PAGEDLLM_CPU_MALLOC_TUNING": True,
    "PAGEDLLM_CPU_FUSED_OPS": True, "PAGEDLLM_CPU_FLOAT_GEMM": True, "PAGEDLLM_CPU_PACKED_LINEAR": True,
    "PAGEDLLM_CPU_LAYER_RUNNER": True, "PAGEDLLM_CPU_GGUF_KERNELS": True, "PAGEDLLM_SMOOTHQUANT_ALPHA": None,
    "PAGEDLLM_CACHE_DIR": Path.home() / ".cache" / "pagedllm", "PAGEDLLM_API_KEY": None,
    "PAGEDLLM_LORA_OP": "auto", "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": False,
    "PAGEDLLM_ENABLE_MULTIPROCESSING": True,
    "PAGEDLLM_MAX_IMAGE_BYTES": 20 * 2**20, "PAGEDLLM_MAX_IMAGE_PIXELS": 40_000_000,
    "PAGEDLLM_IMAGE_FETCH_TIMEOUT_S": 10.0,
}


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_variable_is_documented():
    assert [name for name, _ in envs.environment_variables()] == list(envs.ENVIRONMENT_VARIABLES)
    assert set(envs.ENVIRONMENT_VARIABLES) == set(EXPECTED_DEFAULTS)
    for name, var in envs.environment_variables():
        assert name.startswith("PAGEDLLM_")
        assert var.type.strip() and callable(var.parse), name
        assert len(var.help) > 80, name  # a paragraph, not a stub
        assert var.default is None or isinstance(var.default, str), name
        if var.default is None:
            assert "unset" in var.help.lower(), f"{name}: say what unset means"


def test_defaults_parse(clean_env):
    for name, var in envs.environment_variables():
        assert var.parse(var.default) == EXPECTED_DEFAULTS[name], name
        assert getattr(envs, name) == EXPECTED_DEFAULTS[name], name


def test_runtime_lora_updating_reads_vllms_name(clean_env):
    clean_env.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING is False
    clean_env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING is True
    clean_env.setenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")  # ours, when set, wins
    assert envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING is False
    clean_env.setenv("PAGEDLLM_LORA_OP", "fast")
    with pytest.raises(ValueError, match="PAGEDLLM_LORA_OP"):
        envs.PAGEDLLM_LORA_OP


def test_read_on_access(clean_env):
    assert envs.PAGEDLLM_TP_TIMEOUT_S == 300.0
    clean_env.setenv("PAGEDLLM_TP_TIMEOUT_S", "12.5")
    assert envs.PAGEDLLM_TP_TIMEOUT_S == 12.5
    with pytest.raises(AttributeError, match="PAGEDLLM_NO_SUCH"):
        envs.PAGEDLLM_NO_SUCH
    with pytest.raises(KeyError):
        envs.raw("PAGEDLLM_NO_SUCH")
    assert "PAGEDLLM_TP_TIMEOUT_S" in dir(envs)


def test_switches_keep_the_only_zero_is_off_rule(clean_env):
    for name in ("PAGEDLLM_CPU_MALLOC_TUNING", "PAGEDLLM_CPU_FUSED_OPS", "PAGEDLLM_CPU_FLOAT_GEMM",
                 "PAGEDLLM_CPU_PACKED_LINEAR", "PAGEDLLM_CPU_LAYER_RUNNER", "PAGEDLLM_CPU_GGUF_KERNELS"):
        for text, on in (("0", False), ("1", True), ("", True), ("false", True), (" 0", True)):
            clean_env.setenv(name, text)
            assert getattr(envs, name) is on, (name, text)


def test_kvcache_space(clean_env):
    clean_env.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", " 0.5 ")
    assert envs.PAGEDLLM_CPU_KVCACHE_SPACE == 0.5 and envs.raw("PAGEDLLM_CPU_KVCACHE_SPACE") == " 0.5 "
    clean_env.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "  ")
    assert envs.PAGEDLLM_CPU_KVCACHE_SPACE is None
    for bad in ("abc", "0", "-2", "nan"):
        clean_env.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", f" {bad}")
        with pytest.raises(ValueError) as e:
            envs.PAGEDLLM_CPU_KVCACHE_SPACE
        assert str(e.value) == f"PAGEDLLM_CPU_KVCACHE_SPACE must be a positive number of GiB, got {bad!r}"


def test_kvcache_space_log_quotes_the_text_as_written(clean_env):
    from pagedllm.worker.kv_cache_budget import cpu_kv_cache_space_bytes
    clean_env.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.0010 ")
    space, how = cpu_kv_cache_space_bytes()
    assert space == int(0.001 * 2**30) and how == "PAGEDLLM_CPU_KVCACHE_SPACE=0.0010 GiB"


def test_auto_dtype(clean_env):
    assert set(envs.AUTO_DTYPE_NAMES) == set(config.DTYPE_NAMES)  # the names resolve_dtype has always accepted
    clean_env.setenv("PAGEDLLM_CPU_AUTO_DTYPE", " BFloat16 ")
    assert envs.PAGEDLLM_CPU_AUTO_DTYPE == "bfloat16"
    clean_env.setenv("PAGEDLLM_CPU_AUTO_DTYPE", "fp16")
    assert envs.PAGEDLLM_CPU_AUTO_DTYPE == "fp16"
    clean_env.setenv("PAGEDLLM_CPU_AUTO_DTYPE", " Int3")
    with pytest.raises(ValueError) as e:
        envs.PAGEDLLM_CPU_AUTO_DTYPE
    assert str(e.value) == "PAGEDLLM_CPU_AUTO_DTYPE must be float32 or bfloat16; got 'int3'"
    with pytest.raises(ValueError) as resolved:  # what --dtype auto raises on a CPU with that value
        resolve_dtype("auto", None, "cpu")
    assert str(resolved.value) == str(e.value)
    clean_env.setenv("PAGEDLLM_CPU_AUTO_DTYPE", "bf16")
    assert resolve_dtype("auto", None, "cpu") == (torch.bfloat16, "auto: PAGEDLLM_CPU_AUTO_DTYPE=bf16")


def test_smoothquant_alpha(clean_env):
    from pagedllm.layers.quantization.smoothquant import smoothquant_alpha
    assert smoothquant_alpha(0.65) == 0.65
    for text, parsed, used in (("", None, 0.65), ("0", 0.0, None), ("-0", 0.0, None), ("0.7", 0.7, 0.7),
                               (" 0.25", 0.25, 0.25)):
        clean_env.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", text)
        assert envs.PAGEDLLM_SMOOTHQUANT_ALPHA == parsed and smoothquant_alpha(0.65) == used, text
    for bad in ("1", "1.5", "-0.1", "abc", " ", "nan"):
        clean_env.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", bad)
        with pytest.raises(ValueError) as e:
            smoothquant_alpha(0.65)
        assert str(e.value) == f"PAGEDLLM_SMOOTHQUANT_ALPHA must be 0 (off) or in (0, 1), got {bad!r}"


def test_timeouts_cache_dir_and_api_key(clean_env):
    clean_env.setenv("PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S", "abc")
    with pytest.raises(ValueError, match="could not convert string to float: 'abc'"):  # float()'s own, as before
        envs.PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S
    clean_env.setenv("PAGEDLLM_CACHE_DIR", "")
    assert envs.PAGEDLLM_CACHE_DIR == Path.home() / ".cache" / "pagedllm"
    clean_env.setenv("PAGEDLLM_CACHE_DIR", "/tmp/k")
    assert envs.PAGEDLLM_CACHE_DIR == Path("/tmp/k")
    clean_env.setenv("PAGEDLLM_API_KEY", "")
    assert envs.PAGEDLLM_API_KEY is None
    clean_env.setenv("PAGEDLLM_API_KEY", "s3cret")
    assert envs.PAGEDLLM_API_KEY == "s3cret"


def _environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of each os.environ / os.getenv read of a PAGEDLLM_* name, given literally or through a
    module-level string constant (``X_ENV = "PAGEDLLM_..."``)."""
    tree = ast.parse(source)
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def name_of(node):
        value = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("PAGEDLLM_") else None

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
            (isinstance(node, ast.Name) and node.id == "environ")

    found = []
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr in ("get", "pop", "setdefault") and is_environ(f.value)) or f.attr == "getenv":
                keys = [node.args[0]]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv" and node.args:
            keys = [node.args[0]]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys = [node.left]
        found += [(node.lineno, name_of(k)) for k in keys if name_of(k)]
    return found


def test_scanner_finds_reads():
    snippet = ('import os\nfrom os import environ, getenv\nX_ENV = "PAGEDLLM_X"\n'
               'a = os.environ.get("PAGEDLLM_A", "1")\nb = os.getenv("PAGEDLLM_B")\nc = os.environ["PAGEDLLM_C"]\n'
               'd = "PAGEDLLM_D" in os.environ\ne = environ.get(X_ENV)\nf = getenv("PAGEDLLM_F")\n'
               'g = os.environ.get("HOME")\n')
    assert sorted(_environment_reads(snippet)) == [(4, "PAGEDLLM_A"), (5, "PAGEDLLM_B"), (6, "PAGEDLLM_C"),
                                                   (7, "PAGEDLLM_D"), (8, "PAGEDLLM_X"), (9, "PAGEDLLM_F")]


def test_no_environment_read_outside_envs():
    offenders, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        reads = _environment_reads(path.read_text())
        seen.update(name for _, name in reads)
        if path.relative_to(PACKAGE).as_posix() not in ALLOWED:
            offenders += [f"{path.relative_to(PACKAGE)}:{line}: {name}" for line, name in reads]
    assert not offenders, "read these through pagedllm.envs:\n" + "\n".join(offenders)
    assert seen <= set(envs.ENVIRONMENT_VARIABLES)  # envs.py itself reads only declared names
