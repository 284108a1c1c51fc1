"""Sequence-level block tables on top of a BlockPool: prefix matching, slot allocation, copy-on-write, fork."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tsterm.engine.block_pool import BlockPool, NoFreeBlocksError
from tsterm.engine.kv_store import block_name
from tsterm.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from tsterm.engine.kv_tier import DiskTier, TierRead


class WindowBlocks:
    """The sliding-window layers' blocks (a model with both sliding and full attention layers, gpt-oss): a second
    `BlockPool` of their own ids, whose KV the executor keeps in a pool of its own (`ModelCache`'s window pool), and
    each sequence's `Sequence.window_table`, entry i for the positions of `block_table[i]`.

    A sliding layer's query at position p reads keys [p - window + 1, p] only. Once a sequence's next position to
    compute is n, the entries wholly before n's window (`first_needed(n)`) are never read again: `KVCacheManager`
    releases them after each step's tokens are committed, writing `NULL` in their place. A released block that was
    registered keeps its chain hash while it stays unevicted (a cached block, as in the main pool), so a later prompt
    whose prefix ends there can take it. The same chain hashes name a block in both pools.

    `NULL` (id 0) is reserved for life, never handed out: the kernels never read a table entry before a row's
    window (the C kernels substitute the window's first entry, the torch twin gathers from the window's first
    position, the Triton kernel masks what a tile holds before it), and were one read, it would be a real block."""

    NULL = 0

    def __init__(self, pool: BlockPool, window: int):
        assert window >= 1 and pool.num_blocks >= 2, (window, pool.num_blocks)
        self.pool, self.window, self.block_size = pool, window, pool.block_size
        null = pool.allocate()  # held for life: never free, never cached, never evicted
        assert null == self.NULL, null
        self.released_blocks = 0  # table entries released (their block back to the pool, its hash kept)
        self.hit_blocks = 0  # window blocks prompts took by reference (`match_prefix`)
        self.cow_copies = 0

    def first_needed(self, position: int) -> int:
        """The first table entry that the window of a query at `position` reads."""
        return max(0, position - self.window + 1) // self.block_size

    def cut(self, run: list[tuple[int, int]], tokens: list[int], root: int | None) -> tuple[int, list[int]]:
        """For a main-pool run of cached full blocks (id, chain hash) prefixing `tokens`: the largest k <= len(run)
        such that this pool still holds the blocks covering the window of position k*B ([first_needed(kB), k)), and
        the window table for it (NULL before that window, the found blocks after; not acquired)."""
        B, pool = self.block_size, self.pool
        found: list[int | None] = []
        missing, best = -1, 0
        for i, (_, block_hash) in enumerate(run):
            parent = run[i - 1][1] if i else root
            block_id = pool.lookup(block_hash, tokens[i * B:(i + 1) * B], parent)
            found.append(block_id)
            if block_id is None:
                missing = i
            if missing < self.first_needed((i + 1) * B):
                best = i + 1
        first = self.first_needed(best * B)
        return best, [self.NULL] * first + found[first:best]

    def stats(self) -> dict[str, int]:
        """The window pool's counters (`window_*`); its reserved NULL block counted in none."""
        s = self.pool.stats()
        return {"window": self.window, "window_blocks": s["num_blocks"] - 1, "window_free": s["free"],
                "window_used": s["used"] - 1, "window_cached": s["cached"], "window_shared": s["shared"],
                "window_evictions": s["evictions"], "window_released": self.released_blocks,
                "window_hit_blocks": self.hit_blocks, "window_cow_copies": self.cow_copies,
                "window_pinned_blocks": s["pinned_blocks"]}

    def check(self, seqs: list[Sequence]) -> None:
        """O(blocks) consistency of the live sequences' window tables with the pool's ref counts (tests)."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for seq in seqs:
            assert len(seq.window_table) == len(seq.block_table), seq
            first = seq.window_released
            assert all(b == self.NULL for b in seq.window_table[:first]), seq
            assert self.NULL not in seq.window_table[first:], seq
            assert first <= self.first_needed(seq.num_computed_tokens) or not seq.block_table, seq
            for block_id in seq.window_table[first:]:
                refs[block_id] = refs.get(block_id, 0) + 1
        null = self.pool.blocks[self.NULL]
        assert null.ref_cnt == 1 and null.block_hash is None and null.pin_cnt == 0, null
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0), (block, refs.get(block.block_id, 0))


class KVCacheManager:
    """Owns every `Sequence.block_table`. Block i of a table holds the KV of positions `[i*B, (i+1)*B)`.

    Per sequence it keeps the chain hashes of its committed full blocks, so `commit` only hashes the blocks
    filled since the last call (one hash per B decoded tokens).

    A sequence with a `cache_salt` (set by `Request.create`; None: none) chains its blocks from its salt's
    root (`BlockPool.salt_root`) instead of the model's: its full and partial blocks match only prompts with the
    same salt, and an unsalted sequence's hashes are those it always had.

    A model with recurrent layers (the hybrids' linear attention) also keeps one state per sequence, in a slot of its
    state pool (ids from `pool.allocate_state_slot`): a sequence takes its slot with its first blocks and gives it
    back when it is freed (finished, aborted or preempted), so `Sequence.state_slot` is set exactly while it holds
    blocks. With prefix caching, a sequence also holds a snapshot slot, where the model keeps its state at the last
    block boundary it computed (`snapshot_at`); when it is freed, that snapshot stays with the block it ends at, and
    a later prompt with that prefix resumes there (`match_prefix`) from a copy of it (`state_restore`): the pool
    holds the snapshot's slot for that copy until the step that runs it has run (`state_copied`) or the sequence is
    freed. A fork's child starts from a copy of its parent's state made at once (`fork` returns it), not at its
    first step: the parent may advance before the child is scheduled.
    At the last multiple of `snapshot_interval` (whole blocks; 0: never) inside each prompt chunk but the last, a
    sequence also leaves a snapshot behind, when a free slot can replace it (`keep_interval_snapshot`), so that
    prompts sharing only the start of a prefix with it (one system prompt, different tasks) resume from there. The
    chunks are not cut for it: the layer splits a chunk where a snapshot is taken.

    With a lower tier (`tier`: the disk store, `tsterm.engine.kv_tier`), every block registered for the prefix cache
    is written through to it, and so is a finished sequence's kept partial block; `match_prefix` goes on past the
    pool's run with the blocks the tier holds, read back into fresh blocks (registered, so the next prompt takes them
    by reference) instead of computed. A hybrid's snapshots go to the tier when they are kept with their block
    (`free`, `keep_interval_snapshot`), and its prompt resumes at the furthest block boundary whose blocks and state
    the pool or the tier holds (`_match_hybrid_from_tier`).

    With a window pool (`window`: `WindowBlocks`), every operation is mirrored on each sequence's `window_table`:
    a prefix hit is the largest block boundary whose full blocks the main pool holds and whose window the window
    pool still holds (its blocks taken by reference, NULL before them); a finished sequence's partial block is kept in
    both pools and taken only from both; slots, copy-on-write, commits, forks, trims, frees and pins act on both
    pools, and `can_append` counts both. After each commit the entries wholly before the window of the next position
    go back to the window pool (`_release_window`). Not with a tier or recurrent state (the executor keeps the
    window pool off there).
    """

    def __init__(self, pool: BlockPool, snapshot_interval: int = 0, tier: DiskTier | None = None,
                 window: WindowBlocks | None = None):
        assert window is None or (tier is None and not pool.num_state_slots), "a window pool without tier or state"
        self.pool = pool
        self.window = window
        self.tier = tier
        self.tier_hit_tokens = 0  # prompt tokens of admitted requests served from the tier (in prefix_hit)
        self.tier_hit_tokens_by = {"host": 0, "disk": 0}  # the same by the tier that served them
        self._tier_tokens: dict[int, dict[str, int]] = {}  # seq_id -> its last match_prefix's tier tokens, by tier
        self._pinned_tokens: dict[str, tuple[list[int], str | None]] = {}  # pin key -> its tokens, salt (a tier's)
        self.offloaded_pins = 0  # pins released to the tier under pressure (`offload_pins`)
        self.offloaded_pin_blocks = 0  # their blocks the store had lost and that were written again
        self.block_size = pool.block_size
        self.num_state_slots = pool.num_state_slots
        self.snapshot_interval = snapshot_interval // pool.block_size * pool.block_size
        self.interval_snapshots = 0  # snapshots left behind by live sequences at interval boundaries
        self._chain: dict[int, list[int]] = {}  # seq_id -> chain hash of each committed full block
        self._draft_slots: dict[int, list[int]] = {}  # seq_id -> state slots of its drafts in the step in flight
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.cow_copies = 0

    def match_prefix(self, seq: Sequence) -> int:
        """Take the longest cached run of full blocks that prefixes `seq.token_ids` (by reference) and mark it
        computed; then, after it, the cached partial block (a finished sequence's last) that holds the most of the
        prompt's next tokens, which the sequence takes over and appends to in place. The last token is never taken:
        its logits must be computed. Returns the number of cached tokens."""
        assert not seq.block_table, f"match_prefix on {seq}: it already holds blocks"
        if self.num_state_slots and self.tier is not None and self.pool.enable_prefix_caching:
            return self._match_hybrid_from_tier(seq)
        B, tokens, root = self.block_size, seq.token_ids, self._root(seq)
        chain: list[int] = []
        run = self._cached_run(tokens, (len(tokens) - 1) // B, root)
        window = self.window
        window_table: list[int] = []
        if window is not None:  # cut where the window pool still holds the blocks of the next position's window
            cut, window_table = window.cut(run, tokens, root)
            del run[cut:]
        if self.num_state_slots:  # a hybrid resumes only where a state snapshot was kept: the run is cut there
            while run and self.pool.blocks[run[-1][0]].snapshot is None:
                run.pop()
            if run:  # held until the copy has run: no allocation evicts it, no step writes it before
                seq.state_restore = self.pool.use_snapshot(run[-1][0])
        for block_id, block_hash in run:
            self.pool.acquire(block_id)
            seq.block_table.append(block_id)
            chain.append(block_hash)
        self._chain[seq.seq_id] = chain
        loads: list[tuple[list[int], torch.Tensor]] = []  # (pool block, its data read from the tier)
        if self.tier is not None and self.pool.enable_prefix_caching:
            self._extend_from_tier(seq, chain, (len(tokens) - 1) // B, root, loads)
        num_cached = len(chain) * B
        if self.pool.enable_prefix_caching and not self.num_state_slots:  # (a hybrid's state is kept per block)
            partial = self.pool.lookup_partial(chain[-1] if chain else root, tokens[num_cached:len(tokens) - 1])
            window_partial = None
            if partial is not None and window is not None:  # (taken only when the window pool kept its twin)
                window_partial = window.pool.lookup_partial(chain[-1] if chain else root,
                                                            tokens[num_cached:len(tokens) - 1])
                partial = None if window_partial is None else (partial[0], min(partial[1], window_partial[1]))
            if partial is not None:
                self.pool.take_partial(partial[0])
                seq.block_table.append(partial[0])
                num_cached += partial[1]
                if window_partial is not None:
                    window.pool.take_partial(window_partial[0])
                    window_table.append(window_partial[0])
            elif self.tier is not None:
                num_cached += self._partial_from_tier(seq, chain[-1] if chain else root,
                                                      tokens[num_cached:len(tokens) - 1], loads)
        # one batched copy into the pool of the blocks this prompt read from the tiers (and its partial)
        self._tier_tokens[seq.seq_id] = self.tier.copy_in(loads) if loads else {}
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        if window is not None:  # the window blocks of the hit's next position, by reference (a partial: taken)
            first = window.first_needed(num_cached)
            for i in range(first, len(chain)):
                window.pool.acquire(window_table[i])
            window_table[:first] = [window.NULL] * first
            window.hit_blocks += len(window_table) - first
            seq.window_table, seq.window_released = window_table, first
        return num_cached

    def _extend_from_tier(self, seq: Sequence, chain: list[int], max_blocks: int, root: int | None,
                          loads: list[tuple[list[int], torch.Tensor]]) -> None:
        """After the pool's run: the prompt's next full blocks, each from the pool or else the tier, as far as the
        tier holds them, they check out (`DiskTier.fetch`) and fresh blocks are free for them. Appends to the table
        and `chain`; the tier's blocks are registered, their data queued in `loads`."""
        B, pool, tier, tokens = self.block_size, self.pool, self.tier, seq.token_ids
        plan: list[tuple[int | None, int, int | None, list[int], TierRead | None]] = []
        parent = chain[-1] if chain else root
        for i in range(len(chain), max_blocks):
            block_tokens = tokens[i * B:(i + 1) * B]
            block_hash = pool.hash_block(parent, block_tokens)
            block_id = pool.lookup(block_hash, block_tokens, parent)
            read = None if block_id is not None else tier.full_read(block_hash, parent, block_tokens)
            if block_id is None and read is None:
                break
            plan.append((block_id, block_hash, parent, block_tokens, read))
            parent = block_hash
        if not plan:
            return
        for block_id, *_ in plan:  # held first: no allocation below evicts them
            if block_id is not None:
                pool.acquire(block_id)
        room, reads, keep = pool.num_free, [], len(plan)
        for index, (_, _, _, _, read) in enumerate(plan):
            if read is not None:
                if len(reads) == room:
                    keep = index
                    break
                reads.append(read)
        data = tier.fetch(reads)
        if len(data) < len(reads):  # the first missing or refused block ends the run
            keep = [index for index, item in enumerate(plan) if item[4] is not None][len(data)]
        for block_id, *_ in plan[keep:]:
            if block_id is not None:
                pool.release(block_id)
        loaded = self._append_blocks(seq, chain, [item[:4] for item in plan[:keep]])
        if loaded:
            loads.append((loaded, data))

    def _append_blocks(self, seq: Sequence, chain: list[int],
                       entries: list[tuple[int | None, int, int | None, list[int]]]) -> list[int]:
        """Append a prefix's blocks to `seq`'s table and their hashes to `chain`: each (pool block, or None for one
        read from the tier; its hash, parent hash and token ids). A tier block gets a fresh pool block, registered;
        those are returned in order, for the copy of their data. The pool's blocks are already held."""
        pool, loaded = self.pool, []
        for block_id, block_hash, parent, block_tokens in entries:
            if block_id is None:
                table = seq.block_table
                block_id = pool.allocate(prefer=table[-1] + 1 if table else None)
                pool.register(block_id, parent, block_tokens)
                loaded.append(block_id)
            seq.block_table.append(block_id)
            chain.append(block_hash)
        return loaded

    def _match_hybrid_from_tier(self, seq: Sequence) -> int:
        """`match_prefix` of a hybrid model with a tier: the prompt's full blocks as far as the pool or the tier holds
        them, cut at the furthest block after which a state snapshot is held (in the pool, or else on disk when a
        free state slot can take it); the tier's blocks and snapshot are read into fresh blocks and that slot, the
        snapshot attached to its block and held for the sequence's copy (`state_restore`). A candidate whose reads
        fail (missing, refused) or whose blocks do not fit gives way to the next nearer one."""
        B, pool, tier, tokens, root = self.block_size, self.pool, self.tier, seq.token_ids, self._root(seq)
        entries: list[tuple[int | None, int, int | None, list[int]]] = []  # (pool block or None, hash, parent, ids)
        parent = root
        for i in range((len(tokens) - 1) // B):
            block_tokens = tokens[i * B:(i + 1) * B]
            block_hash = pool.hash_block(parent, block_tokens)
            block_id = pool.lookup(block_hash, block_tokens, parent)
            if block_id is None and not tier.contains(block_name(block_hash)):
                break
            entries.append((block_id, block_hash, parent, block_tokens))
            parent = block_hash
        cut, snapshot, data = 0, None, None
        for end in range(len(entries), 0, -1):
            block_id, block_hash = entries[end - 1][:2]
            if block_id is not None and pool.blocks[block_id].snapshot is not None:
                snapshot = None
            elif tier.has_snapshot(block_hash) and pool.num_free_state_slots:
                snapshot = "disk"
            else:
                continue
            wanted = [e for e in entries[:end] if e[0] is None]
            # (the pool's blocks of the run are held before any allocation: those evictable now do not count)
            held = sum(1 for e in entries[:end] if e[0] is not None and pool.blocks[e[0]].ref_cnt == 0
                       and pool.blocks[e[0]].pin_cnt == 0)
            if len(wanted) > pool.num_free - held:
                continue
            reads = [tier.full_read(h, p, ids) for _, h, p, ids in wanted]
            if any(read is None for read in reads):
                continue
            data = tier.fetch(reads) if reads else None
            if data is not None and len(data) < len(reads):
                continue
            if snapshot == "disk":
                snapshot = tier.fetch_snapshot(block_hash)
                if snapshot is None:
                    continue
            cut = end
            break
        chain: list[int] = []
        for block_id, *_ in entries[:cut]:
            if block_id is not None:
                pool.acquire(block_id)
        loaded = self._append_blocks(seq, chain, entries[:cut])
        self._tier_tokens[seq.seq_id] = tier.copy_in([(loaded, data)]) if loaded else {}
        if cut:
            last = seq.block_table[-1]
            if snapshot is not None:  # read from disk into a free slot, kept with its block like any snapshot
                slot = pool.take_free_state_slot()
                tier.load_snapshot(slot, snapshot)
                pool.attach_snapshot(last, slot)
            seq.state_restore = pool.use_snapshot(last)  # held until the copy has run
        self._chain[seq.seq_id] = chain
        seq.num_computed_tokens = seq.num_cached_tokens = cut * B
        return cut * B

    def _partial_from_tier(self, seq: Sequence, parent: int | None, token_ids: list[int],
                           loads: list[tuple[list[int], torch.Tensor]]) -> int:
        """The tier's partial block after `parent` holding the most of `token_ids` first tokens, read into a fresh
        block that `seq` takes over (as `take_partial`); returns the tokens it holds (0: none)."""
        found = self.tier.partial_read(parent, token_ids) if token_ids else None
        if found is None or not self.pool.num_free:
            return 0
        data = self.tier.fetch([found[0]])
        if not len(data):
            return 0
        table = seq.block_table
        block_id = self.pool.allocate(prefer=table[-1] + 1 if table else None)
        table.append(block_id)
        loads.append(([block_id], data))
        return found[1]

    # ---- pins: a session waiting on its tools (or its user) keeps its prefix out of eviction

    def pin(self, key: str, token_ids: list[int], expires_at: float,
            cache_salt: str | None = None) -> tuple[int, int]:
        """Pin the cached full blocks of the longest cached prefix of `token_ids` (cached under `cache_salt`) under
        `key` until `expires_at` (`BlockPool.pin`: a pin under an existing key replaces it; the cap may stop it
        early). Returns (blocks pinned, cached full blocks found). With a tier, the pin's tokens are kept too: the
        partly filled block after its full ones is what `offload_pins` saves with them."""
        cached = self.cached_prefix_blocks(list(token_ids), cache_salt)
        num_pinned = self.pool.pin(key, cached, expires_at)
        if self.window is not None:  # and the window pool's blocks of the window where the pinned run ends
            self._pin_window(key, list(token_ids), num_pinned, cache_salt, expires_at)
        self._pinned_tokens.pop(key, None)
        if num_pinned and self.tier is not None:
            self._pinned_tokens[key] = (list(token_ids), cache_salt)
        return num_pinned, len(cached)

    def _pin_window(self, key: str, token_ids: list[int], num_blocks: int, cache_salt: str | None,
                    expires_at: float) -> None:
        """Pin under `key` in the window pool the blocks it holds of the window at the end of the first `num_blocks`
        full blocks of `token_ids` (what `match_prefix` needs there), the run after the last one it lacks."""
        window, B = self.window, self.block_size
        root = None if cache_salt is None else self.pool.salt_root(cache_salt)
        run = self._cached_run(token_ids, num_blocks, root)
        blocks: list[int] = []
        for i in range(window.first_needed(len(run) * B), len(run)):
            block_id = window.pool.lookup(run[i][1], token_ids[i * B:(i + 1) * B], run[i - 1][1] if i else root)
            blocks = [] if block_id is None else blocks + [block_id]
        window.pool.unpin(key)
        if blocks:
            window.pool.pin(key, blocks, expires_at)

    def unpin(self, key: str) -> bool:
        self._pinned_tokens.pop(key, None)
        if self.window is not None:
            self.window.pool.unpin(key)
        return self.pool.unpin(key)

    def expire_pins(self, now: float) -> int:
        if self.tier is not None:  # (the start of a schedule: the tier's copies deferred after the last step run)
            self.tier.before_schedule()
        if self.window is not None:
            self.window.pool.expire_pins(now)
        expired = self.pool.expire_pins(now)
        if expired and self._pinned_tokens:
            live = self.pool.pins()
            for key in [key for key in self._pinned_tokens if key not in live]:
                del self._pinned_tokens[key]
        return expired

    def pins(self) -> list[str]:
        return list(self.pool.pins())

    def drop_pins(self) -> int:
        """Release every pin (they yield to traffic that cannot run otherwise); returns how many. With a tier, each
        pinned session is offloaded first (`offload_pins`): its next turn reads its prefix back instead of computing
        it."""
        keys = self.pins()
        if self.tier is not None:
            self.offload_pins(keys)
        for key in keys:
            self.unpin(key)
        return len(keys)

    def yield_pins_to_tier(self) -> int:
        """Under pressure (a request cannot get blocks): with a tier, release every pin after offloading it, so a
        session waiting on a tool makes room instead of costing a running request its blocks (a preemption) or a
        waiting one its admission. Returns the pins released; 0 without a tier (pins then yield only when nothing
        could run otherwise: the scheduler's `drop_pins`) or without pins."""
        if self.tier is None or not self.pool.pins():
            return 0
        return self.drop_pins()

    def offload_pins(self, keys: list[str]) -> int:
        """Make sure the disk tier holds each pinned session of `keys`: its pinned full blocks and, when the pool
        still caches it, the partly filled block after them (the finished turn's last). Write-through queued most
        of them when they were registered; those the store evicted since (its LRU bound, other sessions' traffic)
        are queued again, the others made the most recently used, so what the session needs next is the last the
        store evicts. Returns the blocks queued again."""
        assert self.tier is not None
        B, pool, tier, written = self.block_size, self.pool, self.tier, 0
        saved_before = tier.saved_blocks
        live = pool.pins()
        for key in keys:
            pin = live.get(key)
            if pin is None:
                continue
            parent = None
            for block_id in pin.block_ids:  # a prefix chain, first block first
                block = pool.blocks[block_id]
                tier.save_block(block_id, block.block_hash, block.parent_hash, block.token_ids)
                parent = block.block_hash
            pinned = self._pinned_tokens.get(key)
            if pinned is not None:
                token_ids, salt = pinned
                root = None if salt is None else pool.salt_root(salt)
                rest = token_ids[len(pin.block_ids) * B:]
                partial = pool.lookup_partial(root if parent is None else parent, rest) if rest else None
                if partial is not None:
                    tier.save_partial(partial[0], root if parent is None else parent, rest[:partial[1]])
            self.offloaded_pins += 1
        written = tier.saved_blocks - saved_before
        self.offloaded_pin_blocks += written
        return written

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        """The cached or referenced blocks holding the longest run of full blocks that prefixes `token_ids`, first
        block first (what `match_prefix` would take for a longer prompt with `cache_salt`). Acquires nothing."""
        root = None if cache_salt is None else self.pool.salt_root(cache_salt)
        return [block_id for block_id, _ in self._cached_run(token_ids, len(token_ids) // self.block_size, root)]

    def _root(self, seq: Sequence) -> int | None:
        """The parent hash of `seq`'s first block: None (the model's root) or its cache salt's root."""
        salt = seq.cache_salt
        return None if salt is None else self.pool.salt_root(salt)

    def _cached_run(self, token_ids: list[int], max_blocks: int, root: int | None) -> list[tuple[int, int]]:
        """(block id, chain hash) of the leading full blocks of `token_ids` found in the cache, at most max_blocks,
        chained from `root` (`_root`)."""
        B, pool = self.block_size, self.pool
        run: list[tuple[int, int]] = []
        if pool.enable_prefix_caching:
            parent = root
            for i in range(max_blocks):
                block_tokens = token_ids[i * B:(i + 1) * B]
                block_hash = pool.hash_block(parent, block_tokens)
                block_id = pool.lookup(block_hash, block_tokens, parent)
                if block_id is None:
                    break
                run.append((block_id, block_hash))
                parent = block_hash
        return run

    def record_prefix_query(self, seq: Sequence) -> None:
        """Count one admission's prefix lookup (the scheduler calls it once per admitted request, not per retry)."""
        self.prefix_query_tokens += len(seq.token_ids)
        self.prefix_hit_tokens += seq.num_cached_tokens
        for tier, tokens in self._tier_tokens.pop(seq.seq_id, {}).items():
            self.tier_hit_tokens += tokens
            self.tier_hit_tokens_by[tier] += tokens

    def _plan(self, seq: Sequence, num_new_tokens: int) -> tuple[int, list[int]]:
        """(new blocks to allocate, table indices to copy-on-write) for writing the next num_new_tokens."""
        B, table = self.block_size, seq.block_table
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        num_blocks = -(-end // B)
        # Blocks of the table that this write touches and that another table also holds (after a fork).
        # Normally only the partial last block; full blocks below num_computed_tokens are never written.
        cow = [i for i in range(start // B, min(len(table), num_blocks)) if self.pool.blocks[table[i]].ref_cnt > 1]
        return max(0, num_blocks - len(table)), cow

    def _window_cow(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Window-table indices the next num_new_tokens write that another table also holds (a fork's partial block)."""
        B, table, pool = self.block_size, seq.window_table, self.window.pool
        start = seq.num_computed_tokens
        end = -(-(start + num_new_tokens) // B)
        assert start // B >= seq.window_released, f"{seq}: a write into a released window entry"
        return [i for i in range(start // B, min(len(table), end)) if pool.blocks[table[i]].ref_cnt > 1]

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_new, cow = self._plan(seq, num_new_tokens)
        if self.window is not None and not self.window.pool.can_allocate(
                num_new + len(self._window_cow(seq, num_new_tokens))):
            return False
        return self.pool.can_allocate(num_new + len(cow))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the KV of tokens `[num_computed_tokens, num_computed_tokens + num_new_tokens)`.

        Returns the (src_block, dst_block) pairs whose computed KV the runner must copy before writing
        (copy-on-write of a shared partial block). All or nothing: raises NoFreeBlocksError unchanged."""
        pool, table = self.pool, seq.block_table
        num_new, cow = self._plan(seq, num_new_tokens)
        if not pool.can_allocate(num_new + len(cow)):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {num_new + len(cow)} KV blocks, "
                                    f"{pool.num_free} free or evictable")
        if self.window is not None:  # (checked before either pool changes: all or nothing)
            window_cow = self._window_cow(seq, num_new_tokens)
            if not self.window.pool.can_allocate(num_new + len(window_cow)):
                raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {num_new + len(window_cow)} window KV blocks, "
                                        f"{self.window.pool.num_free} free or evictable")
            self._allocate_window(seq, num_new, window_cow)
        if self.num_state_slots and seq.state_slot < 0:  # (the pool has slots for every sequence that may run)
            seq.state_slot = pool.allocate_state_slot()
            if pool.enable_prefix_caching:
                seq.snapshot_slot = pool.allocate_state_slot()
        copies = []
        for i in cow:
            src, dst = table[i], pool.allocate()
            table[i] = dst
            pool.release(src)  # still referenced by the other branch: ref_cnt was > 1
            if i * self.block_size < seq.num_computed_tokens:  # a block with no computed slot needs no copy
                copies.append((src, dst))
        self.cow_copies += len(copies)
        # Each new block asks for the id after the previous one: the context stays one run of blocks whenever the
        # ids allow it, across turns too, and attention reads a run as one view of the pool. Sorted, for blocks
        # that came from eviction (cached blocks come out tail-first).
        new: list[int] = []
        for _ in range(num_new):
            last = new[-1] if new else table[-1] if table else None
            new.append(pool.allocate(prefer=None if last is None else last + 1))
        table.extend(sorted(new))
        return copies

    def _allocate_window(self, seq: Sequence, num_new: int, cow: list[int]) -> None:
        """`allocate_slots` on the window table: its shared blocks copied on write (the pairs queued on the sequence
        for its step's runner, `Sequence.window_copies`) and `num_new` new blocks, consecutive where the ids allow."""
        window, table = self.window, seq.window_table
        for i in cow:
            src, dst = table[i], window.pool.allocate()
            table[i] = dst
            window.pool.release(src)  # still referenced by the other branch
            if i * self.block_size < seq.num_computed_tokens:
                seq.window_copies.append((src, dst))
                window.cow_copies += 1
        new: list[int] = []
        for _ in range(num_new):
            last = new[-1] if new else table[-1] if table else None
            new.append(window.pool.allocate(prefer=None if last is None or last == window.NULL else last + 1))
        table.extend(sorted(new))

    def _release_window(self, seq: Sequence) -> None:
        """Give the window pool back the entries of `seq`'s window table wholly before the window of its next
        position (its computed tokens: chunks and accepted drafts included; a rejected draft never counts), oldest
        first, so the LRU evicts the oldest first. A registered block stays cached under its hash."""
        window = self.window
        first = min(window.first_needed(seq.num_computed_tokens), len(seq.window_table))
        table = seq.window_table
        for i in range(seq.window_released, first):
            window.pool.release(table[i])
            table[i] = window.NULL
        if first > seq.window_released:
            window.released_blocks += first - seq.window_released
            seq.window_released = first

    def snapshot_at(self, seq: Sequence, num_new_tokens: int) -> int:
        """Where the model snapshots `seq`'s state while computing its next `num_new_tokens`: the last block boundary
        they reach, or, in a chunk that more of the prompt follows, the last interval boundary in it (where the
        layer splits the chunk; `keep_interval_snapshot` then leaves it with its block). 0: none. Recorded on the
        sequence, for `free`."""
        if seq.snapshot_slot < 0:
            return 0
        start, B, interval = seq.num_computed_tokens, self.block_size, self.snapshot_interval
        end = start + num_new_tokens
        boundary = end // B * B
        if interval and end < len(seq.token_ids) and end // interval * interval > start:
            boundary = end // interval * interval  # (a later chunk takes the block boundaries after it)
        if boundary <= start:
            return 0
        seq.snapshot_position = boundary
        return boundary

    def keep_interval_snapshot(self, seq: Sequence) -> None:
        """After a step: if `seq`'s snapshot was just kept at an interval boundary of its prompt, leave it with its
        block (for any prompt with that prefix) and take a free slot for the next one. Nothing when none is free."""
        position = seq.snapshot_position
        if (not self.snapshot_interval or seq.snapshot_slot < 0 or not position or position % self.snapshot_interval
                or position > min(seq.num_computed_tokens, seq.num_prompt_tokens)):  # (a prompt's, not a reply's)
            return
        block_id = seq.block_table[position // self.block_size - 1]
        if not self.pool.can_attach_snapshot(block_id):
            return
        slot = self.pool.take_free_state_slot()
        if slot is None:
            return
        if self.pool.attach_snapshot(block_id, seq.snapshot_slot) and self.tier is not None:
            self.tier.save_snapshot(seq.snapshot_slot, self.pool.blocks[block_id].block_hash)
        seq.snapshot_slot, seq.snapshot_position = slot, 0
        self.interval_snapshots += 1

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat KV slot of each position in [start, end): block_table[p // B] * B + p % B."""
        B, table = self.block_size, seq.block_table
        return [table[p // B] * B + p % B for p in range(start, end)]

    def commit(self, seq: Sequence) -> None:
        """Register the blocks filled (computed) since the last commit, generated tokens included. With a window
        pool: their window blocks too, under the same hashes, then the window entries no later position reads go back
        to it (`_release_window`); the step that wrote them has run (its window copies with it)."""
        window = self.window
        if window is not None:
            seq.window_copies = []
        if not self.pool.enable_prefix_caching:
            if window is not None:
                self._release_window(seq)
            return
        B, chain = self.block_size, self._chain.setdefault(seq.seq_id, [])
        if self.tier is not None:
            self.tier.step_done()
        for i in range(len(chain), seq.num_computed_tokens // B):
            parent = chain[-1] if chain else self._root(seq)
            block_id, block_tokens = seq.block_table[i], seq.token_ids[i * B:(i + 1) * B]
            chain.append(self.pool.register(block_id, parent, block_tokens))
            if window is not None and i >= seq.window_released:
                window.pool.register(seq.window_table[i], parent, block_tokens)
            if self.tier is not None and self.pool.blocks[block_id].block_hash == chain[-1]:  # write-through
                self.tier.save_block(block_id, chain[-1], parent, block_tokens)
        if window is not None:
            self._release_window(seq)

    def trim(self, seq: Sequence) -> int:
        """Release the blocks of `seq`'s table past what its computed tokens and its next one need: after a verify
        step, those that held only rejected drafts' KV (the sequence is shortened, nothing copied). Such blocks were
        allocated for the drafts and never registered (`commit` registers only computed tokens' blocks), so they
        go back free. Returns how many were released."""
        keep = -(-(seq.num_computed_tokens + 1) // self.block_size)
        extra = seq.block_table[keep:]
        for block_id in reversed(extra):
            assert self.pool.blocks[block_id].block_hash is None, f"trim of registered block {block_id} of {seq}"
            self.pool.release(block_id)
        del seq.block_table[keep:]
        if self.window is not None:
            for block_id in reversed(seq.window_table[keep:]):
                self.window.pool.release(block_id)
            del seq.window_table[keep:]
        return len(extra)

    def take_draft_state_slots(self, seq: Sequence, num_drafts: int) -> list[int]:
        """A hybrid's verify step: a state slot for each of `seq`'s next drafts, up to `num_drafts` (fewer only when
        the pool has none left: `num_state_slots` counts one per draft of every running sequence), where the model
        keeps the state after that draft (the state after its last token stays in its own slot). Held until
        `accept_draft_states` (or `free`). [] for a model without recurrent state."""
        if not self.num_state_slots or not num_drafts:
            return []
        assert seq.seq_id not in self._draft_slots and seq.state_slot >= 0, f"draft state slots of {seq}"
        slots = []
        try:
            while len(slots) < num_drafts:
                slots.append(self.pool.allocate_state_slot())
        except NoFreeBlocksError:
            pass
        if slots:
            self._draft_slots[seq.seq_id] = slots
        return slots

    def draft_state_slots(self, seq: Sequence) -> list[int]:
        """The slots `take_draft_state_slots` gave `seq` for the step in flight ([]: none)."""
        return self._draft_slots.get(seq.seq_id, [])

    def accept_draft_states(self, seq: Sequence, num_accepted: int) -> list[tuple[int, int]]:
        """After a hybrid's verify step, once `seq`'s computed tokens include the `num_accepted` drafts it kept: its
        state becomes the one after the last of them, by taking the slot that holds it (the state after its last
        token, or after draft j in draft slot j), and the other slots of the step go back to the pool (those of the
        rejected drafts: nothing of them is left). A block boundary the accepted run reached keeps the state there
        as the sequence's snapshot the same way (its slot taken, the old snapshot's given back), except at the
        accepted run's very end, whose state is the live one: returned as the one (state slot, snapshot slot) pair
        the runner must copy now. Never a state of an unverified position."""
        drafts = self._draft_slots.pop(seq.seq_id, None)
        if drafts is None:
            return []
        chain = [seq.state_slot] + drafts  # chain[j]: the state after the last token and j drafts
        end = seq.num_computed_tokens  # the tokens whose states exist now: ... the last token, the kept drafts
        first = end - num_accepted  # the tokens computed when chain[0] was written
        copies = []
        boundary = end // self.block_size * self.block_size
        if seq.snapshot_slot >= 0 and boundary >= first:
            j = boundary - first
            if j < num_accepted:
                seq.snapshot_slot, chain[j] = chain[j], seq.snapshot_slot
            else:
                copies.append((chain[j], seq.snapshot_slot))
            seq.snapshot_position = boundary
        seq.state_slot = chain[num_accepted]
        for j, slot in enumerate(chain):
            if j != num_accepted:
                self.pool.release_state_slot(slot)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Give `child` (already holding parent's token ids) every block of `parent` by reference. A hybrid's child
        takes slots of its own; returns the (parent's state slot, child's state slot) pair the runner must copy now,
        before any later step: the parent's next step changes its state whether the child is scheduled with it or
        not (the one copy a fork of a recurrent state needs; [] for a model without one)."""
        assert not child.block_table and len(child.token_ids) >= parent.num_computed_tokens
        copies = []
        if self.num_state_slots:
            assert parent.state_slot >= 0 and parent.state_restore < 0, f"fork of {parent}: its state is not its own"
            child.state_slot = self.pool.allocate_state_slot()
            if self.pool.enable_prefix_caching:
                child.snapshot_slot = self.pool.allocate_state_slot()
            copies.append((parent.state_slot, child.state_slot))
        for block_id in parent.block_table:
            self.pool.acquire(block_id)
        child.block_table = list(parent.block_table)
        if self.window is not None:
            for block_id in parent.window_table[parent.window_released:]:
                self.window.pool.acquire(block_id)
            child.window_table, child.window_released = list(parent.window_table), parent.window_released
        child.num_computed_tokens = parent.num_computed_tokens
        self._chain[child.seq_id] = list(self._chain.get(parent.seq_id, ()))
        return copies

    def state_copied(self, seq: Sequence) -> None:
        """After a step that computed `seq`: the copy its state started from (`state_restore`), which that step ran
        before its forward, is done; the source slot is no longer held for it."""
        if seq.state_restore >= 0:
            self.pool.release_state_slot(seq.state_restore)
            seq.state_restore = -1

    def free(self, seq: Sequence, keep_partial: bool = True) -> None:
        """Release every block of `seq` and reset it to nothing computed (e.g. for re-admission). Its partly filled
        last block, if it holds computed tokens, stays cached as a partial block (`match_prefix`), unless not
        `keep_partial` (a sequence whose step failed: that block may be a copy-on-write that never ran)."""
        if seq.snapshot_slot >= 0:  # kept with the block the snapshot ends at (if that block is hashed)
            position = seq.snapshot_position
            if position and position <= seq.num_computed_tokens:
                block_id, slot = seq.block_table[position // self.block_size - 1], seq.snapshot_slot
                if self.pool.attach_snapshot(block_id, slot) and self.tier is not None:  # (with its block, on disk)
                    self.tier.save_snapshot(slot, self.pool.blocks[block_id].block_hash)
            else:
                self.pool.release_state_slot(seq.snapshot_slot)
            seq.snapshot_slot, seq.snapshot_position = -1, 0
        if seq.state_restore >= 0:  # admitted, then freed before its first step: nothing to restore any more
            self.pool.release_state_slot(seq.state_restore)
            seq.state_restore = -1
        for slot in self._draft_slots.pop(seq.seq_id, ()):  # a verify step's, never accepted (finished inside it)
            self.pool.release_state_slot(slot)
        B, computed, chain = self.block_size, seq.num_computed_tokens, self._chain.get(seq.seq_id, [])
        if (keep_partial and computed % B and not self.num_state_slots and len(seq.block_table) > computed // B
                and len(chain) == computed // B):
            # the partly filled last block: cached for a prompt that goes on from its tokens (the next turn's)
            block_id, parent = seq.block_table[computed // B], chain[-1] if chain else self._root(seq)
            partial_tokens = seq.token_ids[computed // B * B:computed]
            if self.pool.keep_partial(block_id, parent, partial_tokens) and self.tier is not None:
                self.tier.save_partial(block_id, parent, partial_tokens)  # (the next turn's, after a restart too)
            if self.window is not None:  # its twin, which `match_prefix` needs to take either
                self.window.pool.keep_partial(seq.window_table[computed // B], parent, partial_tokens)
        for block_id in reversed(seq.block_table):  # tail blocks become least recent: evicted first
            self.pool.release(block_id)
        seq.block_table = []
        if self.window is not None:
            for block_id in reversed(seq.window_table[seq.window_released:]):
                self.window.pool.release(block_id)
            seq.window_table, seq.window_released, seq.window_copies = [], 0, []
        seq.num_computed_tokens = 0
        self._chain.pop(seq.seq_id, None)
        self._tier_tokens.pop(seq.seq_id, None)
        if seq.state_slot >= 0:  # its state is stale from here on: the next holder starts from position 0
            self.pool.release_state_slot(seq.state_slot)
            seq.state_slot = -1

    def stats(self) -> dict[str, int]:
        """The pool's counters and the prefix cache's; `kv_tier_hit_tokens` are the part of `prefix_hit_tokens`
        read from the lower tier (copies, not references), with the tier's own counters (`kv_disk_*`)."""
        tier = self.tier.stats() if self.tier is not None else {}
        out = {**self.pool.stats(), "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens, "kv_tier_hit_tokens": self.tier_hit_tokens,
                "cow_copies": self.cow_copies, "state_slots": self.num_state_slots,
                "state_interval_snapshots": self.interval_snapshots, **tier}
        if self.window is not None:
            out.update(self.window.stats())
        if self.tier is not None:
            out["kv_host_hit_tokens"] = self.tier_hit_tokens_by["host"]
            out["kv_disk_hit_tokens"] = self.tier_hit_tokens_by["disk"]
            out["kv_disk_offloaded_pins"] = self.offloaded_pins
            out["kv_disk_offloaded_pin_blocks"] = self.offloaded_pin_blocks
        return out
