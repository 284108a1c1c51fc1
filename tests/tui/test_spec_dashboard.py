"""The dashboard's speculative decoding section: a speculating turn in the workstation, then the section shows its
drafted and accepted tokens, acceptance rate, mean accepted length and acceptance by draft position, as the engine
counted them; with speculation off the section is hidden. Waits are on the app's messages (stats polls, turn ends)."""
from __future__ import annotations

from tests.tui.helpers import Harness, chat_screen, engine_stats, say, text_of, turns_done, wait_until
from tsterm.tui import TstermApp
from tsterm.tui.widgets.dashboard import Dashboard

# a user message that repeats itself: the suffix source drafts from the prompt, and from the reply's own loops
REPEATING = " ".join(["the cat sat on the mat and looked at the door"] * 4)


async def test_a_speculating_turn_shows_its_acceptance_on_the_dashboard(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=40, speculative_method="suffix", num_speculative_tokens=4))
    async with app.run_test(size=(200, 60)) as pilot:
        screen = await chat_screen(pilot)
        dashboard = screen.dashboard
        spec = dashboard.query_one("#spec")
        first = await wait_until(pilot, lambda: dashboard.latest and text_of(spec), what="a first stats poll")
        assert first.splitlines() == ["suffix, up to 4 draft tokens a step", "no drafts yet"]
        assert dashboard.query_one("#spec-title").display and spec.display
        # every proposed draft verified whole (the engine runs on a thread of this process): the cost-aware cut would
        # make whether anything is verified depend on the machine's step times
        app.host.async_engine.engine.draft_length = None
        await say(pilot, REPEATING)
        await turns_done(pilot, screen.session, 1)
        stats = await engine_stats(app)  # the turn is over: the counters hold still
        source = stats["spec_sources"]["suffix"]
        drafted, accepted, verifies = source["draft_tokens"], source["accepted_tokens"], source["num_drafts"]
        assert 0 < accepted < drafted  # drafts were accepted and rejected
        text = await wait_until(pilot, lambda: f"drafted {drafted}  accepted {accepted}" in text_of(spec)
                                and text_of(spec), what="a poll after the turn")
        lines = text.splitlines()
        assert lines[0] == "suffix, up to 4 draft tokens a step"
        assert lines[1] == f"drafted {drafted}  accepted {accepted}"
        assert lines[2] == f"acceptance {100 * accepted / drafted:.1f}%  mean length {1 + accepted / verifies:.2f}"
        by_position = lines[3].split()[2:]
        assert len(by_position) == 4 and by_position[0] == f"{100 * source['accepted_per_pos'][0] / verifies:.0f}%"
        # (every verify drafts position 0; a later position counts the verifies that drafted that far)
        assert source["drafted_per_pos"][0] == verifies and source["drafted_per_pos"] == sorted(
            source["drafted_per_pos"], reverse=True)


async def test_the_section_is_hidden_without_speculation_and_names_each_source():
    dashboard = Dashboard("cpu float32")
    async with Harness(dashboard).run_test(size=(60, 80)) as pilot:
        base = {"generated_tokens": 0, "prefill_tokens": 0, "num_blocks": 10}
        dashboard.update_stats(dict(base, spec_method="off", spec_num_tokens=0, spec_sources={}), {"kind": "cpu"}, 1.0)
        await pilot.pause()
        assert not dashboard.query_one("#spec").display and not dashboard.query_one("#spec-title").display
        # two sources (a run whose source was swapped): each named, with its own counts; positions never drafted: "-"
        sources = {"ngram": dict(num_drafts=4, draft_tokens=10, accepted_tokens=5, drafted_per_pos=[4, 4, 2],
                                 accepted_per_pos=[3, 1, 1]),
                   "suffix": dict(num_drafts=2, draft_tokens=2, accepted_tokens=0, drafted_per_pos=[2, 0, 0],
                                  accepted_per_pos=[0, 0, 0])}
        dashboard.update_stats(dict(base, spec_method="ngram", spec_num_tokens=3, spec_sources=sources),
                               {"kind": "cpu"}, 2.0)
        await pilot.pause()
        assert dashboard.query_one("#spec").display
        assert text_of(dashboard.query_one("#spec")).splitlines() == [
            "ngram, up to 3 draft tokens a step",
            "source ngram", "drafted 10  accepted 5", "acceptance 50.0%  mean length 2.25", "by position 75% 25% 50%",
            "source suffix", "drafted 2  accepted 0", "acceptance 0.0%  mean length 1.00", "by position 0% - -"]
