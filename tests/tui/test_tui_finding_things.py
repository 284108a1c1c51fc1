"""What a newcomer looks for (issue 19): sessions can be switched from the keyboard and the palette, forks get
distinct titles, the palette shows its `[N]`/`[PATH]` arguments, the expert map numbers its experts and has a legend,
a fork and a template miss are told in plain words, and quitting a start-up that failed exits non-zero."""
from __future__ import annotations

from textual.content import Content

from tests.tui.helpers import chat_screen, palette, say, turns_done, wait_until
from tsterm.tui import TstermApp
from tsterm.tui.palette import ACTIONS, plain
from tsterm.tui.screens.loading import LoadingScreen
from tsterm.tui.widgets.chat_log import miss_notice
from tsterm.tui.widgets.expert_heatmap import ExpertHeatmap, expert_ticks

SIZE = (160, 45)


def notifications(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def test_switch_sessions_forks_titles_and_the_palette(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        first = screen.session
        await say(pilot, "hello")
        await turns_done(pilot, first, 1)
        await pilot.press("ctrl+b")
        await pilot.press("ctrl+b")  # a fork of the fork... of the same title
        await screen.show_session(first.id)
        await pilot.press("ctrl+b")
        titles = [s.title for s in screen.sessions.values()]
        assert len(set(titles)) == len(titles) == 4, titles
        assert any("the branch starts from the parent's" in n and "nothing is copied" in n
                   for n in notifications(app))
        order = list(screen.sessions)
        at = order.index(screen.current_id)
        await pilot.press("ctrl+pagedown")
        assert screen.current_id == order[(at + 1) % 4]
        await pilot.press("ctrl+pageup", "ctrl+pageup")
        assert screen.current_id == order[(at - 1) % 4]

        await palette(pilot, "switch to")  # the palette lists the other sessions
        await wait_until(pilot, lambda: screen.current_id != order[(at - 1) % 4], what="a switch from the palette")

        await say(pilot, "/help")
        assert "switch sessions" in screen.chat_log.query("MessageView").last().text


def test_palette_help_keeps_its_arguments_and_the_expert_map_numbers_experts():
    for _, _, help_text in ACTIONS:
        assert Content.from_markup(plain(help_text)).plain == help_text  # `[N]` and `[PATH]` shown, not eaten
    assert expert_ticks(8, 8, 3) == "0  1  2  3  4  5  6  7"
    assert expert_ticks(128, 30, 1).startswith("0 8 17 ")  # grouped columns: each one's first expert
    heatmap = ExpertHeatmap()
    heatmap.load = [[5, 0, 1, 9], [1, 1, 1, 1]]
    assert heatmap.get_content_height(None, None, 40) == 5  # numbers, two layers, legend, summary


def test_a_template_miss_is_told_in_plain_words():
    text = miss_notice(180, 116)
    assert "116 tokens the model had already read are computed again" in text and "token 180" in text
    assert "template miss" not in text and "prefix" not in text


async def test_quitting_a_failed_start_exits_non_zero_with_the_error(tmp_path, data_dir):
    profile = tmp_path / "bad.yaml"
    profile.write_text(f"model: {tmp_path / 'missing'}\ndevice: cpu\n")
    app = TstermApp(str(profile))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, LoadingScreen) and app.screen.has_class("-failed"),
                         what="the load error")
        await pilot.press("ctrl+q")
    assert app.return_code == 1
