import json
import subprocess
import sys

import pytest

from cluster import cli, cli_models
from cluster.tools import make_model as make_model_module


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "llama"
    assert cli.main(["make-model", str(out), "--arch", "llama", "--size", "tiny"]) == 0
    return out


def test_make_model(tmp_path, capsys):
    out = tmp_path / "m"
    argv = ["make-model", str(out), "--arch", "qwen2", "--size", "tiny", "--seed", "3"]
    assert cli.main(argv) == 0
    assert "wrote qwen2 tiny" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (out / "model.safetensors").is_file()

    # A non-empty directory is refused, then replaced with --overwrite.
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and "not empty" in err
    assert "Traceback" not in err
    assert cli.main([*argv, "--overwrite"]) == 0


def test_parser_choices_match_make_model():
    assert cli_models.ARCHS == make_model_module.ARCHS
    assert cli_models.SIZES == make_model_module.SIZES
    assert cli_models.DTYPES == make_model_module.DTYPES


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["make-model", "x", "--arch", "gpt2"], "--arch"),
        (["make-model", "x", "--size", "huge"], "--size"),
        (["make-model", "x", "--seed", "one"], "--seed"),
        (["make-model"], "DIR"),
        (["generate", "hi"], "--model"),
        (["generate", "--model", "m", "--max-tokens", "many", "hi"], "--max-tokens"),
        (["generate", "--model", "m", "--dtype", "int4", "hi"], "--dtype"),
        (["frobnicate"], "frobnicate"),
        ([], "COMMAND"),
    ],
)
def test_bad_arguments(argv, named, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and named in err


def test_help_exits_zero(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "make-model" in out and "generate" in out


def test_generate_streams_and_summarises(tiny_model, capsys):
    argv = ["generate", "--model", str(tiny_model), "--dtype", "float32"]
    argv += ["--max-tokens", "12", "--temperature", "0", "--ignore-eos", "Hello, world!"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    summary = captured.err.strip().splitlines()[-1]
    assert "12 tokens" in summary and "finish: length" in summary and "tokens/s" in summary

    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=256)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = llm.generate(["Hello, world!"], params)[0].text
    assert captured.out == expected + "\n"


def test_generate_stop_string(tiny_model, capsys):
    base = ["generate", "--model", str(tiny_model), "--dtype", "float32", "--temperature", "0"]
    base += ["--max-tokens", "16", "--ignore-eos"]
    assert cli.main([*base, "Once upon a time"]) == 0
    full = capsys.readouterr().out.rstrip("\n")
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full  # a visible stop string from the middle of the output
    assert cli.main([*base, "--stop", stop, "--stop", "\x00never", "Once upon a time"]) == 0
    captured = capsys.readouterr()
    assert captured.out == full[: full.find(stop)] + "\n"
    assert "finish: stop" in captured.err


def test_generate_bad_sampling_params(tiny_model, capsys):
    argv = ["generate", "--model", str(tiny_model), "--temperature", "-1", "hi"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and "temperature" in err
    assert "Traceback" not in err


def test_generate_missing_model(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "nope"), "hi"]) in (1, 2)
    assert capsys.readouterr().err.startswith("baton: error: ")


def test_console_entry_point_runs(tmp_path):
    # `python -m cluster.cli` is the same function the `baton` script calls.
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "make-model", str(tmp_path / "m"), "--arch", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_help_lists_the_grpc_commands(capsys):
    assert cli.main(["--help"]) == 0
    assert "status" in capsys.readouterr().out
    assert cli.main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--target" in out and "--disaggregation" in out and "--timing" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["generate", "--model", "m", "--target", "127.0.0.1:1", "hi"], "not allowed with"),
        (["generate", "hi"], "--target"),
        (["generate", "--target", "127.0.0.1:1", "--disaggregation", "often", "hi"], "often"),
        (["generate", "--target", "127.0.0.1:1", "--timeout", "-1", "hi"], "--timeout"),
        (["status"], "--target"),
        (["status", "--target", "127.0.0.1:1", "--timeout", "0"], "--timeout"),
        (["status", "--target", "127.0.0.1:1", "--timeout", "soon"], "--timeout"),
    ],
)
def test_bad_grpc_arguments(argv, named, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and named in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Flags of the other form are refused before a model loads or a channel opens.
        (["generate", "--model", "m", "--timing", "hi"], "--timing applies only with --target"),
        (["generate", "--model", "m", "--disaggregation", "never", "hi"], "--disaggregation"),
        (["generate", "--model", "m", "--timeout", "3", "hi"], "--timeout"),
        (["generate", "--model", "m", "--no-speculative", "hi"], "--no-speculative applies"),
        (["generate", "--target", "127.0.0.1:1", "--dtype", "float32", "hi"], "with --model"),
        (["generate", "--target", "localhost", "hi"], "missing ':PORT'"),
        (["generate", "--target", "127.0.0.1:1", "--max-tokens", "-1", "hi"], "max_tokens"),
        (["generate", "--target", "127.0.0.1:1", "--seed", "-1", "hi"], "seed"),
        (["status", "--target", "localhost:99999"], "outside 1-65535"),
    ],
)
def test_grpc_forms_reject_bad_values(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and message in err
    assert "Traceback" not in err


def test_building_the_parser_imports_neither_grpc_nor_torch():
    code = "import sys; from cluster import cli; cli.build_parser(); "
    code += "print(sorted({'grpc', 'torch', 'cluster.client'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_serve_refuses_a_bad_config_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  port: 70000\n")
    assert cli.main(["serve", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "router.port" in err and "65535" in err and "Traceback" not in err


def test_python_m_cluster_refuses_a_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  replicaz: 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "cluster", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "decode.replicaz: unknown key" in proc.stderr


def test_serve_takes_a_keys_file_never_a_key_on_the_command_line(monkeypatch, capsys):
    import cluster.serve

    served = []
    monkeypatch.setattr(cluster.serve, "run", lambda config: served.append(config) or 0)
    assert cli.main(["serve"]) == 0
    assert cli.main(["serve", "--api-keys-file", "/run/secrets/keys.yaml"]) == 0
    assert [c.router.api_keys_file for c in served] == [None, "/run/secrets/keys.yaml"]
    # argv is readable by any local user: no flag takes a key (nor an abbreviation of one).
    assert cli.main(["serve", "--api-key", "0123456789abcdef"]) == 2
    assert "unrecognized arguments: --api-key" in capsys.readouterr().err
    assert len(served) == 2
