"""Agent turns under the tool-call grammar (tsterm/agent/tool_grammar.py, on by default in tsterm/agent/loop.py).

A tiny random checkpoint, sampled at temperature 1, writes `<tool_call>` often and garbage after it: unconstrained,
its calls are malformed; under the grammar, the same seeds give only calls of the offered tools whose arguments
validate against their schemas (jsonschema), a call cut by max_tokens at the very end being the only incomplete one.
The grammar itself, token by token on llguidance: free text, a reasoning block, calls of the offered tools only,
nothing after the calls, the end-of-turn and stop tokens only where the reply may end, the open tag never spelled in
text, a template whose open tag is text. A tool whose schema llguidance cannot compile: the session runs
unconstrained and says so once (`tsterm agent`: one warning line); `--no-constrain-tool-calls` and the profile key."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import llguidance
import pytest

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.tokenizers import make_tokenizer_dir
from tsterm import LLM
from tsterm.agent.loop import Agent, AgentOptions, StepFinished
from tsterm.agent.tool_grammar import ChatTokens, agent_grammar, call_form, tool_parameters
from tsterm.agent.tools import Calculator, Tool
from tsterm.cli import main
from tsterm.config import SamplingParams
from tsterm.engine.async_engine import AsyncEngine
from tsterm.errors import ConfigError
from tsterm.profiles import AgentSettings
from tsterm.tokenizer import Tokenizer

AGENT_DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "agent_demo"
SEEDS = range(12)
CUT = "the output ended before"  # the parser's word for a call that max_tokens cut short


class SchemaTool(Tool):
    description = "a test tool"

    def __init__(self, name: str, parameters: dict):
        self.name, self.parameters = name, parameters

    def run(self, arguments: dict) -> str:
        return "ok"


TOOLS = [SchemaTool("dice", {"type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 9}},
                             "required": ["sides"], "additionalProperties": False}),
         SchemaTool("pick", {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]},
                                                              "bold": {"type": "boolean"}},
                             "required": ["colour"], "additionalProperties": False}),
         SchemaTool("note", {"type": "object", "properties": {"text": {"type": "string", "maxLength": 6}},
                             "required": ["text"]})]
SCHEMAS = {tool.name: tool.parameters for tool in TOOLS}
LOOKBEHIND = SchemaTool("grep_after", {"type": "object", "properties": {"pattern": {"type": "string",
                                                                                    "pattern": "(?<=a)b"}}})


@pytest.fixture(scope="module")
def random_llm(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("random"), "qwen3_moe", {"max_position_embeddings": 4096})
    return LLM(str(path), device="cpu")


async def _turns(llm: LLM, tools: list[Tool], constrain: bool, backend=None) -> list[tuple[Agent, object]]:
    """One single-step turn per seed at temperature 1, all at once on one engine: (agent, its step)."""
    engine = backend or AsyncEngine(llm.engine)
    agents = [Agent(engine, llm.tokenizer, tools, SamplingParams(temperature=1.0, max_tokens=300, seed=seed),
                    options=AgentOptions(max_steps=1), constrain_tool_calls=constrain) for seed in SEEDS]

    async def turn(agent: Agent):
        events = [event async for event in agent.run("Roll a die, then pick a colour.")]
        await agent.close()
        (step,) = [e.step for e in events if isinstance(e, StepFinished)]
        return agent, step

    try:
        return await asyncio.gather(*(turn(agent) for agent in agents))
    finally:
        if backend is None:
            engine.shutdown()


def test_constrained_turns_make_only_valid_calls_where_free_ones_are_malformed(random_llm):
    constrained = asyncio.run(_turns(random_llm, TOOLS, True))
    valid = 0
    for agent, step in constrained:
        assert agent.constrains_tool_calls and agent.constraint_note is None
        for n, call in enumerate(step.tool_calls):
            if step.finish_reason == "length" and n == len(step.tool_calls) - 1 and call.error and CUT in call.error:
                continue  # max_tokens ended the reply inside its last call: cut, not malformed
            assert call.error is None, (step.raw, call.error)
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
            valid += 1
    assert valid >= len(SEEDS)  # the grammar made calls (not a test that passes on text alone)
    ends = [agent.session.token_ids[-1] for agent, step in constrained if step.finish_reason == "stop"]
    assert ends and all(end in constrained[0][0].stop_ids for end in ends)  # end-of-turn tokens still end replies

    free = asyncio.run(_turns(random_llm, TOOLS, False))
    assert not any(agent.constrains_tool_calls for agent, _ in free)
    malformed = [call.error for _, step in free for call in step.tool_calls if call.error and CUT not in call.error]
    assert malformed  # the same seeds, unconstrained: calls the parser refuses


class _Recording:
    """An AsyncEngine that records each request's params."""

    def __init__(self, engine: AsyncEngine):
        self.inner, self.engine, self.params = engine, engine.engine, []

    def generate(self, prompt, params=None, request_id=None):
        self.params.append(params)
        return self.inner.generate(prompt, params, request_id=request_id)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_schema_llguidance_cannot_compile_runs_the_session_unconstrained_and_says_so(random_llm):
    engine = AsyncEngine(random_llm.engine)
    recording = _Recording(engine)
    try:
        turns = asyncio.run(_turns(random_llm, [*TOOLS, LOOKBEHIND], True, backend=recording))
        constrained = asyncio.run(_turns(random_llm, TOOLS, True, backend=recording))
    finally:
        engine.shutdown()
    for agent, step in turns:
        assert not agent.constrains_tool_calls and step.finish_reason in ("stop", "length")
        assert "tool 'grep_after'" in agent.constraint_note and "look-around" in agent.constraint_note
        assert "\n" not in agent.constraint_note
    assert all(p.structured_outputs is None for p in recording.params[:len(SEEDS)])
    assert all(p.structured_outputs is not None for p in recording.params[len(SEEDS):])  # the recorder sees grammars
    assert all(agent.constrains_tool_calls for agent, _ in constrained)


