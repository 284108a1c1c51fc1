"""`tsterm run`: stdout carries only the answer; errors are one `tsterm: error:` line and an exit code
(0 ok, 1 runtime/model error, 2 usage/config error), never a traceback."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tsterm import LLM, SamplingParams
from tsterm.cli import main

from tests.helpers.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("cli") / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2))
    return str(path)


SMALL_KV_BYTES = 8 << 20


@pytest.fixture(autouse=True)
def small_kv_pool(monkeypatch):
    """In-process runs get an 8 MiB KV pool instead of the CPU default (1 GiB): same answers, less memory."""
    monkeypatch.setattr("tsterm.engine.executor.CPU_DEFAULT_KV_BYTES", SMALL_KV_BYTES)


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    """The offline API with the CLI's defaults (auto dtype and device: float32 on the CPU)."""
    return LLM(model_dir, device="cpu", kv_cache_memory=SMALL_KV_BYTES)


def greedy(llm: LLM, prompt, max_tokens: int = 8):
    """(final output, the non-empty text deltas it streamed)."""
    deltas: list[str] = []

    def on_output(out):
        if out.outputs[0].delta_text:
            deltas.append(out.outputs[0].delta_text)

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), on_output=on_output)[0]
    return out, deltas


def chat_ids(llm: LLM, user: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


class RecordingStdout(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err: str, *parts: str) -> None:
    assert err.startswith("tsterm: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for part in parts:
        assert part in err, f"{part!r} not in {err!r}"


# --------------------------------------------------------------------------------------------------
# answers

@pytest.mark.parametrize("prompt", ["hi", "What is the weather in Paris?"])  # the second streams in 7 pieces
def test_run_streams_the_chat_answer(model_dir, reference, monkeypatch, prompt):
    expected, deltas = greedy(reference, chat_ids(reference, prompt))
    stdout = RecordingStdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    code = main(["run", "--model", model_dir, "--prompt", prompt, "--max-tokens", "8", "--temperature", "0"])
    assert code == 0
    assert stdout.getvalue() == expected.text + "\n"
    assert stdout.writes == deltas + ["\n"]  # written piece by piece as it was generated, then one newline


def test_run_json(model_dir, reference, capsys):
    prompt = chat_ids(reference, "What is the weather in Paris?", system="Be brief.")
    expected, _ = greedy(reference, prompt)
    code, out, err = run_main(["run", "--model", model_dir, "--prompt", "What is the weather in Paris?",
                               "--system", "Be brief.", "--max-tokens", "8", "--temperature", "0", "--json"], capsys)
    assert code == 0 and out.endswith("}\n") and out.count("\n") == 1
    result = json.loads(out)
    assert result["text"] == expected.text
    assert result["token_ids"] == expected.token_ids
    assert result["finish_reason"] == expected.finish_reason
    assert result["prompt_tokens"] == len(prompt)
    assert result["cached_tokens"] == 0


def test_run_raw_skips_the_chat_template(model_dir, reference, capsys):
    prompt = "The quick brown fox"
    expected, _ = greedy(reference, prompt)
    code, out, _ = run_main(["run", "--model", model_dir, "--prompt", prompt, "--raw", "--max-tokens", "8",
                             "--temperature", "0", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["token_ids"] == expected.token_ids
    assert result["prompt_tokens"] == len(reference.tokenizer.encode(prompt))


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("argv", [["--prompt", "-"], []])
def test_run_reads_the_prompt_from_stdin(model_dir, reference, capsys, monkeypatch, argv):
    """`--prompt -`, or no --prompt on a pipe, reads the prompt from stdin (as `llm` and `ollama run` do); the
    newline that ends the piped text is not part of the message."""
    expected, _ = greedy(reference, chat_ids(reference, "What is the weather\nin Paris?"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the weather\nin Paris?\n"))
    code, out, err = run_main(["run", "--model", model_dir, *argv, "--max-tokens", "8", "--temperature", "0"], capsys)
    assert (code, out) == (0, expected.text + "\n"), err


@pytest.mark.parametrize("stdin, argv, says", [
    (Terminal(), [], "no prompt: give --prompt TEXT"), (io.StringIO(" \n"), [], "the prompt read from stdin is empty"),
    (io.StringIO(""), ["--prompt", "-"], "the prompt read from stdin is empty")])
def test_no_prompt_on_a_terminal_or_an_empty_pipe_is_a_usage_error(model_dir, capsys, monkeypatch, stdin, argv, says):
    monkeypatch.setattr("tsterm.llm.LLM", lambda *a, **k: pytest.fail("no prompt must not load a model"))
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = run_main(["run", "--model", model_dir, *argv], capsys)
    assert (code, out) == (2, "")
    assert_one_error_line(err, says)


def test_run_without_a_profile_takes_the_models_generation_config_and_says_so(model_dir, tmp_path, capsys):
    """`--model DIR` alone samples as the model's generation_config.json recommends (as transformers and vLLM do),
    under the flags given, and one stderr line says which defaults the reply got."""
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "m")
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.7, "top_k": 5}))
    llm = LLM(str(copy), device="cpu", kv_cache_memory=SMALL_KV_BYTES)
    assert (llm.sampling.temperature, llm.sampling.top_k) == (0.7, 5)
    expected = llm.generate(chat_ids(llm, "hi"), SamplingParams(temperature=0.7, top_k=5, max_tokens=8, seed=3))[0]
    code, out, err = run_main(["run", "--model", str(copy), "--prompt", "hi", "--max-tokens", "8", "--seed", "3",
                               "--json"], capsys)
    assert code == 0 and json.loads(out)["token_ids"] == expected.token_ids
    assert ("tsterm: no profile: sampling temperature 0.7, top_p 1, top_k 5, max_tokens 8 (--max-tokens, --seed; "
            f"{copy / 'generation_config.json'}); no system prompt (--system, or a --profile, sets one)\n") in err, err


def test_the_template_s_own_system_prompt_is_found(tmp_path):
    """SmolLM2's template writes a system prompt of its own into a conversation without one."""
    from tests.helpers.tokenizers import make_tokenizer_dir
    from tsterm.tokenizer import Tokenizer

    make_tokenizer_dir(tmp_path)
    assert Tokenizer.from_dir(tmp_path).default_system_prompt() is None  # chatml writes none
    (tmp_path / "chat_template.jinja").write_text(
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are SmolLM.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    assert Tokenizer.from_dir(tmp_path).default_system_prompt() == "You are SmolLM."


def cli_command() -> list[str]:
    script = Path(sys.executable).parent / "tsterm"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "tsterm.cli"]


def test_installed_command_prints_only_the_answer(model_dir, reference):
    expected, _ = greedy(reference, chat_ids(reference, "hi"))
    ok = subprocess.run([*cli_command(), "run", "--model", model_dir, "--prompt", "hi", "--max-tokens", "8",
                         "--temperature", "0"], capture_output=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr.decode()
    assert ok.stdout.decode() == expected.text + "\n"
    assert b"Traceback" not in ok.stderr

    bad = subprocess.run([*cli_command(), "run", "--model", model_dir, "--prompt", "hi", "--temperature", "-1"],
                         capture_output=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and bad.stdout == b""
    assert_one_error_line(bad.stderr.decode(), "temperature", "-1")

    blank = subprocess.run([*cli_command(), "run", "--model", model_dir, "--prompt", " \n "],
                           capture_output=True, cwd=ROOT, timeout=120)
    assert blank.returncode == 2 and blank.stdout == b""
    assert_one_error_line(blank.stderr.decode(), "--prompt is empty")


@pytest.mark.parametrize("argv,says", [(["run", "--prompt", ""], "--prompt is empty"),
                                       (["run", "--raw", "--prompt", "\t"], "--prompt is empty"),
                                       (["agent", "  "], "the task is empty")])
def test_an_empty_prompt_is_a_usage_error_before_loading(model_dir, capsys, monkeypatch, argv, says):
    monkeypatch.setattr("tsterm.llm.LLM", lambda *a, **k: pytest.fail("an empty prompt must not load a model"))
    code, out, err = run_main([*argv, "--model", model_dir], capsys)
    assert (code, out) == (2, "")
    assert_one_error_line(err, says)


# --------------------------------------------------------------------------------------------------
# errors

def test_missing_model_dir_is_a_model_error(tmp_path, capsys):
    code, out, err = run_main(["run", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"], capsys)
    assert (code, out) == (1, "")
    assert_one_error_line(err, "nowhere", "does not exist")


def test_broken_model_dir_is_a_model_error(tmp_path, capsys):
    code, out, err = run_main(["run", "--model", str(tmp_path), "--prompt", "hi"], capsys)
    assert (code, out) == (1, "")
    assert_one_error_line(err, "config.json")


def test_no_model_is_a_usage_error(capsys):
    code, out, err = run_main(["run", "--prompt", "hi"], capsys)
    assert (code, out) == (2, "")
    assert_one_error_line(err, "--model")


@pytest.mark.parametrize("option,value,field", [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                                ("--max-tokens", "0", "max_tokens")])
def test_bad_sampling_option_is_a_config_error_found_before_loading(model_dir, capsys, monkeypatch, option, value,
                                                                    field):
    def no_load(*args, **kwargs):
        raise AssertionError("the model must not be loaded before the options are validated")

    monkeypatch.setattr("tsterm.llm.LLM", no_load)
    code, out, err = run_main(["run", "--model", model_dir, "--prompt", "hi", option, value], capsys)
    assert (code, out) == (2, "")
    assert_one_error_line(err, field)


def test_unavailable_device_is_a_runtime_error(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, out, err = run_main(["run", "--model", model_dir, "--prompt", "hi", "--device", "cuda"], capsys)
    assert (code, out) == (1, "")
    assert_one_error_line(err, "CUDA is not available")


def test_bad_device_name_is_a_config_error(model_dir, capsys):
    code, out, err = run_main(["run", "--model", model_dir, "--prompt", "hi", "--device", "tpu"], capsys)
    assert (code, out) == (2, "")
    assert_one_error_line(err, "device", "'tpu'")


@pytest.mark.parametrize("argv", [["run", "--model", "x", "--prompt", "hi", "--dtype", "float64"],
                                  ["run", "--model", "x", "--prompt", "hi", "--temperature", "warm"],
                                  ["frobnicate"]])  # no --prompt: test_no_prompt_on_a_terminal_or_an_empty_pipe_...
def test_argparse_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "error:" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help_exits_0(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out, _ = capsys.readouterr()
    assert out.startswith("usage: tsterm")
    if argv[0] == "run":
        assert "--prompt" in out and "--json" in out and "--raw" in out


def test_version_is_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"tsterm {version('tsterm')}\n"


@pytest.mark.parametrize("command", ["run", "chat", "bench"])
def test_every_flag_has_help_and_shows_its_default(command):
    """A flag's help says what it does and what it is when not given (argparse's default, or the profile's)."""
    import argparse

    from tsterm.cli import build_parser

    parser = build_parser()._subparsers._group_actions[0].choices[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        text = formatter._get_help_string(action) % {"default": action.default}
        if action.default is not False and not action.required:  # a switch is off unless given
            assert "(default: " in text, f"{command} {action.option_strings[0]}: {text!r}"
    assert "(default: 8)" in parser.format_help() if command == "bench" else True


def test_the_subcommands_of_other_modules_are_listed_by_their_own_help(capsys):
    """`tsterm --help` names agent, bench, serve and plan without importing their modules: the one-line help it shows
    for each is the one its module's parser gives, and the command line that runs one gets its whole parser."""
    from tsterm.cli import ELSEWHERE, build_parser

    def helps(parser):
        return {a.dest: a.help for a in parser._subparsers._group_actions[0]._choices_actions}

    assert set(ELSEWHERE) <= set(helps(build_parser()))
    assert helps(build_parser(full=())) == helps(build_parser())
    for name in ELSEWHERE:
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert info.value.code == 0 and out.startswith(f"usage: tsterm {name}") and "--model" in out, out
