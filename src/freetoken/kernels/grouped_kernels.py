"""The grouped expert kernels (Triton): gate/up with the gated unit, down, the route reduce,
and the dequantize kernel of the grouped GEMMs.

Launched by grouped_launch.py; each weight tile is read through grouped_tiles.py, whose format
helpers the kernels call by name (Triton resolves a jit function's globals).
"""

from __future__ import annotations

from freetoken.activations import SWIGLU_CLAMP_LIMIT, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

try:  # Triton is optional: CPU-only installs (and CI) run the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# The model dimensions (HIDDEN = H, INTER = I) and the routes per token K are compile-time
# constants: they are fixed for a model (one compilation per MoE shape), the compiler then knows
# every loop trip count and which masks are all-true, and Triton 3.6's CPU interpreter cannot
# take a runtime scalar as a loop bound with numpy >= 2.4. Strides stay runtime values so the
# banks may be views of a larger pool (any layout of the two outer dimensions).

if triton is not None:
    from freetoken.kernels.grouped_tiles import (
        _fp4_tile,
        _fp4_x,
        _weight_tile,
        _word_sum,
        _word_tile,
        _word_x,
    )

    _OAI_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)  # (a jit function reads only constexpr globals)
    _OAI_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)
    _CLAMP_LIMIT = tl.constexpr(float(SWIGLU_CLAMP_LIMIT))

    @triton.jit
    def _activation(g, ACT: tl.constexpr):
        """act(g) in fp32 with the formulas torch uses (g is fp32)."""
        if ACT == 0:  # silu
            return g / (1.0 + tl.exp(-g))
        elif ACT == 1:  # gelu (erf)
            return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        elif ACT == 2:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            return 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))
        else:  # relu
            return tl.maximum(g, 0.0)

    @triton.jit
    def _glu(gate, up, dt, ACT: tl.constexpr):
        """The gated unit (fp32 in and out). The plain activations round act(gate) to dt
        before the product, as torch does; swiglu_oai (code 4) is computed in fp32 and
        rounded once, where torch rounds op by op (bf16 results may differ by a rounding);
        swiglu_clamp (code 5, DeepSeek-V4) is silu's unit over the clamped gate and up."""
        if ACT == 4:
            g = tl.minimum(gate, _OAI_LIMIT)
            u = tl.minimum(tl.maximum(up, -_OAI_LIMIT), _OAI_LIMIT)
            return (u + 1.0) * (g / (1.0 + tl.exp(-_OAI_ALPHA * g)))
        elif ACT == 5:
            g = tl.minimum(gate, _CLAMP_LIMIT)
            u = tl.minimum(tl.maximum(up, -_CLAMP_LIMIT), _CLAMP_LIMIT)
            return _activation(g, 0).to(dt).to(tl.float32) * u
        else:
            return _activation(gate, ACT).to(dt).to(tl.float32) * up

    # -- where a program reads -----------------------------------------------------------------

    @triton.jit
    def _row_scales(
        s_ptr,
        g_ptr,
        slot,
        rows,
        row_mask,
        stride_ss,
        stride_sn,
        stride_gs,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
    ):
        """(s_rows, g_rows) of `_weight_tile` for bank rows `rows` of a slot."""
        s_rows = s_ptr + slot * stride_ss + (rows // ROW_BLOCK).to(tl.int64) * stride_sn
        g_rows = rows.to(tl.float32)  # (unused but by nvfp4)
        if FORMAT == 3:
            g_rows = tl.load(g_ptr + slot * stride_gs + rows, mask=row_mask, other=0.0)
        return s_rows, g_rows

    @triton.jit
    def _split_columns(
        sp, step, KDIM: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_STEPS: tl.constexpr
    ):
        """(k0, live) of step `step` of split `sp` (SPLIT_STEPS 0: the one split of all KDIM
        columns, every step live). The last split of an uneven division has steps past KDIM:
        they read the last real step's columns again (in bounds: a tile past its row could
        read a scale beyond the bank) against x masked to 0, adding exact zeros (finite
        weights)."""
        k0 = (sp * SPLIT_STEPS + step) * BLOCK_K
        if SPLIT_STEPS > 0:
            live = k0 < KDIM
            k0 = tl.minimum(k0, ((KDIM - 1) // BLOCK_K) * BLOCK_K)
        else:
            live = k0 >= 0
        return k0, live

    # -- a block's sums, in the shape of the format's tiles ------------------------------------
    # (the formats read as words: `_word_tile`'s; fp4: [BLOCK_N, BLOCK_K / 32, 4, 8], x to match;
    # dense, fp8, q8_0 and q6_k: [BLOCK_N, BLOCK_K])

    @triton.jit
    def _zero_sums(FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 zeros in the shape of the format's tiles."""
        if FORMAT >= 5 and FORMAT != 7:  # read as words
            WA: tl.constexpr = 4 if FORMAT >= 9 else 8  # (the tile's words a block, and
            WB: tl.constexpr = 8 if FORMAT >= 9 else 4  # values a word)
            return tl.zeros([BLOCK_N, BLOCK_K // 32, WA, WB], dtype=tl.float32)
        elif FORMAT < 2 or FORMAT >= 4:
            return tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            return tl.zeros([BLOCK_N, BLOCK_K // 32, 4, 8], dtype=tl.float32)

    @triton.jit
    def _row_sums(acc, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Each row's sum [BLOCK_N] of products summed in the shape of the format's tiles."""
        if FORMAT >= 5 and FORMAT != 7:
            return _word_sum(acc, FORMAT, BLOCK_N, BLOCK_K)
        elif FORMAT < 2 or FORMAT >= 4:
            return tl.sum(acc, axis=1)
        else:
            return tl.sum(tl.reshape(acc, [BLOCK_N, BLOCK_K]), axis=1)

    @triton.jit
    def _spread(x, FORMAT: tl.constexpr):
        """x's values of a step (in the shape of one row of the format's tiles) for every row."""
        if FORMAT >= 5 and FORMAT != 7:  # read as words
            return x[None, :, :, :]
        elif FORMAT < 2 or FORMAT >= 4:
            return x[None, :]
        else:
            return x[None, :, :, :]

    @triton.jit
    def _x_block(
        x_row, cols, k0, ok, KDIM: tl.constexpr, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        """x's columns k0.. (0 unless ok) in fp32, as the tiles of fp4 or of [BLOCK_N, BLOCK_K]
        take them."""
        if FORMAT < 2 or FORMAT >= 4:
            k_ok = (k0 + cols) < KDIM
            return tl.load(x_row + k0 + cols, mask=k_ok & ok, other=0.0).to(tl.float32)
        else:
            return _fp4_x(x_row, k0, ok, KDIM, BLOCK_K)

    @triton.jit
    def _tile(
        w_rows,
        s_rows,
        g_rows,
        k0,
        row_mask,
        dt,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The weight tile of fp4 (`_fp4_tile`) or of [BLOCK_N, BLOCK_K] (`_weight_tile`)."""
        if FORMAT < 2 or FORMAT >= 4:
            return _weight_tile(
                w_rows,
                s_rows,
                g_rows,
                k0,
                row_mask,
                dt,
                KDIM,
                FORMAT,
                COL_BLOCK,
                W_ROUND,
                INTERPRETED,
                BLOCK_N,
                BLOCK_K,
            )
        else:
            return _fp4_tile(
                w_rows,
                s_rows,
                g_rows,
                k0,
                row_mask,
                dt,
                KDIM,
                FORMAT,
                W_ROUND,
                INTERPRETED,
                BLOCK_N,
                BLOCK_K,
            )

    @triton.jit
    def _gate_up_sums(
        x_row,
        cols,
        gate_rows,
        up_rows,
        s_gate,
        g_gate,
        s_up,
        g_up,
        row_mask,
        valid,
        dt,
        HIDDEN: tl.constexpr,
        FORMAT: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """(gate, up): a block's W_gu rows @ x[t] in fp32."""
        acc_g = _zero_sums(FORMAT, BLOCK_N, BLOCK_K)
        acc_u = _zero_sums(FORMAT, BLOCK_N, BLOCK_K)
        for k0 in range(0, HIDDEN, BLOCK_K):
            if FORMAT >= 5 and FORMAT != 7:  # read as words
                # (the weights' loads first: x's may cross shared memory behind a barrier)
                wg = _word_tile(
                    gate_rows, s_gate, k0, row_mask, dt, HIDDEN, FORMAT, W_ROUND, BLOCK_N, BLOCK_K
                )
                wu = _word_tile(
                    up_rows, s_up, k0, row_mask, dt, HIDDEN, FORMAT, W_ROUND, BLOCK_N, BLOCK_K
                )
                xv = _word_x(x_row, k0, valid, HIDDEN, FORMAT, BLOCK_K)
            else:
                xv = _x_block(x_row, cols, k0, valid, HIDDEN, FORMAT, BLOCK_K)
                wg = _tile(
                    gate_rows,
                    s_gate,
                    g_gate,
                    k0,
                    row_mask,
                    dt,
                    HIDDEN,
                    FORMAT,
                    COL_BLOCK,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
                wu = _tile(
                    up_rows,
                    s_up,
                    g_up,
                    k0,
                    row_mask,
                    dt,
                    HIDDEN,
                    FORMAT,
                    COL_BLOCK,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
            acc_g += wg * _spread(xv, FORMAT)
            acc_u += wu * _spread(xv, FORMAT)
        gate = _row_sums(acc_g, FORMAT, BLOCK_N, BLOCK_K)
        up = _row_sums(acc_u, FORMAT, BLOCK_N, BLOCK_K)
        return gate, up

    @triton.jit
    def _down_sums(
        a_row,
        cols,
        w_rows,
        s_rows,
        g_rows,
        row_mask,
        valid,
        sp,
        dt,
        INTER: tl.constexpr,
        FORMAT: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_STEPS: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        """A block's W_d rows @ a[r] in fp32 over the STEPS steps of split sp
        (`_split_columns`)."""
        acc = _zero_sums(FORMAT, BLOCK_N, BLOCK_K)
        for step in range(0, STEPS):
            k0, live = _split_columns(sp, step, INTER, BLOCK_K, SPLIT_STEPS)
            if FORMAT >= 5 and FORMAT != 7:  # read as words
                wd = _word_tile(
                    w_rows, s_rows, k0, row_mask, dt, INTER, FORMAT, W_ROUND, BLOCK_N, BLOCK_K
                )
                av = _word_x(a_row, k0, valid & live, INTER, FORMAT, BLOCK_K)
            else:
                av = _x_block(a_row, cols, k0, valid & live, INTER, FORMAT, BLOCK_K)
                wd = _tile(
                    w_rows,
                    s_rows,
                    g_rows,
                    k0,
                    row_mask,
                    dt,
                    INTER,
                    FORMAT,
                    COL_BLOCK,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
            acc += wd * _spread(av, FORMAT)
        return _row_sums(acc, FORMAT, BLOCK_N, BLOCK_K)

    # -- what a block writes ------------------------------------------------------------------

    @triton.jit
    def _gated(
        gate,
        up,
        b_ptr,
        slot,
        rows,
        row_mask,
        stride_bs,
        dt,
        INTER: tl.constexpr,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        """glu(gate (+ b[s, n]), up (+ b[s, INTER + n])), each rounded where torch would."""
        # Round where torch would: h = W @ x is an x.dtype tensor, act(gate) is one, and so is
        # the product (no-ops for fp32).
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        if HAS_BIAS:  # (a skipped route adds 0: it must still compute 0)
            b_row = b_ptr + slot * stride_bs + rows
            gate = gate + tl.load(b_row, mask=row_mask, other=0.0).to(tl.float32)
            up = up + tl.load(b_row + INTER, mask=row_mask, other=0.0).to(tl.float32)
            gate, up = gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32)
        return _glu(gate, up, dt, ACT)

    @triton.jit
    def _store_down(
        c_ptr,
        route_w_ptr,
        y,
        r,
        sp,
        rows,
        row_ok,
        valid,
        stride_cr,
        stride_cs,
        dt,
        SPLIT_STEPS: tl.constexpr,
    ):
        """Route r's block of c: y weighed by the route and rounded to x.dtype, or (split) y, the
        fp32 partial sum of split sp."""
        if SPLIT_STEPS > 0:  # (c is the fp32 partials then; a skipped route's are 0)
            part = c_ptr + sp.to(tl.int64) * stride_cs + r.to(tl.int64) * stride_cr
            tl.store(part + rows, y, mask=row_ok)
        else:
            y = y.to(dt).to(tl.float32)
            # torch: (y * w).to(x.dtype) with y in x.dtype and w in fp32 or x.dtype; the fp32
            # product of two bf16/fp16 values is exact, so one rounding matches both cases. A
            # skipped route contributes exactly 0 whatever its weight (even inf or nan).
            route_w = tl.load(route_w_ptr + r).to(tl.float32)
            c = tl.where(valid, y * route_w, 0.0)
            tl.store(c_ptr + r.to(tl.int64) * stride_cr + rows, c.to(dt), mask=row_ok)

    # -- the expert kernels --------------------------------------------------------------------

    @triton.jit
    def _gate_up_act_kernel(
        x_ptr,
        slots_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        b_ptr,
        a_ptr,
        stride_xt,
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_bs,
        stride_ar,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        K: tl.constexpr,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """a[r, n] = glu(W_gu[s, n] @ x[t] (+ b[s, n]), W_gu[s, INTER + n] @ x[t] (+ b[s,
        INTER + n])) for one block of n."""
        r = tl.program_id(0)
        nb = tl.program_id(1)
        dt = a_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + r).to(tl.int64)
        valid = slot >= 0
        # A skipped route keeps its pointers in bounds (slot 0) but masks every weight load,
        # so it reads nothing and computes glu(0, 0) = 0 for every supported unit.
        slot = tl.maximum(slot, 0)
        token = r // K
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < INTER
        row_mask = row_ok & valid
        cols = tl.arange(0, BLOCK_K)
        x_row = x_ptr + token.to(tl.int64) * stride_xt
        gate_rows = w_ptr + slot * stride_ws + rows.to(tl.int64) * stride_wn
        up_rows = gate_rows + INTER * stride_wn
        s_gate, g_gate = _row_scales(
            s_ptr, g_ptr, slot, rows, row_mask, stride_ss, stride_sn, stride_gs, FORMAT, ROW_BLOCK
        )
        up_at = rows + INTER
        s_up, g_up = _row_scales(
            s_ptr, g_ptr, slot, up_at, row_mask, stride_ss, stride_sn, stride_gs, FORMAT, ROW_BLOCK
        )
        gate, up = _gate_up_sums(
            x_row,
            cols,
            gate_rows,
            up_rows,
            s_gate,
            g_gate,
            s_up,
            g_up,
            row_mask,
            valid,
            dt,
            HIDDEN,
            FORMAT,
            COL_BLOCK,
            W_ROUND,
            INTERPRETED,
            BLOCK_N,
            BLOCK_K,
        )
        a = _gated(gate, up, b_ptr, slot, rows, row_mask, stride_bs, dt, INTER, ACT, HAS_BIAS)
        tl.store(a_ptr + r.to(tl.int64) * stride_ar + rows, a.to(dt), mask=row_ok)

    @triton.jit
    def _down_kernel(
        a_ptr,
        slots_ptr,
        route_w_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        c_ptr,
        stride_ar,
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_cr,
        stride_cs,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_STEPS: tl.constexpr,
    ):
        """c[r, n] = (route_w[r] * (W_d[s, n] @ a[r])).to(x.dtype) for one block of n; or,
        with SPLIT_STEPS > 0, split sp's fp32 partial sum of W_d[s, n] @ a[r] over its
        SPLIT_STEPS x BLOCK_K columns into c[sp, r, n] (`_sum_routes_kernel` adds the splits
        in order, weighs and rounds)."""
        r = tl.program_id(0)
        nb = tl.program_id(1)
        sp = tl.program_id(2)
        # the steps this program walks: all of INTER, or its split's SPLIT_STEPS (a constant
        # trip count: the interpreter takes no run-time loop bounds)
        STEPS: tl.constexpr = SPLIT_STEPS if SPLIT_STEPS > 0 else (INTER + BLOCK_K - 1) // BLOCK_K
        dt = a_ptr.dtype.element_ty  # (x.dtype: c is fp32 when split)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        valid = slot >= 0
        slot = tl.maximum(slot, 0)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < HIDDEN
        row_mask = row_ok & valid
        cols = tl.arange(0, BLOCK_K)
        a_row = a_ptr + r.to(tl.int64) * stride_ar
        w_rows = w_ptr + slot * stride_ws + rows.to(tl.int64) * stride_wn
        s_rows, g_rows = _row_scales(
            s_ptr, g_ptr, slot, rows, row_mask, stride_ss, stride_sn, stride_gs, FORMAT, ROW_BLOCK
        )
        y = _down_sums(
            a_row,
            cols,
            w_rows,
            s_rows,
            g_rows,
            row_mask,
            valid,
            sp,
            dt,
            INTER,
            FORMAT,
            COL_BLOCK,
            W_ROUND,
            INTERPRETED,
            BLOCK_N,
            BLOCK_K,
            SPLIT_STEPS,
            STEPS,
        )
        _store_down(
            c_ptr, route_w_ptr, y, r, sp, rows, row_ok, valid, stride_cr, stride_cs, dt, SPLIT_STEPS
        )

    @triton.jit
    def _sum_routes_kernel(
        c_ptr,
        slots_ptr,
        route_w_ptr,
        out_ptr,
        stride_cs,
        stride_cr,
        stride_ot,
        HIDDEN: tl.constexpr,
        K: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """out[t] = c[t*K] + c[t*K + 1] + ... in order, rounding to x.dtype after each add
        exactly like the reference's `out[t] += contribution` on an x.dtype tensor. With
        SPLIT > 0, c holds the split down kernel's fp32 partials [SPLIT, routes, H]: a route's
        contribution is then made here as the unsplit down kernel makes it, from the partials
        added in split order."""
        t = tl.program_id(0)
        hb = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        offs = hb * BLOCK + tl.arange(0, BLOCK)
        ok = offs < HIDDEN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        first = t.to(tl.int64) * K
        for j in range(0, K):
            r = first + j
            if SPLIT > 0:
                y = tl.zeros([BLOCK], dtype=tl.float32)
                for sp in range(0, SPLIT):
                    y += tl.load(c_ptr + sp * stride_cs + r * stride_cr + offs, mask=ok, other=0.0)
                y = y.to(dt).to(tl.float32)
                valid = tl.load(slots_ptr + r) >= 0
                route_w = tl.load(route_w_ptr + r).to(tl.float32)
                cv = tl.where(valid, y * route_w, 0.0).to(dt)
            else:
                cv = tl.load(c_ptr + r * stride_cr + offs, mask=ok, other=0.0)
            acc = (acc + cv.to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(dt), mask=ok)

    @triton.jit
    def _dequantize_kernel(
        w_ptr,
        s_ptr,
        g_ptr,
        slots_ptr,
        out_ptr,
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_os,
        stride_on,
        N: tl.constexpr,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[i, n, :] = the dense weights of bank row slots[i], rows n of one block."""
        i = tl.program_id(0)
        nb = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + i).to(tl.int64)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + slot * stride_ws + rows.to(tl.int64) * stride_wn
        s_rows, g_rows = _row_scales(
            s_ptr, g_ptr, slot, rows, row_ok, stride_ss, stride_sn, stride_gs, FORMAT, ROW_BLOCK
        )
        out_rows = out_ptr + i.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_on
        for k0 in range(0, KDIM, BLOCK_K):
            w = _weight_tile(
                w_rows,
                s_rows,
                g_rows,
                k0,
                row_ok,
                dt,
                KDIM,
                FORMAT,
                COL_BLOCK,
                W_ROUND,
                INTERPRETED,
                BLOCK_N,
                BLOCK_K,
            )
            mask = row_ok[:, None] & ((k0 + cols) < KDIM)[None, :]
            tl.store(out_rows + k0 + cols[None, :], w.to(dt), mask=mask)
