"""The workstation with its engine core in a process of its own (the default outside the tests): a chat turn, the
dashboard's counters and the core's memory come from the core process, the reply is the one the in-process engine
gives, the core's output goes to its log file, and the core ends with the app."""
from __future__ import annotations

import os

from tests.tui.helpers import chat_screen, say, turns_done, wait_until
from tsterm.engine.core_process import EngineCoreProcess
from tsterm.tui.app import TstermApp

SIZE = (120, 40)


async def reply_ids(app: TstermApp, text: str) -> tuple[list[int], EngineCoreProcess | None]:
    """Say `text` in a new app and return the session's token ids (and the engine core's client, when it has
    one)."""
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await say(pilot, text)
        await turns_done(pilot, screen.session, 1)
        client = app.host.async_engine
        core = client if isinstance(client, EngineCoreProcess) else None
        if core is not None:
            assert app.host.engine is None and core.pid != os.getpid()
            # (a poll answered while the turn was still generating shows fewer: wait for one after its last token)
            await wait_until(pilot, lambda: (screen.dashboard.latest.get("generated_tokens") or 0) >= 12,
                             what="a dashboard poll answered by the core, after the turn's 12 tokens")
            memory = screen.dashboard.memory
            assert memory["kind"] == "cpu" and memory["rss"] > 0  # the core process's own RSS
        return list(screen.session.token_ids), core


async def test_a_turn_in_the_core_process_equals_the_in_process_one(make_profile, data_dir, tmp_path):
    app = TstermApp(make_profile(max_tokens=12, name="process", engine_process="true"),
                    sessions_dir=tmp_path / "process")
    ids_there, core = await reply_ids(app, "hello there")
    assert core is not None and core._process.returncode == 0  # the core ended with the app (shut down, waited for)
    assert (data_dir / "engine.log").exists()  # where the core's output went (not over the screen)

    inline = TstermApp(make_profile(max_tokens=12, name="inline", engine_process="false"),
                       sessions_dir=tmp_path / "inline")
    ids_here, none = await reply_ids(inline, "hello there")
    assert none is None and ids_here == ids_there and len(ids_there) > 12
