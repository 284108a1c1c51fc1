"""Widgets on their own (no engine): streamed thinking blocks, the KV bar, the reuse table, the expert heatmap,
prompt history."""
from __future__ import annotations

import re

from textual.widgets import Collapsible, Markdown

from tests.tui.helpers import Harness, wait_until
from tsterm.chat.session import Session, TurnStats
from tsterm.tui.widgets.chat_log import ChatLog, ReplyView
from tsterm.tui.widgets.dashboard import Dashboard
from tsterm.tui.widgets.expert_heatmap import ExpertHeatmap
from tsterm.tui.widgets.kv_bar import KVBar
from tsterm.tui.widgets.prompt_input import PromptHistory, PromptInput


async def test_reply_streams_a_thinking_block_into_a_collapsible():
    reply = ReplyView()
    app = Harness(ChatLog(reply))
    async with app.run_test(size=(80, 24)) as pilot:
        box = reply.query_one(Collapsible)
        assert not box.display
        text = ""
        for delta in ["<th", "ink>\nLet me ", "think</th", "ink>\n\nThe ", "answer is **42**."]:
            text += delta
            await reply.show(text)
            await pilot.pause()
            if delta == "ink>\nLet me ":
                assert box.display and not box.collapsed  # open while the model thinks
        await reply.finish("prompt 3 · cached 0")
        await pilot.pause()
        assert box.collapsed and box.title == "thinking"
        assert reply.query_one("#thinking-md", Markdown).source == "Let me think"
        assert reply.query_one("#answer-md", Markdown).source == "The answer is **42**."
        assert "-live" not in reply.classes


async def test_reply_keeps_the_thinking_block_open_when_the_profile_says_expanded():
    reply = ReplyView(collapse_thinking=False)  # ui.thinking: expanded
    app = Harness(ChatLog(reply))
    async with app.run_test(size=(80, 24)) as pilot:
        await reply.show("<think>\nhmm</think>\n\nyes")
        await reply.finish("")
        await pilot.pause()
        box = reply.query_one(Collapsible)
        assert box.display and not box.collapsed and box.title == "thinking"


async def test_reply_rerenders_when_the_split_moves():
    reply = ReplyView()
    app = Harness(ChatLog(reply))
    async with app.run_test(size=(80, 24)) as pilot:
        await reply.show("reasoning without an opening tag")
        await reply.show("reasoning without an opening tag</think>answer")  # Qwen3-style: the prompt opened it
        await reply.finish("")
        await pilot.pause()
        assert reply.query_one("#answer-md", Markdown).source == "answer"
        assert reply.query_one("#thinking-md", Markdown).source == "reasoning without an opening tag"


async def test_kv_bar_and_reuse_table():
    bar, dashboard = KVBar(), Dashboard("cpu float32")
    app = Harness(bar, dashboard)
    async with app.run_test(size=(60, 40)) as pilot:
        bar.set_counts({"used": 12, "shared": 2, "cached": 20, "free": 68})
        await pilot.pause()
        cells = str(bar.render())
        assert len(cells) == 60 and cells.count("░") == 41 and cells.count("▓") == 12 and cells.count("█") == 7
        bar.set_counts({"used": 1, "shared": 1, "cached": 0, "free": 9999})
        cells = str(bar.render())
        assert len(cells) == 60 and cells.count("█") == 1  # one shared block in a big pool is still drawn
        session = Session(id="s", turns=[TurnStats(20, 0, 0, 5), TurnStats(40, 24, 25, 5, miss=True, diverged_at=22)])
        dashboard.show_turns(session)
        dashboard.update_stats({"generated_tokens": 0, "prefill_tokens": 0, "num_blocks": 100}, {"kind": "cpu"}, 1.0)
        dashboard.update_stats({"generated_tokens": 50, "prefill_tokens": 10, "num_blocks": 100, "shared": 2},
                               {"kind": "cpu", "rss": 1 << 20}, 1.5)
        await pilot.pause()
        assert dashboard.decode_rates[-1] == 100.0 and dashboard.prefill_rates[-1] == 20.0
        reuse = str(dashboard.query_one("#reuse").render())
        assert "miss@22" in reuse and "cached 24/60" in reuse
        assert dashboard.last_turn is session.turns[-1]


