"""Profiles: errors name the file, line and key; `extends`, `${ENV}`, the search path; `tsterm profiles`."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tsterm.convert import shipped
from tsterm.cli import main
from tsterm.errors import ConfigError
from tsterm.chat.history import POLICIES
from tsterm.profiles import SHIPPED_DIR, THINKING_HISTORY_POLICIES, list_profiles, load_profile


@pytest.fixture(autouse=True)
def isolated_search_path(tmp_path, monkeypatch):
    """cwd and the user config dir point into tmp_path, so only the shipped profiles are found by default."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("checking a profile must not load, import or download a model")

    monkeypatch.setattr("tsterm.convert.shipped.resolve_model", refuse)
    monkeypatch.setattr("tsterm.convert.demo.ensure_demo_model", refuse)
    monkeypatch.setattr("tsterm.convert.shipped.ensure_default_model", refuse)
    monkeypatch.setitem(shipped.SHIPPED_MODELS, "smollm2-135m-instruct", refuse)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(path: Path | str) -> str:
    with pytest.raises(ConfigError) as info:
        load_profile(str(path))
    return str(info.value)


# --------------------------------------------------------------------------------------------------
# errors: file, line, key

@pytest.mark.parametrize("text,line,parts", [
    ("model: m\nblok_size: 16\n", 2, ["unknown key 'blok_size'", "did you mean 'block_size'?"]),
    ("model: m\nsampling:\n  temperature: 0\n  top_q: 0.9\n", 4, ["unknown sampling key 'top_q'", "'top_p'"]),
    ("model: m\nblock_size: big\n", 2, ["block_size", "'big'"]),
    ("model: m\n\nblock_size: 0\n", 3, ["block_size", "[1, 1024]"]),
    ("model: m\nsampling: {top_p: 0.5, temperature: -1}\n", 2, ["temperature", "0 (greedy) or in [1e-06, inf)"]),
    ("model: m\nsampling:\n  max_tokens: 12\n  temperature: -1\n", 4, ["temperature", "-1"]),
    ("model: m\nsampling:\n  max_tokens: lots\n", 3, ["max_tokens", "integer", "'lots'"]),
    ("model: m\nmax_num_seqs: 2.5\n", 2, ["max_num_seqs", "integer"]),
    ("model: m\nenable_prefix_caching: maybe\n", 2, ["enable_prefix_caching", "true or false"]),
    ("model: m\nsampling: [1, 2]\n", 2, ["sampling", "mapping"]),
    ("model: m\nui:\n  theme: nordd\n", 3, ["theme 'nordd'", "did you mean 'nord'?"]),
    ("model: m\nui:\n  theme: plain\n", 3, ["theme 'plain'", "textual-dark"]),
    ("model: m\nui:\n  dashbord: shown\n", 3, ["unknown ui key 'dashbord'", "did you mean 'dashboard'?"]),
    ("model: m\nui:\n  dashboard: true\n", 3, ["dashboard", "string", "True"]),
    ("model: m\nui: {thinking: folded}\n", 2, ["thinking", "collapsed or expanded", "'folded'"]),
    ("model: m\nui:\n  theme: nord\n  stats_interval: 0\n", 4, ["stats_interval", "[0.05, 10]"]),
    ("model: m\nui: dark\n", 2, ["ui", "mapping"]),
    ("model: m\nagent:\n  max_step: 3\n", 3, ["unknown agent key 'max_step'", "did you mean 'max_steps'?"]),
    ("model: m\nagent:\n  max_steps: 0\n", 3, ["max_steps", "[1, 1000]"]),
    ("model: m\nagent:\n  tools: [calculater]\n", 3, ["unknown built-in tool 'calculater'", "'calculator'"]),
    ("model: m\nagent:\n  tools: [write_file]\n", 3, ["write_file", "allow_write: true"]),
    ("model: m\nagent:\n  auto_approve: yes please\n", 3, ["auto_approve", "true or false"]),
    ("model: m\nagent:\n  tool_timeout_s: -1\n", 3, ["tool_timeout_s", "(0, 86400]"]),
    ("model: m\nagent:\n  mcp_servers: [git]\n", 3, ["mcp_servers", "list of mappings"]),
    ("model: m\nserver:\n  max_conversations: -1\n", 3, ["max_conversations", "integer >= 0", "-1"]),
    ("model: m\nserver:\n  conversation_ttl_s: long\n", 3, ["conversation_ttl_s", "number", "'long'"]),
    ("model: m\ndevice: tpu\n", 2, ["device", "'tpu'"]),
    ("model: m\nsystem_prompt: [a]\n", 2, ["system_prompt", "string"]),
    ("model: m\n\nthinking_history: keep\n", 3, ["thinking_history must be preserve or template", "'keep'"]),
    ("model: m\nthinking_history: true\n", 2, ["thinking_history must be preserve or template", "True"]),
    ("model: m\nthinking_histroy: template\n", 2, ["unknown key 'thinking_histroy'", "'thinking_history'"]),
    ("model: m\nblock_size: [16\n", 3, ["invalid YAML"]),
    ("model: m\n  bad: indent\n", 2, ["invalid YAML"]),
    ("- model: m\n", 1, ["must be a mapping"]),
    ("# a comment\n\njust text\n", 3, ["must be a mapping"]),
])
def test_errors_name_file_line_and_key(tmp_path, text, line, parts):
    path = write(tmp_path / "bad.yaml", text)
    message = error_of(path)
    assert message.startswith(f"{path.resolve()}:{line}: "), message
    for part in parts:
        assert part in message, message


