"""`tsterm chat --plain` (and chat on a pipe): a line-mode chat, like ollama's.

On a terminal: a `>>> ` prompt with line editing; ctrl+c stops the reply (the request is aborted, the partial reply
kept), not the chat; keys typed while a reply streams are not echoed into it (and are dropped); ctrl+d or `/bye`
leaves. Slash commands (`/help`, `/new`, `/system [TEXT]`, `/bye`) are handled here, never sent to the model. On a
pipe: one message per line, the reply on stdout, nothing else there. Either way each chat keeps the exact token ids
between turns and is saved in the TUI's session store, so `tsterm` shows it afterwards. Each turn is planned under the
profile's thinking-history policy (`history_policy`, tsterm.chat.history): under `preserve` (the default) a reasoning
template that drops earlier `<think>` blocks changes nothing the engine computed; a turn `preserve` cannot take (the
last reply was stopped or cut at max_tokens, the system prompt changed) is planned as the template renders it, and
when that costs a miss the status line says why. Prompts are rendered and replies read by the model's chat format
(`chat_format`, tsterm.chat.chat_format; the caller passes `tsterm.agent.harmony.chat_format(llm.tokenizer)`, the
checkpoint's template when none is given): a gpt-oss reply's analysis channel is shown as a `<think>` block, as a
reasoning family's reply is, and its final channel as the reply.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from tsterm.chat.chat_format import ChatFormat, TemplateFormat
from tsterm.chat.history import PRESERVE, check_policy, request_stop_ids
from tsterm.chat.session import Session, TurnStats, new_session_id
from tsterm.chat.store import SessionStore
from tsterm.config import SamplingParams
from tsterm.errors import EngineStepError, RequestError

PROMPT = ">>> "
HELP = """commands:
  /new            start a new chat (this one stays saved)
  /system [TEXT]  set the system prompt (empty: show it)
  /help           this list
  /bye            leave (also /exit, ctrl+d)
ctrl+c stops a reply; a message starting with // sends a literal /."""


