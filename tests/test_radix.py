"""The radix prefix cache: a property test against a simple model, and exact reuse in the
engine."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.kv.paged import PageAllocator
from freetoken.kv.radix import RadixCache

PAGE = 2
POOL = 40


class Model:
    """What the tree must behave like: a request takes the longest cached page-prefix, locks
    it, adds its own pages, and donates its full pages at the end."""

    def __init__(self):
        self.tree = RadixCache(PAGE)
        self.alloc = PageAllocator(POOL)
        self.running: dict[int, tuple[list, list[int], list[int]]] = {}

    def start(self, rid: int, tokens: list[int]) -> None:
        path = self.tree.match(tokens)
        matched = len(path) * PAGE
        assert tokens[:matched] == [t for n in path for t in n.key]  # a true prefix
        self.tree.lock(path)
        need = -(-len(tokens) // PAGE) - len(path)
        short = need - self.alloc.num_free
        if short > 0:
            self.alloc.free(self.tree.evict(short))
        if need > self.alloc.num_free:
            self.tree.unlock(path)
            return  # the pool is full of locked pages: the request waits
        pages = [n.page for n in path] + self.alloc.alloc(need)
        self.running[rid] = (path, pages, tokens)

    def finish(self, rid: int) -> None:
        path, pages, tokens = self.running.pop(rid)
        full = len(tokens) // PAGE
        spare = self.tree.insert(tokens[: full * PAGE], pages[:full])
        self.tree.unlock(path)
        self.alloc.free(spare + pages[full:])

    def check(self) -> None:
        tree_pages = self.tree.pages()
        held = [p for path, pages, _ in self.running.values() for p in pages[len(path) :]]
        shared = {n.page for path, _, _ in self.running.values() for n in path}
        free = self.alloc._free
        everything = tree_pages + held + free
        assert sorted(everything) == list(range(POOL)), "a page leaked or is owned twice"
        assert shared <= set(tree_pages), "a locked page was evicted"
        assert self.tree.num_pages == len(tree_pages)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(1, 6)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_radix_tree_against_model(operations):
    m, rid = Model(), 0
    for op, arg in operations:
        if op == "start":
            m.start(rid, arg)
            rid += 1
        elif op == "finish" and m.running:
            m.finish(sorted(m.running)[arg % len(m.running)])
        elif op == "evict":
            m.alloc.free(m.tree.evict(arg))
        m.check()
    for r in list(m.running):
        m.finish(r)
    m.check()
    assert all(n.refs == 0 for n in m.tree._nodes())


def test_longest_prefix_and_lru_eviction():
    tree = RadixCache(2)
    assert tree.insert([1, 2, 3, 4, 5], [10, 11]) == []  # the odd token is no full page
    assert tree.insert([1, 2, 7, 8], [20, 21]) == [20]  # (1, 2) is cached: page 20 is spare
    assert [n.page for n in tree.match([1, 2, 3, 4, 9, 9])] == [10, 11]
    assert [n.page for n in tree.match([1, 2, 7, 8])] == [10, 21]
    path = tree.match([1, 2, 3, 4])
    tree.lock(path)
    assert tree.evict(5) == [21]  # locked 10 and 11 stay; 10 has children anyway
    tree.unlock(path)
    assert tree.evict(5) == [11, 10]


def test_engine_reuses_prefixes_exactly(engine):
    """Turn 2 of a conversation reuses turn 1's KV and decodes the same tokens as a cold run."""
    from freetoken.engine.sampling import SamplingParams

    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    tok = engine.tokenizer
    turn1 = tok.encode(tok.render_chat([{"role": "user", "content": "Tell me a story " * 6}]))
    [first] = engine.generate([turn1], greedy)
    history = [
        {"role": "user", "content": "Tell me a story " * 6},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And then?"},
    ]
    turn2 = tok.encode(tok.render_chat(history))
    req = engine.add_request(turn2, greedy)
    while not req.finished:
        engine.step()
    page = engine.runner.kv.page_size
    assert req.cached_tokens > 0 and req.cached_tokens % page == 0
    # Reused: every token whose KV turn 1 stored (its last output was never fed) up to the
    # first token that differs, rounded down to a page.
    seen = turn1 + first.output_ids
    same = [a == b for a, b in zip(seen, turn2, strict=False)]
    common = same.index(False) if False in same else len(same)
    assert req.cached_tokens == min(common, len(seen) - 1) // page * page

    cache, engine.prefix_cache = engine.prefix_cache, None
    try:
        [cold] = engine.generate([turn2], greedy)
    finally:
        engine.prefix_cache = cache
    assert req.output_ids == cold.output_ids