# ---- the grammar, token by token


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> ChatTokens:
    return ChatTokens(Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _consumes(tokens: ChatTokens, grammar: str, ids: list[int]) -> tuple[bool, bool]:
    """(every id taken, the grammar may end there)."""
    matcher = llguidance.LLMatcher(tokens.lltokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(i) for i in ids), matcher.is_accepting()


def _accepts(tokens: ChatTokens, grammar: str, text: str) -> bool:
    taken, accepting = _consumes(tokens, grammar, tokens.tokenizer.encode(text))
    return taken and accepting


def test_the_grammar_allows_text_reasoning_and_calls_of_the_offered_tools_only(tokens):
    grammar = agent_grammar(tokens, call_form(tokens), tool_parameters([t.spec() for t in TOOLS]))
    good = ["", "The answer is 4.", "<think>\nmaybe dice\n</think>\n\nNo tool needed.",
            "Rolling.\n" + _call("dice", {"sides": 6}),
            "<think>x</think>" + _call("dice", {"sides": 2}) + "\n" + _call("pick", {"colour": "red", "bold": True})]
    for text in good:
        assert _accepts(tokens, grammar, text), text
    bad = [_call("dice", {"sides": 10}),  # out of the schema's range
           _call("dice", {}),  # its required argument missing
           _call("dice", {"sides": 3, "extra": 1}),  # additionalProperties: false
           _call("pick", {"colour": "green"}),  # not in the enum
           _call("roll", {"sides": 3}),  # not an offered tool
           _call("dice", {"sides": 3}) + " and more text",  # nothing but calls after the first call
           "before <think>late</think>",  # reasoning comes first
           "<tool_call>\n{\"name\": \"dice\""]  # inside a call the reply cannot end
    for text in bad:
        assert not _accepts(tokens, grammar, text), text
    tokenizer = tokens.tokenizer
    piecewise = tokenizer.encode("see <") + tokenizer.encode("tool") + tokenizer.encode("_call>")
    assert not _consumes(tokens, grammar, piecewise)[0]  # text never spells the open tag the parser reads


def test_a_prompt_that_opened_the_reasoning_is_finished_first_and_stop_tokens_end_the_reply(tokens):
    tokenizer = tokens.tokenizer
    eot = tokenizer.token_to_id("<|eot_id|>")
    opened = agent_grammar(tokens, call_form(tokens), tool_parameters([t.spec() for t in TOOLS]), opened=True,
                           stop_token_ids=[eot])
    assert _accepts(tokens, opened, "weighing it</think>\n\n" + _call("dice", {"sides": 4}))
    assert not _accepts(tokens, opened, "<think>again</think>answer")  # the block is open already
    assert _consumes(tokens, opened, tokenizer.encode("ok</think>done") + [eot]) == (True, True)
    inside = tokenizer.encode("ok</think>" + _call("dice", {"sides": 4})[:-len("\n</tool_call>")])
    assert not _consumes(tokens, opened, inside + [eot])[0]  # a stop token cannot cut a call


def test_a_template_whose_open_tag_is_text_is_constrained_too(tmp_path, tokens):
    # the same vocabulary without the tool-call tags as tokens: the template's <tool_call> is plain text
    directory = make_tokenizer_dir(tmp_path)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if "tool_call" not in t["content"]]
    (directory / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {k: v for k, v in config.get("added_tokens_decoder", {}).items()
                                      if "tool_call" not in v["content"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    text_tags = ChatTokens(Tokenizer.from_dir(directory))
    assert len(text_tags.tokenizer.encode("<tool_call>")) > 1
    grammar = agent_grammar(text_tags, call_form(text_tags), tool_parameters([t.spec() for t in TOOLS]))
    assert _accepts(text_tags, grammar, "plain text")
    assert _accepts(text_tags, grammar, "Rolling. " + _call("dice", {"sides": 3}) + "\n" + _call("note", {"text": "x"}))
    for bad in ("Rolling. " + _call("dice", {"sides": 1}), _call("dice", {"sides": 3}) + " more",
                "Rolling. <tool_call> and text"):
        assert not _accepts(text_tags, grammar, bad), bad


# ---- the switch: default on, the profile key, the CLI flag, one warning line


def test_the_profile_key_is_checked():
    assert AgentSettings().constrain_tool_calls is True
    assert AgentSettings(constrain_tool_calls=False).constrain_tool_calls is False
    with pytest.raises(ConfigError, match="constrain_tool_calls must be true or false"):
        AgentSettings(constrain_tool_calls="yes")


def test_tsterm_agent_constrains_by_default_and_the_flag_turns_it_off(capsys, tmp_path):
    for flags, constrained in (([], True), (["--no-constrain-tool-calls"], False)):
        code = main(["agent", "--model", str(AGENT_DEMO), "--tools", "calculator", "--device", "cpu", "--json",
                     "--workspace", str(tmp_path), *flags, "What is 37 * 12?"])
        captured = capsys.readouterr()
        out = json.loads(captured.out)
        assert code == 0 and out["constrained_tool_calls"] is constrained and "warning" not in captured.err
        assert out["steps"][0]["tool_calls"][0]["arguments"] == {"expression": "37 * 12"} and "444" in out["answer"]


def test_tsterm_agent_with_a_schema_llguidance_cannot_compile_warns_once_and_runs(capsys, tmp_path):
    profile = tmp_path / "p.yaml"
    tool = {"name": "after", "description": "find b after a", "argv": ["true"],
            "parameters": LOOKBEHIND.parameters}
    profile.write_text(f"extends: agent-demo\nagent:\n  command_tools: [{json.dumps(tool)}]\n")
    code = main(["agent", "--profile", str(profile), "--tools", "calculator", "--device", "cpu", "--json",
                 "--workspace", str(tmp_path), "What is 37 * 12?"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    warnings = [line for line in captured.err.splitlines() if line.startswith("tsterm: warning:")]
    assert out["steps"] and out["reason"] in ("answer", "max_steps") and out["constrained_tool_calls"] is False
    assert len(warnings) == 1 and "tool 'after'" in warnings[0] and "look-around" in warnings[0], captured.err


def test_a_profile_turns_it_off(capsys, tmp_path):
    profile = tmp_path / "off.yaml"
    profile.write_text("extends: agent-demo\nagent:\n  constrain_tool_calls: false\n")
    code = main(["agent", "--profile", str(profile), "--tools", "calculator", "--device", "cpu", "--json",
                 "--workspace", str(tmp_path), "--max-steps", "1", "What is 5 + 8?"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["constrained_tool_calls"] is False  # one step: the call, no answer


def test_calculator_and_builtins_compile(tokens):
    """The built-in tools' schemas are ones llguidance takes (the default session is constrained)."""
    from tsterm.agent.tools import Grep, ListDir, ReadFile, RunCommand, WriteFile
    specs = [Calculator().spec()] + [cls.__new__(cls).spec() for cls in (ReadFile, ListDir, Grep, WriteFile, RunCommand)]
    grammar = agent_grammar(tokens, call_form(tokens), tool_parameters(specs))
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokens.lltokenizer)
    assert not error, messages


# ---- the Qwen3-Coder XML call form


class XmlTemplate:
    """The tiny tokenizer with a template that writes assistant tool calls in the XML form (as Qwen3-Coder's)."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        def xml(call):
            fn = call["function"]
            parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in fn["arguments"].items())
            return f"<tool_call>\n<function={fn['name']}>\n{parameters}</function>\n</tool_call>"

        rendered = [{**m, "content": (m.get("content") or "") + "\n".join(xml(c) for c in m["tool_calls"])}
                    if m.get("tool_calls") else m for m in messages]
        return self.inner.apply_chat_template(rendered, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


XML_TOOLS = [TOOLS[0], SchemaTool("toggle", {"type": "object", "properties": {"on": {"type": "boolean"},
                                                                               "times": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 3}},
                                             "required": ["on"]})]


def test_the_xml_form_holds_each_parameter_to_its_schema(tokens):
    xml = ChatTokens(XmlTemplate(tokens.tokenizer), tokens.lltokenizer)
    form = call_form(xml)
    assert form.xml is not None
    grammar = agent_grammar(xml, form, tool_parameters([t.spec() for t in XML_TOOLS]))

    def call(name, parameters):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
        return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"

    assert _accepts(xml, grammar, "ok " + call("dice", {"sides": 4}) + "\n" + call("toggle", {"on": "true", "times": 2}))
    for bad in (call("dice", {"sides": 12}), call("toggle", {"times": 2}), call("toggle", {"on": "maybe"}),
                call("roll", {"sides": 3}), _call("dice", {"sides": 3})):  # the JSON form is not this template's
        assert not _accepts(xml, grammar, bad), bad


def test_constrained_turns_with_an_xml_form_template_make_valid_calls(random_llm):
    """The agent loop end to end on the XML form: the grammar writes what the XML parser reads."""
    engine = AsyncEngine(random_llm.engine)
    xml = XmlTemplate(random_llm.tokenizer)
    agents = [Agent(engine, xml, XML_TOOLS, SamplingParams(temperature=1.0, max_tokens=300, seed=seed),
                    options=AgentOptions(max_steps=1)) for seed in SEEDS]

    async def turn(agent: Agent):
        events = [event async for event in agent.run("Roll a die.")]
        await agent.close()
        return next(e.step for e in events if isinstance(e, StepFinished))

    async def turns():
        return await asyncio.gather(*(turn(agent) for agent in agents))

    try:
        steps = asyncio.run(turns())
    finally:
        engine.shutdown()
    schemas = {tool.name: tool.parameters for tool in XML_TOOLS}
    valid = 0
    for step in steps:
        for n, call in enumerate(step.tool_calls):
            if step.finish_reason == "length" and n == len(step.tool_calls) - 1 and call.error and CUT in call.error:
                continue
            assert call.error is None and "<function=" in call.raw, (call.raw, call.error)
            jsonschema.validate(call.arguments, schemas[call.name])
            valid += 1
    assert all(agent.constrains_tool_calls for agent in agents) and valid >= len(SEEDS) // 2


# ---- the TUI's agent runs: the setting reaches the loop, the warning reaches the screen once


class _View:
    """An AgentView that keeps the reports and otherwise shows nothing."""

    def __init__(self):
        self.reports: list[tuple[str, bool]] = []

    async def report(self, session, text, error):
        self.reports.append((text, error))

    def showing_step(self, session):
        return False

    def call_changed(self, session, call, status=None):
        pass

    async def approve(self, session, call, tool, workspace):
        return True

    def __getattr__(self, name):  # step_started, step_text, call_parsed, step_finished, task_ended
        async def shown(*args):
            pass
        return shown


@pytest.mark.parametrize("constrain", [True, False])
def test_the_tui_agent_run_takes_the_setting_and_reports_an_uncompilable_schema_once(random_llm, tmp_path, constrain):
    from types import SimpleNamespace

    from tsterm.chat.store import SessionStore
    from tsterm.tui.controllers.agent import AgentRuns
    from tsterm.tui.controllers.sessions import SessionBook

    tool = {"name": "after", "description": "find b after a", "argv": ["true"], "parameters": LOOKBEHIND.parameters}
    engine = AsyncEngine(random_llm.engine)
    host = SimpleNamespace(agent=AgentSettings(tools=["calculator"], command_tools=[tool],
                                               constrain_tool_calls=constrain),
                           agent_backend=engine, tokenizer=random_llm.tokenizer, thinking_history="preserve",
                           sampling=SamplingParams(temperature=0, max_tokens=8), model_key="/models/random",
                           system_prompt=None, model_name="random")
    book = SessionBook(host, SessionStore(tmp_path / "sessions"), lambda error: None)
    session = book.new_agent()
    book.add(session)
    view = _View()
    agents = AgentRuns(host, book, view, lambda work, name, group: asyncio.ensure_future(work),
                       workspace=str(tmp_path))

    async def two_tasks():
        for task in ("first", "second"):
            await agents.start(session, task).worker
        run = agents.runs[session.id]
        await agents.close_all()
        return run

    try:
        run = asyncio.run(two_tasks())
    finally:
        engine.shutdown()
    assert run.agent.constrain_tool_calls is constrain and not run.agent.constrains_tool_calls
    assert len(run.agent.steps) >= 2  # both tasks ran
    warnings = [(text, error) for text, error in view.reports if "not constrained" in text]
    if constrain:
        assert len(warnings) == 1 and "tool 'after'" in warnings[0][0] and warnings[0][1] is False
    else:
        assert not warnings  # not asked: nothing to warn about
