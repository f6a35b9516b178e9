"""A layer step's expert-cache decisions as ONE Triton program (moe/device_control.py says what
it decides; its torch ops are the CPU twin and the reference).

The torch form is ~45 small kernels a layer; inside a CUDA graph each still costs a few
microseconds, ~130 us a layer on the H200 machine, which kept a fully cached offload step at
0.38x fused. Here one program of one block does it all, with the data in registers:

1. the R routes' pairs, the first occurrence of each marked by an [R, R] comparison;
2. their slots from `slot_of`: hits (protected) and misses (m of them);
3. the split: q from (f, lo, hi), the misses ranked by the policy's score (another [R, R]
   comparison), the q best filled, each given its rank;
4. only when q > 0: the keep-score of every slot (the policy's `neg_dist[layer] + neg_wait`,
   as `ExpectedNextUsePolicy.slot_scores`) into a scratch row, the hits' slots set to +inf,
   then q rounds of argmin over the row, each victim set to +inf as it is taken;
5. the tables: victims' old pairs out, filled misses in; the fill list; every route's slot
   (-1 for the CPU's), the CPU's routes and their gate weights, written into the doorbell's
   mapped pinned buffers (moe/doorbell.py); whether the CPU has any route (`cpu_flag`, which
   the merge reads), and if it has, the layer's activations written there too and the
   doorbell rung (its shape word, then a new number with a system-scope release);
6. the policy's update (`ExpectedNextUsePolicy.observe_masked`) and the counters.

A prefetch (`AHEAD`, `DeviceControl.plan_ahead`) runs 1-5 on a predicted call with its own
split (up to p misses, ranked by route order, not by the policy), and writes no route's slot,
nothing for the CPU (no route is valid there, so the bell stays silent) and no policy update:
only the tables, the fill list and its counter.

Stores another thread of the block reads later are followed by a barrier. Ties between equal
scores go to the lowest slot (the torch form's top-k may pick another of them: the same
decision up to the order of equals).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs take the torch form.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer as device_clock  # ns, one clock per GPU
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

MAX_ROUTES = 64  # routes per call the one block holds (batch 8 of top-8)
SEQ_WORD, SHAPE_WORD = 0, 64  # the doorbell's words the plan writes (moe/doorbell.py)
SLOT_BLOCK = 1024
X_BLOCK = 2048


def plan_layer(
    control,
    moe_layer: int,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    x=None,
    shape: int = 0,
    stamp=None,
    ahead: bool = False,
):
    """`DeviceControl.plan` (with `ahead`, `plan_ahead`) in one launch: returns (slots [T, k],
    fill_pairs [R], fill_slots [R]) into the control's persistent buffers, the CPU's routes into
    its route buffers; with the control's `bell`, rings it with `shape` when the CPU has
    routes. `stamp`: an int64 the device's clock is written to as the program starts
    (moe/split.py `StepClock`), or None."""
    policy = control.policy
    # (as_tensor: the policy's state is numpy on the CPU tier, where the interpreter runs this)
    neg_dist, neg_wait, p = (
        torch.as_tensor(a)
        for a in (policy.neg_dist[moe_layer], policy.neg_wait, policy.p[moe_layer])
    )
    flat = pairs.reshape(-1)
    R = flat.numel()
    out_slots, fill_pairs, fill_slots = control.outputs(R, ahead)
    copy_x = x is not None and control.cpu_x is not None
    x = x.contiguous() if copy_x else flat
    words, numbers = control.bell if control.bell is not None else (flat, flat)
    _plan_kernel[(1,)](
        x,
        control.cpu_x if copy_x else flat,
        x.numel() if copy_x else 0,
        words,
        numbers,
        shape,
        flat,
        flat if ahead else weights.reshape(-1),
        control.slot_of,
        control.pair_of,
        control.scores,
        control.victims,
        neg_dist,
        neg_wait,
        p,
        control.ahead_arg if ahead else control.split_arg,
        out_slots,
        fill_pairs,
        fill_slots,
        control.cpu_pairs,
        control.cpu_weights,
        control.cpu_flag,
        control.counters[moe_layer],
        R,
        control.num_slots,
        control.num_pairs,
        moe_layer * control.num_experts,
        control.num_experts,
        float(policy.L),
        policy.rate,
        policy.floor,
        BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_E=max(16, triton.next_power_of_2(control.num_experts)),
        BLOCK_S=SLOT_BLOCK,
        COPY_X=copy_x,
        BLOCK_X=X_BLOCK,
        RING=control.bell is not None,
        SEQ_WORD=SEQ_WORD,
        SHAPE_WORD=SHAPE_WORD,
        stamp=flat if stamp is None else stamp,
        STAMP=stamp is not None,
        AHEAD=ahead,
    )
    return out_slots.view(pairs.shape), fill_pairs, fill_slots


if triton is not None:

    @triton.jit
    def _distinct_pairs(pairs, r, valid, slot_of, P):
        """(first, slot, hit, miss) of the routes: the first occurrence of each pair (no earlier
        route with the same pair), its slot, and whether it is a hit or a miss."""
        same = (pairs[:, None] == pairs[None, :]) & (r[None, :] < r[:, None]) & valid[None, :]
        first = valid & (tl.sum(same.to(tl.int32), 1) == 0)
        slot = tl.load(slot_of + tl.where(valid, pairs, P), mask=valid, other=-1)
        hit = first & (slot >= 0)
        miss = first & (slot < 0)
        return first, slot, hit, miss

    @triton.jit
    def _misses_filled(split, neg_dist, neg_wait, pairs, r, valid, miss, P, BY_ORDER: tl.constexpr):
        """(q, filled, rank): the split, q from (f, lo, hi) of the m misses; the q misses of the
        highest pair scores (ties: the lower pair), or with BY_ORDER the q first routes, are
        filled, each given its rank among them."""
        m = tl.sum(miss.to(tl.int32), 0)
        inf = float("inf")
        frac = tl.load(split)
        lo = tl.minimum(tl.load(split + 1).to(tl.int32), m)
        hi = tl.minimum(tl.load(split + 2).to(tl.int32), m)
        q = tl.minimum(tl.maximum(tl.floor(m.to(tl.float32) * frac + 0.5).to(tl.int32), lo), hi)
        if BY_ORDER:
            pair_score = -r.to(tl.float32)
        else:
            at_pair = tl.where(valid, pairs, P)
            pair_score = tl.load(neg_dist + at_pair) + tl.load(neg_wait + at_pair)
        key = tl.where(miss, pair_score, -inf)
        ahead = miss[None, :] & (
            (key[None, :] > key[:, None])
            | ((key[None, :] == key[:, None]) & (pairs[None, :] < pairs[:, None]))
        )
        miss = miss & (tl.sum(ahead.to(tl.int32), 1) < q)
        miss_i = miss.to(tl.int32)
        rank = tl.cumsum(miss_i, 0) - miss_i
        return q, miss, rank

    @triton.jit
    def _choose_victims(
        pair_of,
        scores,
        victims,
        neg_dist,
        neg_wait,
        slot,
        hit,
        q,
        S,
        P,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """Only when q > 0: the keep-score of every slot into `scores`, the hits' slots set to
        +inf, then q rounds of argmin over the row into victims[:q], each victim set to +inf as
        it is taken."""
        inf = float("inf")
        # (`while`, not `for ... in range`: the CPU interpreter cannot range over runtime
        # values, and nothing here gains from pipelining)
        if q > 0:
            start = 0
            while start < S:
                s = start + tl.arange(0, BLOCK_S)
                held = tl.load(pair_of + s, mask=s < S, other=-1)
                held = tl.where(held < 0, P, held)  # empty: the sink, scored -inf
                score = tl.load(neg_dist + held) + tl.load(neg_wait + held)
                tl.store(scores + s, score, mask=s < S)
                start += BLOCK_S
            tl.debug_barrier()
            tl.store(scores + slot, tl.full((BLOCK_R,), inf, tl.float32), mask=hit)
            tl.debug_barrier()
            j = 0
            while j < q:
                # lane-wise running minimum over the blocks (the lower slot wins ties), then
                # the lowest slot of the smallest score
                low = tl.full((BLOCK_S,), inf, tl.float32)
                at = tl.zeros((BLOCK_S,), tl.int32) + S
                start = 0
                while start < S:
                    s = start + tl.arange(0, BLOCK_S)
                    v = tl.load(scores + s, mask=s < S, other=inf)
                    better = v < low
                    low = tl.where(better, v, low)
                    at = tl.where(better, s, at)
                    start += BLOCK_S
                least = tl.min(low, 0)
                best_slot = tl.min(tl.where(low == least, at, 2147483647), 0)
                tl.store(victims + j, best_slot.to(tl.int64))
                tl.store(scores + best_slot, inf)
                tl.debug_barrier()
                j += 1

    @triton.jit
    def _fill_list(victims, rank, miss, pairs, r, valid, fill_slots, fill_pairs, S, P):
        """(dst, src): the fill list, each filled miss's pair to its victim slot (the other
        routes' to the sink), written to fill_slots and fill_pairs."""
        victim = tl.load(victims + rank, mask=miss, other=S)
        dst = tl.where(miss, victim, S)
        src = tl.where(miss, pairs, P)
        tl.store(fill_slots + r, dst, mask=valid)
        tl.store(fill_pairs + r, src, mask=valid)
        return dst, src

    @triton.jit
    def _move_pairs(slot_of, pair_of, dst, src, miss, BLOCK_R: tl.constexpr):
        """The tables: the victims' old pairs out, the filled misses in."""
        evicted = tl.load(pair_of + dst, mask=miss, other=-1)
        tl.store(slot_of + evicted, tl.full((BLOCK_R,), -1, tl.int64), mask=miss & (evicted >= 0))
        tl.debug_barrier()
        tl.store(slot_of + src, dst, mask=miss)
        tl.store(pair_of + dst, src, mask=miss)
        tl.debug_barrier()

    @triton.jit
    def _cpu_routes(
        slot_of, pairs, valid, r, P, out_slots, cpu_pairs, weights_ptr, cpu_weights, cpu_flag
    ):
        """(on_cpu, rings): every route's slot (-1 for the CPU's), the CPU's routes and their
        gate weights, and whether the CPU has any route (`cpu_flag`, which the merge reads)."""
        routed = tl.load(slot_of + tl.where(valid, pairs, P), mask=valid, other=-1)
        tl.store(out_slots + r, routed, mask=valid)
        on_cpu = valid & (routed < 0)
        tl.store(cpu_pairs + r, tl.where(on_cpu, pairs, -1), mask=valid)
        gate = tl.load(weights_ptr + r, mask=valid, other=0.0).to(tl.float32)
        tl.store(cpu_weights + r, gate, mask=valid)
        rings = tl.sum(on_cpu.to(tl.int32), 0) > 0
        tl.store(cpu_flag, rings)
        return on_cpu, rings

    @triton.jit
    def _hand_to_cpu(
        x,
        x_host,
        NX,
        words,
        numbers,
        shape,
        rings,
        COPY_X: tl.constexpr,
        BLOCK_X: tl.constexpr,
        RING: tl.constexpr,
        SEQ_WORD: tl.constexpr,
        SHAPE_WORD: tl.constexpr,
    ):
        """Where the CPU has routes: the layer's activations copied to it (COPY_X) and the
        doorbell rung (RING)."""
        if COPY_X:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if rings:  # the activations, for the CPU's share (stores over PCIe, released below)
                start = 0
                while start < NX:
                    offs = start + tl.arange(0, BLOCK_X)
                    tl.store(x_host + offs, tl.load(x + offs, mask=offs < NX), mask=offs < NX)
                    start += BLOCK_X
        if RING:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if rings:  # the doorbell (moe/doorbell.py): a new number, the shape, then the number
                number = tl.load(numbers) % 2147483646 + 1
                tl.store(numbers, number)
                tl.store(numbers + 1, number)
                tl.store(words + SHAPE_WORD, shape)
                # every thread's stores to the CPU's buffers are issued before the release
                # (cumulative at system scope) that publishes them
                tl.debug_barrier()
                tl.atomic_xchg(words + SEQ_WORD, number.to(tl.int32), sem="release", scope="sys")

    @triton.jit
    def _observe(p_row, neg_wait, pairs, first, base, E, L, rate, floor, BLOCK_E: tl.constexpr):
        """The policy's update (`ExpectedNextUsePolicy.observe_masked`): p = p * (1 - rate) +
        rate where used; its row of -L * (1 - p) / p."""
        e = tl.arange(0, BLOCK_E)
        experts = pairs - base
        used = tl.sum(((experts[None, :] == e[:, None]) & first[None, :]).to(tl.int32), 1) > 0
        p = tl.load(p_row + e, mask=e < E, other=1.0)
        p = p * (1.0 - rate)
        p = tl.where(used, p + rate, p)
        tl.store(p_row + e, p, mask=e < E)
        tl.store(neg_wait + base + e, L - L / tl.maximum(p, floor), mask=e < E)

    @triton.jit
    def _count(counters, first, hit, q, on_cpu, AHEAD: tl.constexpr):
        """The counters: calls, accesses, hits, fills, CPU pairs, CPU routes; a prefetch's
        (AHEAD) only its fills, in column 6."""
        c = tl.arange(0, 8)
        if AHEAD:
            old = tl.load(counters + c, mask=c == 6, other=0)
            tl.store(counters + c, old + q.to(tl.int64), mask=c == 6)
        else:
            accesses = tl.sum(first.to(tl.int64), 0)
            hits = tl.sum(hit.to(tl.int64), 0)
            fills = q.to(tl.int64)
            counts = tl.where(c == 0, 1, tl.where(c == 1, accesses, tl.where(c == 2, hits, 0)))
            counts = tl.where(c == 3, fills, tl.where(c == 4, accesses - hits - fills, counts))
            counts = tl.where(c == 5, tl.sum(on_cpu.to(tl.int64), 0), counts)
            old = tl.load(counters + c, mask=c < 6, other=0)
            tl.store(counters + c, old + counts, mask=c < 6)

    @triton.jit
    def _plan_kernel(
        x,
        x_host,
        NX,
        words,
        numbers,
        shape,
        pairs_ptr,
        weights_ptr,
        slot_of,
        pair_of,
        scores,
        victims,
        neg_dist,
        neg_wait,
        p_row,
        split,
        out_slots,
        fill_pairs,
        fill_slots,
        cpu_pairs,
        cpu_weights,
        cpu_flag,
        counters,
        R,
        S,
        P,
        base,
        E,
        L,
        rate,
        floor,
        BLOCK_R: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
        COPY_X: tl.constexpr,
        BLOCK_X: tl.constexpr,
        RING: tl.constexpr,
        SEQ_WORD: tl.constexpr,
        SHAPE_WORD: tl.constexpr,
        stamp,
        STAMP: tl.constexpr,
        AHEAD: tl.constexpr,
    ):
        if STAMP:
            tl.store(stamp, device_clock())
        r = tl.arange(0, BLOCK_R)
        valid = r < R
        pairs = tl.load(pairs_ptr + r, mask=valid, other=-1)
        first, slot, hit, miss = _distinct_pairs(pairs, r, valid, slot_of, P)
        q, miss, rank = _misses_filled(split, neg_dist, neg_wait, pairs, r, valid, miss, P, AHEAD)
        # (`miss` from here on: the misses filled)
        _choose_victims(
            pair_of, scores, victims, neg_dist, neg_wait, slot, hit, q, S, P, BLOCK_R, BLOCK_S
        )
        dst, src = _fill_list(victims, rank, miss, pairs, r, valid, fill_slots, fill_pairs, S, P)
        _move_pairs(slot_of, pair_of, dst, src, miss, BLOCK_R)
        if AHEAD:  # (a prefetch: no route's slot written, nothing handed to the CPU)
            valid = r < 0
        on_cpu, rings = _cpu_routes(
            slot_of, pairs, valid, r, P, out_slots, cpu_pairs, weights_ptr, cpu_weights, cpu_flag
        )
        _hand_to_cpu(
            x, x_host, NX, words, numbers, shape, rings, COPY_X, BLOCK_X, RING, SEQ_WORD, SHAPE_WORD
        )
        if not AHEAD:
            _observe(p_row, neg_wait, pairs, first, base, E, L, rate, floor, BLOCK_E)
        _count(counters, first, hit, q, on_cpu, AHEAD)
