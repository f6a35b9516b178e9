"""Gated DeltaNet linear attention (Qwen3-Next) and Kimi Delta Attention (Kimi-Linear), in
pure torch.

Instead of keys and values of every past token, a linear-attention layer keeps per sequence
a fixed-size recurrent state: a matrix S [value heads, key dim, value dim] that each token
decays by exp(g) and corrects towards its value (the delta rule, step size beta), plus the
last `kernel - 1` inputs of a short depthwise causal conv over q, k and v. Both live in the
recurrent state pool (`kv/recurrent.py`), one slot per sequence.

Gated DeltaNet decays a head's whole state by one g a token; KDA (`LinearAttentionConfig.kda`)
decays each key channel's row of it by its own g [dk] (S <- diag(exp(g)) S). The rules below
take either: a per-head g [B, H, T] is a per-channel one of a single channel [B, H, T, 1].

Prefill runs the chunked form of the delta rule (chunks of 64, as the transformers torch
fallback: a few matmuls per chunk instead of a step per token); decode runs one recurrent
step, on the GPU as one kernel launch (kernels/gated_delta.py: the decay, step size, norms and
rule of a step, the state advanced in place in the pool). Both read and write the sequence's
slot, so a prompt split across forwards (chunked prefill) carries its state over the chunk
boundaries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.activations import activation
from freetoken.kernels import gated_delta
from freetoken.kv.batch import ForwardBatch, StateGroup
from freetoken.kv.recurrent import RecurrentStatePool
from freetoken.layers.linear import Linear, outputs, stacked
from freetoken.layers.norm import GatedRMSNorm
from freetoken.model_config import ModelConfig

CHUNK_SIZE = 64


class _Conv1d(nn.Conv1d):
    def reset_parameters(self) -> None:  # (as Linear's: nothing to draw on the meta device)
        if not self.weight.is_meta:
            super().reset_parameters()


def causal_conv1d(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, act: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [B, T, C] continuing from `state` [B, C, kernel - 1] (the
    inputs before x; zeros at a sequence's start). Returns (act(conv) [B, T, C], new state)."""
    keep = weight.shape[-1] - 1
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, keep + T]
    y = act(F.conv1d(full, weight[:, None, :], groups=weight.shape[0]))  # [B, C, T]
    return y.transpose(1, 2), full[:, :, full.shape[-1] - keep :]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[B, T, heads, d] inputs -> fp32 [B, Hv, T, d] with q/k expanded to the value heads,
    L2-normalized, and q scaled by 1/sqrt(d_k) (as the reference kernels do)."""
    groups = v.shape[2] // q.shape[2]
    if groups > 1:  # each q/k head serves `groups` consecutive value heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _per_channel(g: torch.Tensor) -> torch.Tensor:
    """g [B, H, T] (a decay per head) or [B, H, T, dk] (per key channel) -> [B, H, T, 1 or dk]."""
    return g[..., None] if g.dim() == 3 else g


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """One step per token (prepared inputs, state [B, Hv, dk, dv] fp32): the decode path.
    Returns (out [B, Hv, T, dv], final state)."""
    out = torch.empty_like(v)
    g = _per_channel(g)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None]  # (each key channel's row of S)
        k_t = k[:, :, t]
        predicted = (state * k_t[..., None]).sum(-2)  # what S already returns for k_t
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        out[:, :, t] = (state * q[:, :, t][..., None]).sum(-2)
    return out, state


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK_SIZE):
    """The same recurrence, `chunk` tokens at a time (prepared inputs): within a chunk the
    sequential delta updates are folded into one unit-lower-triangular solve (the UT
    transform), so a chunk costs a few matmuls; only the chunks run in sequence."""
    length = q.shape[2]
    pad = (-length) % chunk
    # Padding tokens have beta = 0, k = 0 and g = 0: they leave the state untouched.
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, _per_channel(g)))
    beta = F.pad(beta, (0, pad))
    b, h, n = q.shape[0], q.shape[1], q.shape[2] // chunk

    def chunks(t):
        return t.reshape(b, h, n, chunk, *t.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(-2)  # log decay from the chunk's start through each position [.., C, G]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)

    # Solve (I + strictly_lower(k_beta k^T * decay)) X = rhs for the chunk's corrected
    # values and for the decayed keys that read the state carried in from earlier chunks.
    system = _decayed_products(k_beta, k, decay, upper)
    solve = torch.linalg.solve_triangular
    values = solve(system, v_beta, upper=False, unitriangular=True)
    state_keys = solve(system, k_beta * decay.exp(), upper=False, unitriangular=True)
    intra = _decayed_products(q, k, decay, upper)  # attention within the chunk, causal
    q = q * decay.exp()
    k = k * (decay[..., -1:, :] - decay).exp()
    chunk_decay = decay[..., -1, :].exp()[..., None]  # [.., G, 1]: each key channel's row

    out = torch.empty_like(values)
    for i in range(n):
        v_new = values[:, :, i] - state_keys[:, :, i] @ state  # the part S does not predict
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, n * chunk, -1)[:, :, :length], state


def _decayed_products(a, b, decay, upper) -> torch.Tensor:
    """Within each chunk, sum_d a[i, d] b[j, d] exp(decay[i, d] - decay[j, d]) for j <= i, 0
    above the diagonal: a, b [..., n, C, d], decay [..., n, C, G] -> [..., n, C, C]."""
    if decay.shape[-1] == 1:  # one decay a head: the products, then each pair's decay
        d = decay[..., 0]
        pair_decay = (d[..., :, None] - d[..., None, :]).masked_fill(upper, float("-inf")).exp()
        return (a @ b.transpose(-1, -2)) * pair_decay
    # A decay per channel does not factor out of the sum: [C, C, dk] a head, so a chunk at a
    # time (as transformers' KDA; exp(decay_i) exp(-decay_j) apart would overflow)
    out = a.new_empty(*a.shape[:-1], a.shape[-2])
    for i in range(a.shape[-3]):
        d = decay[..., i, :, None, :] - decay[..., i, None, :, :]
        pair_decay = d.masked_fill(upper[..., None], float("-inf")).exp()
        out[..., i, :, :] = (a[..., i, :, None, :] * b[..., i, None, :, :] * pair_decay).sum(-1)
    return out


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear-attention layer. Parameter names follow the checkpoints
    (KDA's own where it has parts gated DeltaNet has not)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        la = cfg.linear_attention
        assert la is not None
        self.index = index  # row of this layer in the recurrent state pool
        self.nk, self.nv = la.num_key_heads, la.num_value_heads
        self.dk, self.dv = la.key_head_dim, la.value_head_dim
        self.key_dim, self.value_dim = la.key_dim, la.value_dim
        h = cfg.hidden_size
        self.separate, self.kda = la.separate_projections, la.kda
        if self.kda:  # (Kimi: q, k, v through their own convs; low-rank decay and output gate)
            self.q_proj = Linear(h, la.key_dim, bias=False)
            self.k_proj = Linear(h, la.key_dim, bias=False)
            self.v_proj = Linear(h, la.value_dim, bias=False)
            self.in_proj_b = Linear(h, la.num_value_heads, bias=False)
            self.f_a_proj = Linear(h, la.key_head_dim, bias=False)
            self.f_b_proj = Linear(la.key_head_dim, la.key_dim, bias=False)
            self.g_a_proj = Linear(h, la.value_head_dim, bias=False)
            self.g_b_proj = Linear(la.value_head_dim, la.value_dim, bias=False)
            for name, dim in (("q", la.key_dim), ("k", la.key_dim), ("v", la.value_dim)):
                setattr(
                    self,
                    f"{name}_conv1d",
                    _Conv1d(dim, dim, la.conv_kernel, groups=dim, bias=False),
                )
        elif self.separate:
            self.in_proj_qkv = Linear(h, 2 * la.key_dim + la.value_dim, bias=False)
            self.in_proj_z = Linear(h, la.value_dim, bias=False)
            self.in_proj_b = Linear(h, la.num_value_heads, bias=False)
            self.in_proj_a = Linear(h, la.num_value_heads, bias=False)
        else:
            self.in_proj_qkvz = Linear(h, 2 * la.key_dim + 2 * la.value_dim, bias=False)
            self.in_proj_ba = Linear(h, 2 * la.num_value_heads, bias=False)
        if not self.kda:
            self.conv1d = _Conv1d(
                la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False
            )
        # (KDA: a bias per key channel of every head, kept fp32 as transformers keeps it)
        self.dt_bias = nn.Parameter(torch.ones(la.key_dim if self.kda else la.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_value_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.rms_norm_eps, sigmoid_gate=self.kda)
        self.out_proj = Linear(la.value_dim, h, bias=False)
        self.act = activation(cfg.hidden_act)
        # The layers that read x, in the order `_project` takes their outputs; and them as
        # one, once stacked.
        if self.kda:
            qkv = (self.q_proj, self.k_proj, self.v_proj)
            self.of_x = (*qkv, self.g_a_proj, self.f_a_proj, self.in_proj_b)
        elif self.separate:
            self.of_x = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        else:
            self.of_x = (self.in_proj_qkvz, self.in_proj_ba)
        self.x_proj: Linear | None = None

    def stack_projections(self, dense: bool) -> None:
        """The projections of x computed as one weight from now on (layers/linear.py's
        `stacked`; dense weights too with `dense`): one GEMM of a decode step where KDA had
        six, Qwen3.5 four, Qwen3-Next two."""
        self.x_proj = stacked(*self.of_x, dense=dense)

    def _project(self, x: torch.Tensor):
        """x [T, H] -> conv input [T, conv_dim] (q, k, v), output gate z [T, Hv, dv], the
        per-value-head b (step size) [T, Hv] and a (decay) [T, Hv], or [T, H, dk] for KDA."""
        t, r = x.shape[0], self.nv // self.nk
        parts = outputs(x, self.of_x, self.x_proj)
        if self.kda:
            q, k, v, g_a, f_a, b = parts
            z = self.g_b_proj(g_a).view(t, self.nv, self.dv)
            a = self.f_b_proj(f_a).view(t, self.nk, self.dk)
            return torch.cat([q, k, v], dim=-1), z, b, a
        if self.separate:  # (Qwen3.5: each in head order already)
            qkv, z, b, a = parts
            return qkv, z.view(t, self.nv, self.dv), b, a
        # Qwen3-Next lays both projections out by key-head group: each group's q, k, its r
        # value heads' v and z (and b, a) are contiguous.
        qkvz, ba = parts
        qkvz = qkvz.view(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = ba.view(t, self.nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.nv, self.dv), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, states: RecurrentStatePool
    ) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        conv, ssm = states.conv[self.index], states.ssm[self.index]
        core = torch.cat(
            [self._group(conv, ssm, mixed, a, b, group) for group in batch.state_groups()]
        )  # [T, Hv, dv] fp32, flat token order
        out = self.norm(core.to(x.dtype).reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(out.view(x.shape[0], self.value_dim))

    def _group(self, conv, ssm, mixed, a, b, group: StateGroup) -> torch.Tensor:
        """Advance a group's sequences over their new tokens; for each capture (k, slot),
        copy the state after the first k tokens into `slot` (splitting the tokens there: a
        state exists only between the segments the rule runs). Returns [rows, Hv, dv]."""
        n, rows, slots = group.n, group.rows, group.slots
        mixed = mixed[rows].view(n, -1, mixed.shape[-1])
        a, b = a[rows].view(n, -1, *a.shape[1:]), b[rows].view(n, -1, self.nv)
        outs, start = [], 0
        for k, slot in [*group.captures, (mixed.shape[1], None)]:
            if k > start:
                sl = slice(start, k)
                outs.append(self._mix(conv, ssm, mixed[:, sl], a[:, sl], b[:, sl], slots))
                start = k
            if slot is not None:
                dst = torch.tensor([slot], device=slots.device)
                conv.index_copy_(0, dst, conv[slots])
                ssm.index_copy_(0, dst, ssm[slots])
        return torch.cat(outs, dim=1).reshape(-1, self.nv, self.dv)

    def _mix(self, conv, ssm, mixed, a, b, slots) -> torch.Tensor:
        """Advance sequences [n, T, ...] from their slots and write the new states back (a, b:
        the decay and step-size projections). Returns [n, T, Hv, dv] fp32."""
        n = mixed.shape[0]
        y, new_conv = causal_conv1d(mixed, conv[slots], self._conv_weight(), self.act)
        conv.index_copy_(0, slots, new_conv.to(conv.dtype))
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        shape = (n, y.shape[1], -1)
        q, k = q.reshape(*shape, self.dk), k.reshape(*shape, self.dk)
        v = v.reshape(*shape, self.dv)
        if y.shape[1] == 1 and gated_delta.available(y):  # a decode step: one launch
            out = gated_delta.recurrent_step(
                q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], self.A_log, self.dt_bias, ssm, slots
            )
            return out[:, None]
        beta = b.sigmoid()
        g = self._log_decay(a)
        if y.shape[1] > 1 and not self.kda and gated_delta.chunked_available(y):  # fla's
            out, new_ssm = gated_delta.chunked(q, k, v, g, beta, ssm[slots])
            ssm.index_copy_(0, slots, new_ssm)
            return out
        rule = recurrent_gated_delta_rule if y.shape[1] == 1 else chunk_gated_delta_rule
        out, new_ssm = rule(*_prepare(q, k, v, g, beta), ssm[slots])
        ssm.index_copy_(0, slots, new_ssm)
        return out.transpose(1, 2)

    def _conv_weight(self) -> torch.Tensor:
        """The depthwise conv's taps [conv_dim, kernel] over the q, k, v channels in turn."""
        if self.kda:  # (three convs in the checkpoint: joined here, a small copy a forward)
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            return torch.cat([c.weight[:, 0] for c in convs])
        return self.conv1d.weight[:, 0]

    def _log_decay(self, a: torch.Tensor) -> torch.Tensor:
        """g = -exp(A_log) softplus(a + dt_bias) <= 0: a [..., Hv] (a decay per head), or KDA's
        [..., H, dk] (per key channel, A_log still per head)."""
        a_log, bias = self.A_log.float(), self.dt_bias
        if self.kda:
            a_log, bias = a_log[:, None], bias.float().view(self.nk, self.dk)
        return -a_log.exp() * F.softplus(a.float() + bias)