async def test_prompt_history_walks_and_persists(tmp_path):
    path = tmp_path / "history.json"
    prompt = PromptInput(PromptHistory(path))
    async with Harness(prompt).run_test() as pilot:
        prompt.remember("one")
        prompt.remember("two")
        prompt.value = "draft"
        await pilot.press("up")
        assert prompt.value == "two"
        await pilot.press("up", "up")
        assert prompt.value == "one"
        await pilot.press("down", "down")
        assert prompt.value == "draft"
    assert PromptHistory(path).entries == ["one", "two"]
    path.write_text("{broken")
    assert PromptHistory(path).entries == []  # a broken history file costs only the history


async def test_a_reply_removed_mid_stream_is_harmless():
    reply = ReplyView()
    log = ChatLog(reply)
    app = Harness(log)
    async with app.run_test(size=(80, 24)) as pilot:
        text = ""
        for i in range(30):
            text += f"word {i} " + ("\n\n" if i % 5 == 4 else "")
            await reply.show(text)
        await log.remove_children()  # e.g. the user switched sessions while it streamed
        await reply.show(text + "more")
        await reply.finish("done")
        await pilot.pause()  # until idle: an appender left running would have failed by now
        assert not reply.is_attached
    assert app.return_code in (None, 0)


async def test_expert_heatmap_shades_each_layer_against_its_busiest_expert():
    heatmap = ExpertHeatmap()
    async with Harness(heatmap).run_test(size=(40, 10)) as pilot:
        heatmap.set_load([[10, 0, 5, 5], [3, 3, 3, 3]])
        await pilot.pause()
        lines = str(heatmap.render()).splitlines()
        cell = 3  # few experts: up to 3 columns each
        assert lines[0] == "   0  1  2  3"  # expert numbers over their columns
        assert lines[1] == "L0 " + "█" * cell + "·" * cell + "▒" * cell + "▒" * cell
        assert lines[2] == "L1 " + "█" * 4 * cell  # balanced: every expert as busy as the busiest
        assert lines[3] == "tokens: ·none ░▒▓█ most in the row"
        assert lines[4] == "max/mean 1.50, worst 2.00"  # layer 0: 10 / mean 5; layer 1: 1.0
        assert heatmap.region.height == 5

        deep = [[(layer + expert) % 7 for expert in range(128)] for layer in range(48)]
        heatmap.set_load(deep)  # Qwen3-30B-A3B's shape: 48 layers x 128 experts in 38 columns
        await pilot.pause()
        lines = str(heatmap.render()).splitlines()
        assert len(lines) == 19 and lines[1].startswith("L0-2 ") and lines[16].startswith("L45-47 ")
        assert lines[0].split()[:3] == ["0", "8", "16"]  # 34 columns: each one's first expert, where it fits
        assert all(len(line) <= heatmap.size.width for line in lines) and lines[-1].endswith(" per col")
        heatmap.set_load([])
        assert str(heatmap.render()) == "no MoE layers"


async def test_a_tool_block_counts_while_its_call_runs_and_shows_its_result_inside():
    from tsterm.tui.widgets.agent_log import CallState, ToolCallView

    view = ToolCallView(CallState("c1", "grep", {"pattern": "x" * 80}, "parsed"))
    app = Harness(ChatLog(view))
    async with app.run_test(size=(80, 24)) as pilot:
        assert view.collapsed and view.title.plain.startswith("· grep {") and "…" in view.title.plain
        view.show(CallState("c1", "grep", {"pattern": "x"}, "running"))
        running = '… grep {"pattern": "x"} · running'
        assert view.title.plain == running
        title = await wait_until(pilot, lambda: view.title.plain != running and view.title.plain, what="a tick")
        seconds = re.fullmatch(re.escape(running) + r" · (\d+\.\d) s", title)  # ticked once a second
        assert seconds and float(seconds[1]) >= 1.0, title
        view.show(CallState("c1", "grep", {"pattern": "x"}, "error", None, "grep: bad pattern", 0.004))
        await pilot.pause()
        assert view.title.plain == '✗ grep {"pattern": "x"} · error · 4 ms' and view._clock is None
        assert "error: grep: bad pattern" in str(view.body.render())