def test_unset_env_var_names_its_line(tmp_path, monkeypatch):
    monkeypatch.delenv("TSTERM_TEST_UNSET", raising=False)
    path = write(tmp_path / "env.yaml", "# ${NOT_EXPANDED_IN_COMMENTS}\ndtype: float32\nmodel: ${TSTERM_TEST_UNSET}/m\n")
    assert error_of(path) == f"{path.resolve()}:3: environment variable ${{TSTERM_TEST_UNSET}} is not set"


def test_extends_cycle(tmp_path):
    write(tmp_path / "profiles" / "a.yaml", "extends: b\nmodel: m\n")
    write(tmp_path / "profiles" / "b.yaml", "dtype: float32\nextends: a\n")
    message = error_of("a")
    assert message.startswith(f"{(tmp_path / 'profiles' / 'b.yaml').resolve()}:2: ")
    assert "cycle" in message and "a.yaml -> b.yaml -> a.yaml" in message


def test_extends_self_is_a_cycle(tmp_path):
    path = write(tmp_path / "self.yaml", "model: m\nextends: ./self.yaml\n")
    message = error_of(path)
    assert message.startswith(f"{path.resolve()}:2: ") and "cycle" in message


def test_missing_extends_target(tmp_path):
    path = write(tmp_path / "child.yaml", "model: m\n\nextends: no-such-profile\n")
    message = error_of(path)
    assert message.startswith(f"{path.resolve()}:3: ") and "no-such-profile" in message


def test_error_in_a_base_points_at_the_base(tmp_path):
    write(tmp_path / "profiles" / "base.yaml", "model: m\nsampling:\n  temperature: -2\n")
    write(tmp_path / "profiles" / "child.yaml", "extends: base\n")
    assert error_of("child").startswith(f"{(tmp_path / 'profiles' / 'base.yaml').resolve()}:3: ")


def test_a_sections_keys_are_validated_together(tmp_path):
    """`tools: [write_file]` is valid next to `allow_write: true`, in the same file or from a base; a key whose
    value contradicts the section is reported at its own line."""
    path = write(tmp_path / "w.yaml", "model: m\nagent:\n  tools: [read_file, write_file, run_command]\n"
                                      "  allow_write: true\n  allow_commands: true\n")
    settings = load_profile(str(path)).agent_settings()
    assert settings.tools == ["read_file", "write_file", "run_command"] and settings.allow_write
    write(tmp_path / "profiles" / "base.yaml", "model: m\nagent:\n  allow_write: true\n")
    write(tmp_path / "profiles" / "child.yaml", "extends: base\nagent:\n  tools: [write_file]\n")
    assert load_profile("child").agent_settings().tools == ["write_file"]
    write(tmp_path / "profiles" / "off.yaml", "extends: child\nagent:\n\n  allow_write: false\n")
    message = error_of("off")
    assert message.startswith(f"{(tmp_path / 'profiles' / 'off.yaml').resolve()}:4: "), message
    assert "allow_write: true" in message


# --------------------------------------------------------------------------------------------------
# extends, ${ENV}, search path

