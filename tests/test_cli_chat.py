"""`tsterm chat --plain`: line-mode multi-turn chat that keeps the exact token ids between turns."""
from __future__ import annotations

import io
import re
import sys

import pytest

from tests.helpers.checkpoints import make_checkpoint
from tsterm.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("chat") / "qwen3_moe", "qwen3_moe",
                              {"num_experts": 4, "num_experts_per_tok": 2})
    return str(path)


@pytest.fixture(autouse=True)
def small_kv_pool(monkeypatch, tmp_path):
    monkeypatch.setattr("tsterm.engine.executor.CPU_DEFAULT_KV_BYTES", 8 << 20)
    monkeypatch.setenv("TSTERM_DATA_DIR", str(tmp_path / "data"))  # line-mode chats are saved in the store


def chat(model_dir: str, stdin: str, monkeypatch, capsys, *extra: str) -> tuple[int, list[str], list[tuple[int, int]]]:
    """(exit code, reply lines, (cached, prompt) per turn)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["chat", "--plain", "--model", model_dir, "--max-tokens", "6", "--temperature", "0", *extra])
    out, err = capsys.readouterr()
    turns = [(int(a), int(b)) for a, b in re.findall(r"^\[cached (\d+)/(\d+) tokens\]$", err, re.MULTILINE)]
    return code, out.splitlines(), turns


def test_two_turns_reuse_the_first_turns_tokens(model_dir, monkeypatch, capsys):
    code, replies, turns = chat(model_dir, "hello there\nand what about tomorrow?\n", monkeypatch, capsys)
    assert code == 0
    assert len(replies) == 2 and len(turns) == 2
    (cached_1, prompt_1), (cached_2, prompt_2) = turns
    assert cached_1 == 0
    assert prompt_2 > prompt_1 and cached_2 > 0


def test_next_prompt_is_the_kept_ids_plus_the_tokens_of_the_new_text(model_dir, monkeypatch, capsys):
    from tsterm.chat.line_chat import LineChat
    calls: list[tuple[object, list[int], object]] = []
    generate = LineChat._generate

    def recording(self, prompt_ids, reader):
        out = generate(self, prompt_ids, reader)
        calls.append((self.llm, list(prompt_ids), out))
        return out

    monkeypatch.setattr(LineChat, "_generate", recording)
    code, _, _ = chat(model_dir, "hi\nmore\n", monkeypatch, capsys, "--system", "Be brief.")
    assert code == 0 and len(calls) == 2
    (llm, prompt_1, out_1), (_, prompt_2, _) = calls
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert prompt_1 == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    messages += [{"role": "assistant", "content": out_1.text}, {"role": "user", "content": "more"}]
    tokenizer = llm.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kept = prompt_1 + list(out_1.token_ids)
    kept_text = tokenizer.decode(kept, skip_special_tokens=False)
    assert tokenizer.decode(prompt_2, skip_special_tokens=False) == rendered
    if rendered.startswith(kept_text):
        assert prompt_2 == kept + tokenizer.encode(rendered[len(kept_text):])
    else:  # a random model's reply held a special token, which its text leaves out: the ids before it are kept
        assert prompt_2[:len(prompt_1)] == prompt_1 and prompt_2[:len(kept)] != kept


def test_exit_command_ends_the_chat(model_dir, monkeypatch, capsys):
    code, replies, turns = chat(model_dir, "hi\n/exit\nnever answered\n", monkeypatch, capsys)
    assert code == 0 and len(replies) == 1 and len(turns) == 1


def test_eof_ends_the_chat(model_dir, monkeypatch, capsys):
    code, replies, turns = chat(model_dir, "", monkeypatch, capsys)
    assert (code, replies, turns) == (0, [], [])


@pytest.mark.parametrize("flags, policy", [((), "preserve"), (("--thinking-history", "template"), "template"),
                                           (("--profile", "tpl.yaml"), "template")])
def test_the_thinking_history_policy_comes_from_the_flag_or_the_profile(model_dir, monkeypatch, capsys, tmp_path,
                                                                        flags, policy):
    """The saved session's first turn says which policy planned it (the second falls back: the first reply was cut
    at --max-tokens, so only the first shows the choice)."""
    from tsterm.chat.store import SessionStore

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tpl.yaml").write_text(f"model: {model_dir}\nthinking_history: template\n")
    model = () if "--profile" in flags else ("--model", model_dir)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand tomorrow?\n"))
    assert main(["chat", "--plain", *model, "--max-tokens", "6", "--temperature", "0", *flags]) == 0
    capsys.readouterr()
    [session], errors = SessionStore().load_all()
    assert not errors and [t.policy_applied for t in session.turns] == [policy, "template"]
    assert session.turns[1].fallback_reason == (None if policy == "template" else
                                                "the last reply did not end with a stop token (cut by max_tokens or "
                                                "a stop string)")
