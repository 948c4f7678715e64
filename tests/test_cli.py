"""The jaxrunner command: a user's error is one line on stderr and exit status 2, checked before the
model loads; every flag has help; ``generate`` says the built-in model's weights are random."""

import argparse
import ast
import re

import pytest

from jaxrunner import cli
from jaxrunner.models.builtin import BUILTIN_MODELS

# The smallest tiny-llama engine: one bucket per axis, a small cache, no persistent compilation cache.
SMALL_ENGINE = [
    "--max-num-seqs=2",
    "--max-num-batched-tokens=16",
    "--token-buckets=16",
    "--request-buckets=2",
    "--num-gpu-blocks-override=16",
    "--max-model-len=64",
    "--compilation-cache-dir=",
]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if the command builds an engine: its flags must be refused before."""

    def build(*args, **kwargs):
        raise AssertionError("the engine was built before the flags were checked")

    monkeypatch.setattr("jaxrunner.engine.llm.LLM", build)


def _user_error(capsys, argv: list[str]) -> str:
    """The one line a user's error prints on stderr, after checking the exit status is 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _commands() -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_explains_every_flag_and_shows_its_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag's help
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    flags = [a for a in _commands()[command]._actions if a.dest != "help"]
    assert len(flags) > 20
    for flag in flags:
        assert flag.help, f"{flag.option_strings} has no help"
        default = "" if flag.default is None else f" (default: {flag.default})"
        assert f"{flag.help}{default}" in shown, flag.option_strings


def test_a_bad_flag_value_is_one_line(capsys):
    err = _user_error(capsys, ["generate", "--max-tokens", "many"])
    assert "argument --max-tokens: invalid int value: 'many'" in err


def test_compiler_options_that_are_not_a_json_object_are_one_line(capsys):
    err = _user_error(capsys, ["generate", "--compiler-options", "[1]"])
    assert "argument --compiler-options: must be a JSON object" in err


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--temperature=-1"], "temperature must be non-negative"),
        (["--top-p=0"], r"top_p must be in \(0, 1\]"),
        (["--max-tokens=0"], "max_tokens must be at least 1"),
        (["--top-k=-2"], "top_k must be 0 or -1"),
    ],
)
def test_sampling_flags_are_refused_before_the_model_loads(capsys, no_model_loads, flags, field):
    err = _user_error(capsys, ["generate", *flags])
    assert re.search(rf"^jaxrunner generate: error: SamplingParams\.{field}", err)


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--num-prompts=0"], "--num-prompts must be at least 1; got 0"),
        (["--output-len=-5"], "--output-len must be at least 1; got -5"),
        (["--range-ratio=1.5"], r"--range-ratio must be in \[0, 1\); got 1.5"),
    ],
)
def test_a_workload_that_cannot_run_is_refused_before_the_model_loads(capsys, no_model_loads, flags, why):
    assert re.search(f"^jaxrunner bench: error: {why}", _user_error(capsys, ["bench", *flags]))


@pytest.mark.parametrize(
    "model, hint",
    [
        ("tiny-lama", "Did you mean 'tiny-llama'?"),
        ("meta-llama/Llama-3-8B", "looks like a Hugging Face Hub id: download it first (e.g. `hf download"),
    ],
)
def test_a_model_that_is_neither_built_in_nor_a_directory_lists_the_built_in_ones(capsys, no_model_loads, model, hint):
    err = _user_error(capsys, ["generate", "--model", model])
    assert all(name in err for name in BUILTIN_MODELS)
    assert "loads local checkpoint directories only and downloads nothing" in err and hint in err


def test_a_checkpoint_whose_config_does_not_parse_is_named(capsys, no_model_loads, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ')
    err = _user_error(capsys, ["generate", "--model", str(tmp_path)])
    assert f"{tmp_path / 'config.json'}: not valid JSON" in err


def test_an_engine_setting_the_engine_refuses_is_one_line(capsys):
    err = _user_error(capsys, ["generate", "--max-num-seqs=0"])
    assert "SchedulerConfig.max_num_seqs must be positive; got 0" in err


def test_debug_shows_the_error_itself(no_model_loads):
    with pytest.raises(ValueError, match="Did you mean 'tiny-llama'"):
        cli.main(["generate", "--model", "tiny-lama", "--debug"])


def test_generate_says_the_weights_are_random_and_prints_token_ids_beside_the_text(capsys):
    cli.main(["generate", "--max-tokens=4", "--prompt=Hi", *SMALL_ENGINE])
    out = capsys.readouterr().out.splitlines()
    assert "tiny-llama, built in, with RANDOM weights" in out[0] and "--model /path/to/checkpoint" in out[0]
    text = re.fullmatch(r"'Hi' -> (.*) \(length\)", out[1])
    assert text is not None and isinstance(ast.literal_eval(text.group(1)), str)  # escaped, as repr writes it
    assert out[2] == "    prompt token ids: [1, 75, 108]"  # the byte tokenizer: <s>, then 3 + each byte
    ids = re.fullmatch(r"    output token ids: \[(.*)\]", out[3])
    assert ids is not None and len(ids.group(1).split(", ")) == 4
    assert re.fullmatch(r"4 output tokens in [\d.]+ s: [\d.]+ tokens/s", out[4])


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu"])
def test_speculative_flags_reach_the_engine_as_vllms_speculative_config(method, monkeypatch):
    built = {}

    def build(model, **kwargs):
        built.update(kwargs)
        raise SystemExit(0)  # stop before loading anything

    monkeypatch.setattr("jaxrunner.engine.llm.LLM", build)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--num-speculative-tokens=3", f"--speculative-method={method}", *SMALL_ENGINE])
    assert built["speculative_config"] == {"method": method, "num_speculative_tokens": 3}
