"""Live engine counters: throughput sparklines, latency, KV block map, prefix reuse per turn, copies, the KV tiers,
speculative decoding's acceptance, MoE expert load, memory."""
from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Sparkline, Static

from tsterm.chat.session import Session, TurnStats
from tsterm.tui.widgets.chat_log import policy_summary
from tsterm.tui.widgets.expert_heatmap import ExpertHeatmap
from tsterm.tui.widgets.kv_bar import KVBar

HISTORY = 60  # samples kept for the sparklines (15 s at 4 Hz)
TURN_ROWS = 6


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


class Dashboard(VerticalScroll):
    can_focus = False

    def __init__(self, device: str = "", **kwargs):
        super().__init__(**kwargs)
        self.device = device
        self.decode_rates: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        self.prefill_rates: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        self.latest: dict = {}
        self.memory: dict = {}
        self.experts: list[list[int]] = []
        self.recent_turns: deque[TurnStats] = deque(maxlen=50)  # any session's; the latency averages
        self.ranks: list[dict[str, int]] | None = None  # a multi-rank engine's per-rank counters
        self._prev: tuple[float, int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Label("decode tok/s", id="decode-label", classes="dash-title")
        yield Sparkline(list(self.decode_rates), id="decode-spark")
        yield Label("prefill tok/s", id="prefill-label", classes="dash-title")
        yield Sparkline(list(self.prefill_rates), id="prefill-spark")
        yield Static("", id="latency", markup=False)
        yield Label("KV blocks", classes="dash-title")
        yield KVBar(id="kv-bar")
        yield Label("[$secondary]█[/] shared [$warning]█[/] used [$accent]▓[/] cached [$foreground-muted]░[/] free",
                    id="kv-legend")
        yield Static("", id="kv-counts", markup=False)
        yield Label("prefix reuse (this session)", id="reuse-title", classes="dash-title")
        yield Static("no turns yet", id="reuse", markup=False)
        yield Label("copies", classes="dash-title")
        yield Static("", id="copies", markup=False)
        yield Label("KV tiers", id="tiers-title", classes="dash-title")
        yield Static("", id="tiers", markup=False)
        yield Label("speculative decoding", id="spec-title", classes="dash-title")
        yield Static("", id="spec", markup=False)
        yield Label("MoE expert load per layer", id="experts-label", classes="dash-title")
        yield ExpertHeatmap(id="experts")
        yield Label("engine", classes="dash-title")
        yield Static("", id="engine", markup=False)
        yield Label("ranks", id="ranks-title", classes="dash-title")
        yield Static("", id="ranks", markup=False)
        yield Label("sessions", classes="dash-title")
        yield Static("", id="session-counts", markup=False)

    # ---- inputs
    @property
    def last_turn(self) -> TurnStats | None:
        return self.recent_turns[-1] if self.recent_turns else None

    def update_stats(self, stats: dict, memory: dict, now: float, experts: list[list[int]] | None = None,
                     ranks: list[dict[str, int]] | None = None) -> None:
        gen, prefill = stats.get("generated_tokens", 0), stats.get("prefill_tokens", 0)
        if self._prev is not None and now > self._prev[0]:
            dt = now - self._prev[0]
            self.decode_rates.append((gen - self._prev[1]) / dt)
            self.prefill_rates.append((prefill - self._prev[2]) / dt)
        self._prev = (now, gen, prefill)
        self.latest, self.memory, self.ranks = stats, memory, ranks
        if experts is not None:
            self.experts = experts
        if not self.display:
            return  # keep sampling the history while hidden; draw only what is seen
        self._draw(stats, memory)

    def record_turn(self, stats: TurnStats) -> None:
        self.recent_turns.append(stats)
        self._draw_latency()

    def show_turns(self, session: Session) -> None:
        if not self.recent_turns and session.turns:  # restored sessions: their last turn until a new one ends
            self.recent_turns.append(session.turns[-1])
            self._draw_latency()
        agent = session.kind == "agent"  # one turn per model call: an agent task's steps
        self.query_one("#reuse-title", Label).update(
            "prefix reuse per step (this agent)" if agent else "prefix reuse (this session)")
        turns = session.turns[-TURN_ROWS:]
        if not turns:
            self.query_one("#reuse", Static).update("no turns yet")
            return
        first = len(session.turns) - len(turns) + 1
        lines = [f"{'step' if agent else 'turn':>4} {'prompt':>6} {'cached':>6} {'new':>5}  kept"]
        for i, t in enumerate(turns, first):
            tail = f"miss@{t.diverged_at}" if t.miss else str(t.kept_tokens)
            lines.append(f"{i:>4} {t.prompt_tokens:>6} {t.cached_tokens:>6} {t.new_tokens:>5}  {tail}")
        hits = sum(t.cached_tokens for t in session.turns)
        total = sum(t.prompt_tokens for t in session.turns)
        lines.append(f"cached {hits}/{total} prompt tok · {session.num_misses} miss(es)")
        policy = policy_summary(session.turns[-1])
        if policy:  # how the last turn was planned (thinking_history), and why preserve fell back
            lines.append(f"last {policy}")
        self.query_one("#reuse", Static).update("\n".join(lines))

    def show_sessions(self, text: str) -> None:
        """Local and API sessions, and the API server's address (the chat screen writes it)."""
        self.query_one("#session-counts", Static).update(text)

    def redraw(self) -> None:
        if self.latest:
            self._draw(self.latest, self.memory)
        self._draw_latency()

    # ---- drawing
    def _draw(self, s: dict, memory: dict) -> None:
        decode, prefill = self.decode_rates[-1], self.prefill_rates[-1]
        self.query_one("#decode-label", Label).update(
            f"decode  {decode:6.1f} tok/s  (peak {max(self.decode_rates):.0f})")
        self.query_one("#prefill-label", Label).update(
            f"prefill {prefill:6.1f} tok/s  (peak {max(self.prefill_rates):.0f})")
        self.query_one("#decode-spark", Sparkline).data = list(self.decode_rates)
        self.query_one("#prefill-spark", Sparkline).data = list(self.prefill_rates)
        self.query_one("#kv-bar", KVBar).set_counts(s)
        self.query_one("#kv-counts", Static).update(
            f"{s.get('num_blocks', 0)} blocks × {s.get('block_size', 0)} tok\n"
            f"used {s.get('used', 0)}  shared {s.get('shared', 0)}\n"
            f"cached {s.get('cached', 0)}  free {s.get('free', 0)}\n"
            f"evictions {s.get('evictions', 0)}  preemptions {s.get('preemptions', 0)}\n"
            f"pinned {s.get('pinned_blocks', 0)} blocks, {s.get('pins', 0)} pin(s)"  # waiting agent sessions
            + (f"\nwindow {s['window_blocks']} blocks ({s.get('window', 0)} tok): used {s.get('window_used', 0)}  "
               f"cached {s.get('window_cached', 0)}  released {s.get('window_released', 0)}"
               if s.get("window_blocks") else ""))  # the sliding layers' own pool (gpt-oss)
        reused = s.get("kv_reused_bytes")
        if reused is None and s.get("block_size"):
            reused = s.get("prefix_hit_tokens", 0) * s.get("kv_bytes_per_block", 0) // s["block_size"]
        self.query_one("#copies", Static).update(
            f"CoW copied   {human_bytes(s.get('cow_bytes', 0))} ({s.get('cow_copies', 0)} blocks)\n"
            f"by reference {human_bytes(reused)} ({s.get('prefix_hit_tokens', 0)} cached tok)"
            + (f"\nstate kept   {human_bytes(s.get('state_snapshot_bytes', 0))} ({s.get('state_snapshots', 0)} "
               f"snapshots held)\nstate copied {human_bytes(s.get('state_copy_bytes', 0))} (resumed, forked)"
               if s.get("state_slots") else ""))  # a hybrid's recurrent-state snapshots
        if memory.get("kind") == "cuda":
            mem = (f"{human_bytes(memory['allocated'])} alloc / {human_bytes(memory['reserved'])} reserved / "
                   f"{human_bytes(memory['total'])}")
        else:
            mem = f"RSS {human_bytes(memory.get('rss'))}"
        self.query_one(ExpertHeatmap).set_load(self.experts)
        pool = s.get("num_blocks", 0) * s.get("kv_bytes_per_block", 0) + \
            (s.get("window_blocks", 0) + 1) * s.get("window_bytes_per_block", 0)  # (+1: its null block)
        self._draw_ranks()
        self._draw_spec(s)
        self._draw_tiers(s)
        self.query_one("#engine", Static).update(
            f"{self.device}\n{mem}  KV pool {human_bytes(pool)}"
            + (f"  state {human_bytes(s['state_bytes'])}" if s.get("state_bytes") else "") + "\n"
            f"running {s.get('running', 0)}  waiting {s.get('waiting', 0)}  steps {s.get('steps', 0)}")

    def _draw_ranks(self) -> None:
        """Per rank of a multi-rank engine: its share of the routed tokens (its experts) and its resident memory;
        the section is hidden in one process."""
        ranks = self.ranks
        for widget in (self.query_one("#ranks-title"), self.query_one("#ranks")):
            widget.display = bool(ranks)
        if not ranks:
            return
        total = sum(r.get("expert_tokens", 0) for r in ranks)
        lines = []
        for r in ranks:
            share = f"{100 * r.get('expert_tokens', 0) / total:5.1f}%" if total else "    -"
            lines.append(f"rank {r.get('rank', len(lines))}  experts {share}  anon {human_bytes(r.get('anon'))}  "
                         f"file {human_bytes(r.get('file'))}")
        self.query_one("#ranks", Static).update("\n".join(lines))

    def _draw_spec(self, s: dict) -> None:
        """Speculative decoding since the engine started (`Engine.stats()`'s spec_* keys): per draft source its
        drafted and accepted tokens, the acceptance rate (accepted / drafted), the mean accepted length (tokens a
        verify appends: its accepted drafts and the one token of its own, as vLLM reports it) and each draft
        position's acceptance (of the verifies that drafted a token there, the share that accepted it). The section
        is hidden while speculation is off."""
        k = s.get("spec_num_tokens", 0)
        for widget in (self.query_one("#spec-title"), self.query_one("#spec")):
            widget.display = bool(k)
        if not k:
            return
        lines = [f"{s.get('spec_method', '?')}, up to {k} draft tokens a step"]
        sources = s.get("spec_sources") or {}
        if not sources:
            lines.append("no drafts yet")
        for name, c in sources.items():
            drafted, accepted, verifies = c["draft_tokens"], c["accepted_tokens"], c["num_drafts"]
            rate = f"{100 * accepted / drafted:.1f}%" if drafted else "-"
            mean = f"{1 + accepted / verifies:.2f}" if verifies else "-"
            if len(sources) > 1 or name != s.get("spec_method"):
                lines.append(f"source {name}")
            lines.append(f"drafted {drafted}  accepted {accepted}")
            lines.append(f"acceptance {rate}  mean length {mean}")
            per_pos = [f"{100 * a / d:.0f}%" if d else "-"
                       for d, a in zip(c["drafted_per_pos"], c["accepted_per_pos"])]
            lines.append("by position " + " ".join(per_pos[:8]) + (" …" if len(per_pos) > 8 else ""))
        self.query_one("#spec", Static).update("\n".join(lines))

    def _draw_tiers(self, s: dict) -> None:
        """The KV cache's lower tiers (`Engine.stats()`'s kv_host_* / kv_disk_* keys, with `kv_host_bytes` or
        `kv_disk` on): prompt tokens served by each tier (the device pool by reference, the host and disk tiers by a
        copy back), per tier the bytes written and read and its size against its bound (the host tier's spills to
        disk, the store's reads served from its write queue), the time prompts waited for their blocks, what the
        store refused or evicted, and the waiting agent sessions offloaded under pressure. Hidden without a tier."""
        on = "kv_tier_loads" in s
        for widget in (self.query_one("#tiers-title"), self.query_one("#tiers")):
            widget.display = on
        if not on:
            return
        loads = s.get("kv_tier_loads", 0)
        per_load = ms(s.get("kv_tier_load_seconds", 0.0) / loads) if loads else "-"
        device_tok = s.get("prefix_hit_tokens", 0) - s.get("kv_tier_hit_tokens", 0)
        lines = [f"hits    device {device_tok} tok  host {s.get('kv_host_hit_tokens', 0)} tok"
                 f"  disk {s.get('kv_disk_hit_tokens', 0)} tok"]
        if "kv_host_max_bytes" in s:
            lines += [
                f"host    {human_bytes(s['kv_host_bytes'])} / {human_bytes(s['kv_host_max_bytes'])}"
                f" ({s.get('kv_host_blocks', 0)} blocks)",
                f"  in {human_bytes(s.get('kv_host_written_bytes', 0))}  out {human_bytes(s.get('kv_host_read_bytes', 0))}"
                f"  spilled {s.get('kv_host_spilled_blocks', 0)}"]
        if "kv_disk_max_bytes" in s:
            lines += [
                f"disk    {human_bytes(s['kv_disk_bytes'])} / {human_bytes(s['kv_disk_max_bytes'])}"
                f" ({s.get('kv_disk_blocks', 0)} blocks)",
                f"  in {human_bytes(s.get('kv_disk_written_bytes', 0))}  out {human_bytes(s.get('kv_disk_read_bytes', 0))}"
                f"  queued {s.get('kv_disk_queue_hit_blocks', 0)}",
                f"  refused {s.get('kv_disk_refused_blocks', 0)}  evicted {s.get('kv_disk_evicted_blocks', 0)}"]
        lines += [f"loads   {loads}  {per_load} each",
                  f"offloaded {s.get('kv_disk_offloaded_pins', 0)} pin(s)"]
        self.query_one("#tiers", Static).update("\n".join(lines))

    def _draw_latency(self) -> None:
        t = self.last_turn
        ttfts = [turn.ttft for turn in self.recent_turns if turn.ttft is not None]
        itls = [turn.mean_itl for turn in self.recent_turns if turn.mean_itl is not None]
        mean_ttft = sum(ttfts) / len(ttfts) if ttfts else None
        mean_itl = sum(itls) / len(itls) if itls else None
        self.query_one("#latency", Static).update(
            f"TTFT  last {ms(t.ttft if t else None)}  avg {ms(mean_ttft)}\n"
            f"ITL   last {ms(t.mean_itl if t else None)}  avg {ms(mean_itl)}")

    def on_mount(self) -> None:
        self._draw_latency()
        self._draw_ranks()
        self._draw_spec(self.latest)
        self._draw_tiers(self.latest)