def test_extends_inherits_and_overrides(tmp_path):
    write(tmp_path / "profiles" / "base.yaml", """
        description: base
        model: demo:tiny
        dtype: float32
        block_size: 16
        sampling: {temperature: 0.7, max_tokens: 64}
        ui: {theme: nord, dashboard: hidden}
        system_prompt: Be kind.
    """)
    write(tmp_path / "profiles" / "child.yaml", """
        extends: base
        block_size: 32
        sampling:
          temperature: 0
        ui:
          dashboard: shown
    """)
    child = load_profile("child")
    assert child.engine == {"model": "demo:tiny", "dtype": "float32", "block_size": 32}
    assert child.sampling == {"temperature": 0, "max_tokens": 64}
    assert child.system_prompt == "Be kind." and child.description == "base"
    assert child.sampling_params().greedy
    ui = child.ui_options()
    assert (ui.theme, ui.dashboard, ui.thinking, ui.stats_interval) == ("nord", "shown", "collapsed", 0.25)
    assert "ui:\n  theme: nord\n  dashboard: shown\n" in child.to_yaml()


def test_thinking_history_defaults_to_preserve_and_is_inherited(tmp_path, capsys):
    """The resolved policy is what every session of the profile reads (`Profile.thinking_history`): `preserve` unless
    a file of the `extends` chain says otherwise; `profiles show` prints it."""
    write(tmp_path / "profiles" / "base.yaml", "model: m\n")
    write(tmp_path / "profiles" / "tpl.yaml", "extends: base\nthinking_history: template\n")
    write(tmp_path / "profiles" / "child.yaml", "extends: tpl\nblock_size: 32\n")
    write(tmp_path / "profiles" / "on.yaml", "extends: child\nthinking_history: preserve\n")
    assert [load_profile(name).thinking_history for name in ("base", "tpl", "child", "on")] == \
        ["preserve", "template", "template", "preserve"]
    assert load_profile("moe-demo").thinking_history == "preserve"
    assert main(["profiles", "show", "child"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["thinking_history"] == "template"
    assert THINKING_HISTORY_POLICIES == POLICIES  # the configuration layer's copy of the chat layer's names


def test_env_expansion_keeps_types(tmp_path, monkeypatch):
    monkeypatch.setenv("TSTERM_TEST_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("TSTERM_TEST_BLOCK", "32")
    path = write(tmp_path / "env.yaml", "model: ${TSTERM_TEST_DIR}/x\nblock_size: ${TSTERM_TEST_BLOCK}\n"
                                        "system_prompt: 'dir ${TSTERM_TEST_BLOCK}'\n")
    profile = load_profile(str(path))
    assert profile.engine["model"] == f"{tmp_path}/weights/x"
    assert profile.engine["block_size"] == 32
    assert profile.system_prompt == "dir 32"


def test_search_path_precedence(tmp_path):
    write(tmp_path / "config" / "tsterm" / "profiles" / "default.yaml", "description: user\nmodel: m\n")
    write(tmp_path / "config" / "tsterm" / "profiles" / "mine.yaml", "description: user mine\nmodel: m\n")
    assert load_profile("default").description == "user"
    write(tmp_path / "profiles" / "mine.yaml", "description: local mine\nmodel: m\n")
    assert load_profile("mine").description == "local mine"
    rows = {name: (description, path) for name, description, path in list_profiles()}
    assert rows["mine"] == ("local mine", tmp_path / "profiles" / "mine.yaml")
    assert rows["default"][0] == "user"
    assert rows["moe-demo"][1] == SHIPPED_DIR / "moe-demo.yaml"
    assert [name for name, _, _ in list_profiles()].count("default") == 1


# --------------------------------------------------------------------------------------------------
# check: no model is loaded

def test_shipped_profiles_pass_check_without_loading(no_model_loading, tmp_path, monkeypatch, capsys):
    for name in ("QWEN3_30B_A3B_DIR", "QWEN3_5_397B_A17B_DIR", "QWEN3_NEXT_80B_A3B_DIR", "GLM_4_5_AIR_DIR",
                 "MINIMAX_M2_DIR", "DEEPSEEK_V3_DIR", "GPT_OSS_20B_DIR", "GPT_OSS_120B_DIR", "KIMI_K2_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    for path in sorted(SHIPPED_DIR.glob("*.yaml")):
        assert main(["profiles", "check", str(path)]) == 0
        out, err = capsys.readouterr()
        assert out == f"ok: {path.resolve()}\n" and err == ""


def test_check_reports_a_missing_model_relative_to_the_profile(no_model_loading, tmp_path, capsys):
    path = write(tmp_path / "sub" / "p.yaml", "dtype: float32\nmodel: weights/qwen\n")
    assert main(["profiles", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"tsterm: error: {path.resolve()}:2: ")
    assert str(tmp_path / "sub" / "weights" / "qwen") in err
    (tmp_path / "sub" / "weights" / "qwen").mkdir(parents=True)
    assert main(["profiles", "check", str(path)]) == 0


def test_check_unknown_demo_and_missing_model(no_model_loading, tmp_path, capsys):
    path = write(tmp_path / "p.yaml", "model: demo:huge\n")
    assert main(["profiles", "check", str(path)]) == 2
    assert "demo:huge" in capsys.readouterr().err
    empty = write(tmp_path / "empty.yaml", "description: nothing\n")
    assert main(["profiles", "check", str(empty)]) == 2
    assert f"{empty.resolve()}:1: no `model` set" in capsys.readouterr().err


def test_check_error_is_one_line_exit_2(tmp_path, capsys):
    path = write(tmp_path / "p.yaml", "model: m\nsampling:\n  temprature: 1\n")
    (tmp_path / "m").mkdir()
    assert main(["profiles", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"tsterm: error: {path.resolve()}:3: unknown sampling key 'temprature' "
                                 "(did you mean 'temperature'?)\n")


# --------------------------------------------------------------------------------------------------
# list / show

def test_profiles_list(tmp_path, capsys):
    write(tmp_path / "profiles" / "default.yaml", "description: my own default\nmodel: m\n")
    assert main(["profiles", "list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["agent-demo", "bench", "bench-hybrid",
                                                                 "deepseek-v3", "default", "glm-4.5-air",
                                                                 "gpt-oss-120b", "gpt-oss-20b", "kimi-k2",
                                                                 "minimax-m2", "moe-demo",
                                                                 "qwen3-30b-a3b", "qwen3-next-80b-a3b",
                                                                 "qwen3.5-397b-a17b"]
    assert "my own default" in out and str(tmp_path / "profiles" / "default.yaml") in out
    assert str(SHIPPED_DIR / "default.yaml") not in out


def test_profiles_show_is_resolved_yaml_without_loading(no_model_loading, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TSTERM_TEST_DIR", "/models")
    write(tmp_path / "profiles" / "child.yaml", "extends: moe-demo\nmodel: ${TSTERM_TEST_DIR}/q\nblock_size: 32\n")
    assert main(["profiles", "show", "child"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"] == "/models/q" and shown["block_size"] == 32
    assert shown["sampling"] == {"temperature": 0.7, "max_tokens": 128}
    assert shown["description"] == "small Qwen3-MoE trained on Shakespeare (shipped with tsterm)" and "extends" not in shown
    assert main(["profiles", "show", "default"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"] == "smollm2-135m-instruct"


def test_profiles_show_unknown_name_exit_2(capsys):
    assert main(["profiles", "show", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("tsterm: error: no profile named 'nope'")


def test_a_profile_with_a_ui_section_loads_where_textual_is_not_installed():
    """The GPU machine has no Textual: no TUI runs there to show a theme, and the profile must still load."""
    code = ("import sys\nsys.modules['textual'] = None  # as if it were not installed\n"
            "from tsterm.profiles import SHIPPED_DIR, load_profile\n"
            "profile = load_profile(str(SHIPPED_DIR / 'default.yaml'))\n"
            "print(profile.ui['theme'], profile.ui_options().dashboard)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["textual-dark", "auto"]


# --------------------------------------------------------------------------------------------------
# every error of a file; the KV budget against the context; the "looked in" list

def test_check_reports_every_error_in_file_order(no_model_loading, tmp_path, capsys):
    path = write(tmp_path / "p.yaml", """
        blok_size: 16
        model: m
        sampling:
          temprature: 0.5
          top_p: 2
        device: tpu
        """)
    assert main(["profiles", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and [line.split(": ")[2].split(":")[1] for line in lines] == ["1", "2", "4", "5", "6"], err
    assert ["blok_size" in lines[0], "'m' does not exist" in lines[1], "temprature" in lines[2],
            "top_p" in lines[3], "tpu" in lines[4]] == [True] * 5, err
    with pytest.raises(ConfigError, match="blok_size"):  # loading still stops at the first
        load_profile(str(path))


def test_check_and_show_warn_when_the_context_outgrows_the_kv_budget(no_model_loading, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, '
                                       '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, '
                                       '"vocab_size": 320, "max_position_embeddings": 4096}')
    per_token = 2 * 2 * 2 * 16 * 4  # layers x KV heads x (K, V) x head_dim x float32
    text = "model: m\ndtype: float32\nblock_size: 16\nkv_cache_memory: {budget}\nmax_model_len: {context}\n"
    path = write(tmp_path / "p.yaml", text.format(budget=per_token * 16 * 10, context=512))
    for action in ("check", "show"):
        assert main(["profiles", action, str(path)]) == 0
        warning = capsys.readouterr().err
        assert warning.startswith(f"tsterm: warning: {path.resolve()}:5: the context is 512 tokens but the KV budget "
                                  f"holds 160 ") and f"{per_token} bytes per token" in warning, warning
        assert f"raise kv_cache_memory to {per_token * 512}" in warning and warning.count("\n") == 1
    write(path, text.format(budget=per_token * 512, context=512))
    assert main(["profiles", "check", str(path)]) == 0 and capsys.readouterr().err == ""
    write(path, "model: m\ndtype: bfloat16\nnum_kv_blocks: 8\n")  # no max_model_len: the model's own 4096
    assert main(["profiles", "check", str(path)]) == 0
    assert "the context is 4096 tokens but the KV budget holds 128 (num_kv_blocks 8" in capsys.readouterr().err


def test_a_missing_profile_names_each_folder_once(monkeypatch, capsys):
    monkeypatch.chdir(SHIPPED_DIR.parent)  # in a clone, ./profiles is the shipped folder
    assert main(["run", "--profile", "no-such-profile", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count(str(SHIPPED_DIR)) == 1 and "no-such-profile.yaml and no-such-profile.yml" in err, err


def test_server_conversation_bounds_reach_the_server_limits(tmp_path):
    from tsterm.server.serve import server_limits

    profile = load_profile(write(tmp_path / "s.yaml", "model: m\nserver:\n  max_conversations: 8\n"
                                 "  cors_origins: [http://localhost:3000]\n  cache_isolation: per_key\n"))
    assert server_limits(profile.server_settings()) == {
        "max_conversations": 8, "conversation_ttl_s": 3600.0, "max_stored_responses": 64, "response_ttl_s": 3600.0,
        "cors_origins": ("http://localhost:3000",), "allowed_hosts": (), "cache_isolation": "per_key"}
    from tsterm.server.state import ServerLimits

    ServerLimits(**server_limits(profile.server_settings()))  # every key is a ServerLimits field


@pytest.mark.parametrize("text, error", [("cors_origins: '*'", "cors_origins must be a list"),
                                         ("allowed_hosts: ['']", "allowed_hosts must be a list"),
                                         ("cache_isolation: per_user", "cache_isolation must be none or per_key"),
                                         ("max_stored_responses: -1", "max_stored_responses must be"),
                                         ("response_ttl_s: .inf", "response_ttl_s must be")])
def test_server_keys_are_checked(tmp_path, text, error):
    with pytest.raises(ConfigError, match=error):
        load_profile(write(tmp_path / "s.yaml", f"model: m\nserver:\n  {text}\n")).server_settings()


def test_speculative_nested_form_sets_the_two_engine_keys_with_errors_at_their_lines(tmp_path):
    good = tmp_path / "spec.yaml"
    good.write_text("model: demo:moe\nspeculative:\n  method: suffix\n  num_tokens: 6\n")
    options = load_profile(str(good)).engine_options()
    assert (options["speculative_method"], options["num_speculative_tokens"]) == ("suffix", 6)
    cases = {
        "speculative:\n  method: eagle\n": r"bad.yaml:3: .*speculative_method must be",
        "speculative:\n  num_tokens: 0\n": r"bad.yaml:3: .*num_speculative_tokens",
        "speculative:\n  method: suffix\n  tokens: 4\n": r"bad.yaml:4: unknown speculative key 'tokens'",
        "speculative_method: ngram\nspeculative:\n  method: suffix\n": r"bad.yaml:4: speculative.method and "
                                                                         r"speculative_method both set",
        "speculative: suffix\n": r"bad.yaml:2: `speculative` must be a mapping",
    }
    for body, message in cases.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text("model: demo:moe\n" + body)
        with pytest.raises(ConfigError, match=message):
            load_profile(str(bad))