class LineChat:
    """One line-mode conversation loop over an LLM; `store` None keeps nothing (tests)."""

    def __init__(self, llm: Any, params: SamplingParams, system_prompt: str | None, store: SessionStore | None,
                 stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None,
                 interactive: bool | None = None, history_policy: str = PRESERVE,
                 chat_format: ChatFormat | None = None):
        """`stdin`/`stdout`/`stderr` default to the process's streams as they are now (not at import).
        `history_policy`: `preserve` or `template` (a profile's `thinking_history`). `chat_format`: how the model's
        turns are written and read (default: its chat template)."""
        self.llm, self.params, self.store = llm, params, store
        self.format = chat_format if chat_format is not None else TemplateFormat(llm.tokenizer)
        self.history_policy = check_policy(history_policy)
        self.stdin, self.stdout, self.stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
        stdin, stdout = self.stdin, self.stdout
        self.interactive = stdin.isatty() and stdout.isatty() if interactive is None else interactive
        self.system_prompt = system_prompt
        self.model_key = str(Path(llm.engine.config.model).resolve())
        self.session = self._new_session()
        self._stop = threading.Event()

    def _new_session(self) -> Session:
        session = Session(id=new_session_id(), model=self.model_key)
        session.set_system_prompt(self.system_prompt)
        return session

    def _note(self, text: str) -> None:
        """Status lines: stderr, so a pipe's stdout carries only replies."""
        print(text, file=self.stderr, flush=True)

    # ---- the loop
    def run(self) -> int:
        while True:
            try:
                line = self._read()
            except KeyboardInterrupt:  # at the prompt: say how to leave, as ollama does
                self.stdout.write("\n")
                self._note("(use /bye or ctrl+d to leave)")
                continue
            if line is None:  # end of input
                if self.interactive:
                    self.stdout.write("\n")
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and not text.startswith("//"):
                if self._command(text) == "bye":
                    return 0
                continue
            self.turn(line[1:] if text.startswith("//") else line)

    def _read(self) -> str | None:
        if self.interactive:
            try:
                return input(PROMPT)
            except EOFError:
                return None
        line = self.stdin.readline()
        return line.rstrip("\n") if line else None

    def _command(self, text: str) -> str | None:
        name, _, arg = text[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ("bye", "exit", "quit"):
            return "bye"
        if name == "help":
            self._note(HELP)
        elif name == "new":
            self.session = self._new_session()
            self._note("(new chat)")
        elif name == "system" and arg:
            self.session.set_system_prompt(arg)
            self._save()
            self._note("(system prompt set)")
        elif name == "system":
            self._note(f"system prompt: {self.session.system_prompt or '(none)'}")
        else:
            self._note(f"unknown command /{name}: try /help (commands: /new, /system, /help, /bye)")
        return None

    # ---- a turn
    def turn(self, text: str) -> None:
        session = self.session
        session.add_user(text)
        tokenizer = self.llm.tokenizer
        plan = session.plan(self.format.render, tokenizer, self.history_policy,
                            request_stop_ids(self.llm.engine.eos_token_ids, self.params))
        reader = self.format.reader()
        try:
            out = self._generate(plan.token_ids, reader)
        # the conversation outgrew the context, or the engine failed on this reply (and serves on): report it, keep
        # the chat as it was
        except (RequestError, EngineStepError) as e:
            session.drop_last_user()
            self._note(f"tsterm: error: {e}")
            return
        self.stdout.write("\n")
        self.stdout.flush()
        aborted = not out.finished
        completion = out.outputs[0]
        session.record_reply(plan, reader.shown, list(completion.token_ids), TurnStats.from_plan(
            plan, out.num_cached_tokens, len(completion.token_ids),
            finish_reason="abort" if aborted else completion.finish_reason), message=reader.message())
        self._save()
        if aborted:
            self._note("(stopped)")
        if plan.miss:  # (a `preserve` turn that fell back and kept every id cost nothing: its turn stats say why)
            lost = len(plan.token_ids) - out.num_cached_tokens
            why = f"; preserve could not apply: {plan.fallback_reason}" if plan.fallback_reason else ""
            self._note(f"[the chat template wrote the earlier conversation differently from token {plan.diverged_at} "
                       f"on, so {lost} tokens were computed again instead of reused{why}]")
        self._note(f"[cached {out.num_cached_tokens}/{len(plan.token_ids)} tokens]")

    def _generate(self, prompt_ids: list[int], reader: Any) -> Any:
        """Stream one reply, shown as `reader` reads it; ctrl+c (or `stop()`) ends it after the current step, its
        partial output returned (and read to its end)."""
        engine = self.llm.engine
        request_id = engine.add_request(prompt_ids, self.params)
        self._stop.clear()
        last = None
        with self._sigint_stops(), _quiet_terminal(self.stdin if self.interactive else None):
            try:
                while last is None or not last.finished:
                    if self._stop.is_set():
                        engine.abort(request_id)
                        break
                    for out in engine.step():
                        if out.request_id != request_id:
                            continue
                        last = out
                        self._show(reader.read(out.outputs[0], out.finished))
            except BaseException:
                engine.abort(request_id)
                raise
        if last is None:  # stopped before the first token
            last = _empty_output(request_id, prompt_ids)
        self._show(reader.read(last.outputs[0], True))  # a reply cut short: what the reader held back
        if last.error is not None:
            raise EngineStepError(f"the engine failed on this reply ({type(last.error).__name__}: {last.error})") \
                from last.error
        return last

    def _show(self, text: str) -> None:
        if text:
            self.stdout.write(text)
            self.stdout.flush()

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def _sigint_stops(self) -> Iterator[None]:
        """While a reply streams, ctrl+c asks it to stop (between two steps) instead of raising."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, lambda *_: self.stop())
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _save(self) -> None:
        if self.store is None:
            return
        try:
            self.store.save(self.session)
        except OSError as e:
            self._note(f"tsterm: could not save the chat: {e}")


@contextlib.contextmanager
def _quiet_terminal(stdin: TextIO | None) -> Iterator[None]:
    """No echo of keys typed while a reply streams (they would land inside it); what was typed is dropped."""
    if stdin is None:
        yield
        return
    try:
        import termios

        fd = stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
        termios.tcflush(fd, termios.TCIFLUSH)


def _empty_output(request_id: str, prompt_ids: list[int]) -> Any:
    from tsterm.outputs import CompletionOutput, RequestMetrics, RequestOutput

    return RequestOutput(request_id, list(prompt_ids), [CompletionOutput(0, [], "")], 0, RequestMetrics())


def run(llm: Any, params: SamplingParams, system_prompt: str | None,
        store_factory: Callable[[], SessionStore] = SessionStore, history_policy: str = PRESERVE,
        chat_format: ChatFormat | None = None) -> int:
    """`tsterm chat --plain`: the loop on this process's stdin/stdout, chats saved in the session store."""
    return LineChat(llm, params, system_prompt, store_factory(), history_policy=history_policy,
                    chat_format=chat_format).run()
