"""The engine line (status bar, dashboard) says why `dtype: auto` chose the dtype, compactly; a configured dtype's line
stays "cpu float32"; the profile-switched notification carries the whole reason."""
from __future__ import annotations

from tests.tui.helpers import chat_screen, say, text_of, wait_until
from tsterm.cpu import CpuFeatures, cpu_auto_dtype
from tsterm.tui import TstermApp

SIZE = (160, 40)
# a CPU with AVX512-BF16 and no AMX (AMD Zen 4): auto stays float32, for a reason of its own
ZEN4 = CpuFeatures("x86_64", "AMD Ryzen 9 7950X", frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                             "avx512vl", "avx512_bf16"}))


def notifications(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def test_the_engine_line_shows_why_auto_chose_the_dtype(tmp_path, tiny_checkpoint, data_dir, monkeypatch):
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: ZEN4))
    common = [f"model: {tiny_checkpoint}", "device: cpu", "block_size: 4", "num_kv_blocks: 64"]
    auto, fixed = tmp_path / "auto.yaml", tmp_path / "fixed.yaml"
    auto.write_text("\n".join([*common, "dtype: auto"]) + "\n")
    fixed.write_text("\n".join([*common, "dtype: float32"]) + "\n")
    reason = cpu_auto_dtype(ZEN4).reason  # "auto: AVX512-BF16 without AMX, bfloat16 prefill below float32's (...)"
    line = "cpu float32 (auto: AVX512-BF16 without AMX)"

    app = TstermApp(str(fixed))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert app.host.device == "cpu float32"  # a configured dtype: as before
        status = await wait_until(pilot, lambda: text_of(screen.query_one("#status")) or None, what="the status")
        assert "· cpu float32" in status and "(auto" not in status
        await say(pilot, f"/profile {auto}")
        await wait_until(pilot, lambda: app.host.profile_name == "auto" and app.screen is not screen,
                         what="the switched profile")
        screen = await chat_screen(pilot)
        assert app.host.device == line
        await wait_until(pilot, lambda: line in text_of(screen.query_one("#status")), what="the status bar's line")
        if not screen.dashboard.display:  # (dashboard: auto shows it from 150 columns)
            await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: text_of(screen.dashboard.query_one("#engine")).startswith(line),
                         what="the dashboard's engine line")
        switched = await wait_until(pilot, lambda: next((n for n in notifications(app) if "profile switched" in n),
                                                        None), what="the switch's notification")
        assert f"on cpu float32 ({reason})" in switched
