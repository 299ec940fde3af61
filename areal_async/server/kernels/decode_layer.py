"""A decode step's decoder layer on CPU as one C call: the same kernels the model calls op by op, driven from C.

Why: at batch 1 a SmolLM2-135M decode step spent about as long in Python and torch's dispatch as in its matmuls
(perf on the serving process, 2 threads, AMD EPYC Zen 5: the engine thread was in the packed matmul ~50% of its
time, in the interpreter and torch ~30%): a layer is ~15 tensor ops, each a few microseconds of dispatch, 30 layers a
step. Here a layer is one ctypes call: RMSNorm, the q|k|v product, RoPE with the k|v rows stored into the paged
cache, paged attention, the output product added into the residual stream, RMSNorm, the gate|up product, SiLU-gating
and the down product added into the residual stream. Every step but RoPE + store calls the very function the
op-by-op path calls (their addresses are passed in), with the same arguments, so the two paths give the same bits;
RoPE is the op-by-op path's arithmetic (torch.addcmul(x cos, roll(x, D/2), sin), which rounds x cos and then
fuses the multiply-add; the tables built once per step as before).

It takes a step when every token is a decode token read from the pages (one attention group), the packed matmuls
take its rows, and the model has no per-head q/k norm (Qwen3 keeps the op-by-op path). When every row wants its
logits and the interrupt is the engine's InterruptWord (or none), the whole step is one call (`decode_step`): the
embedding rows, the layers, the final norm and the LM head, the interrupt word read after every layer. Why that
too: each step streams all the weights through the caches, so the ~20 torch ops and 30 calls Python made between
the kernels ran cold (the final norm's row index took ~90 us after the layers against 3 us warm); one call takes
~1.7% off a batch-1 bf16 step of SmolLM2-135M (2-core AMD EPYC Zen 5, 10 alternating rounds). Otherwise the
layers are called one by one and the model polls its interrupt between them.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from areal_async.server.kernels import attention as cpu_attention
from areal_async.server.kernels.build import BF16_C, load_library

if TYPE_CHECKING:
    from areal_async.server.sampling import DrawPlan

__all__ = ["FusedDecode", "InterruptWord", "load_library_for"]

_SOURCE = (
    BF16_C
    + r"""
#pragma GCC optimize("fp-contract=off")  /* RoPE as torch computes it, no other contraction */

typedef int (*linear_fn)(const float*, const void*, const float*, const float*, float*, int64_t, int64_t, int64_t,
                         int64_t, int64_t);
typedef void (*norm_fn)(const float*, const float*, float*, int64_t, int64_t, int64_t, float, int64_t);
typedef void (*silu_fn)(const float*, float*, int64_t, int64_t, int64_t);
typedef void (*attn_fn)(const float*, const void*, const int64_t*, const int64_t*, float*, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t);

/* What every layer of one step shares. */
struct Step {
    void* linear;  /* kernels/gemm_packed.py's product for the weights' dtype */
    void* norm;    /* kernels/elementwise.py's rms_norm */
    void* silu;    /* kernels/elementwise.py's silu_mul */
    void* attn;    /* kernels/attention.py's paged decode attention for the cache's dtype */
    int64_t B, hidden, H, Hkv, D, inter, P, page_size, threads, attn_threads, kv_bf16;
    float eps;
    const float* cos;           /* [B, H + 2Hkv, D] the step's RoPE tables (q scaled, v passed through) */
    const float* sin;           /* [B, H + 2Hkv, D] */
    const int64_t* write_slots; /* [B] page * page_size + offset of each row's new k/v */
    const int64_t* table;       /* [B, P] */
    const int64_t* lens;        /* [B] */
    float* x;                   /* [B, hidden] the residual stream, updated in place */
    float* hs;                  /* [B, hidden] */
    float* qkv;                 /* [B, (H + 2Hkv) D] */
    float* q;                   /* [B, H, D] */
    float* attn_out;            /* [B, H D] */
    float* gu;                  /* [B, 2 inter] */
    float* act;                 /* [B, inter] */
};

/* One layer's weights: packed matrices, fp32 norms and biases (NULL: none), its cache pages. */
struct Layer {
    const float* ln1;
    const float* ln2;
    const void* qkv_w;
    const float* qkv_b;
    const void* o_w;
    const float* o_b;
    const void* gu_w;
    const float* gu_b;
    const void* down_w;
    const float* down_b;
    void* kv;  /* [pages, page_size, 2Hkv, D] fp32 or bf16 */
};

/* RoPE on every head row of qkv (v rows have cos 1, sin 0), then q -> s->q and k|v -> the cache slots */
static void rope_store(const struct Step* s, void* kv) {
    const int64_t rows = s->H + 2 * s->Hkv, D = s->D, half = D / 2;
    for (int64_t b = 0; b < s->B; b++) {
        float* qkv = s->qkv + b * rows * D;
        const float* c = s->cos + b * rows * D;
        const float* sn = s->sin + b * rows * D;
        const int64_t slot = s->write_slots[b];
        for (int64_t r = 0; r < rows; r++) {
            const float* xr = qkv + r * D;
            float out[512];
            /* torch.addcmul(x * cos, roll(x, D/2), sin): the product x cos rounded, then one fused multiply-add;
               roll(x, D/2)[d] = x[(d - D/2) mod D] */
            const float* cr = c + r * D;
            const float* sr = sn + r * D;
            for (int64_t d = 0; d < half; d++) out[d] = __builtin_fmaf(xr[d + D - half], sr[d], xr[d] * cr[d]);
            for (int64_t d = half; d < D; d++) out[d] = __builtin_fmaf(xr[d - half], sr[d], xr[d] * cr[d]);
            if (r < s->H) {
                memcpy(s->q + (b * s->H + r) * D, out, sizeof(float) * (size_t)D);
            } else {
                const int64_t at = (slot * 2 * s->Hkv + (r - s->H)) * D;
                if (s->kv_bf16)
                    for (int64_t d = 0; d < D; d++) ((uint16_t*)kv)[at + d] = f2bf(out[d]);
                else
                    memcpy((float*)kv + at, out, sizeof(float) * (size_t)D);
            }
        }
    }
}

/* Returns 0, or the failing product's code. */
int decode_layer(const struct Step* s, const struct Layer* l) {
    const linear_fn lin = (linear_fn)s->linear;
    const norm_fn norm = (norm_fn)s->norm;
    const int64_t B = s->B, hid = s->hidden, qkv_n = (s->H + 2 * s->Hkv) * s->D, qn = s->H * s->D;
    int rc;
    norm(s->x, l->ln1, s->hs, B, hid, hid, s->eps, s->threads);
    if ((rc = lin(s->hs, l->qkv_w, l->qkv_b, NULL, s->qkv, B, qkv_n, hid, qkv_n, s->threads))) return rc;
    rope_store(s, l->kv);
    ((attn_fn)s->attn)(s->q, l->kv, s->table, s->lens, s->attn_out, B, s->H, s->Hkv, s->D, s->P, s->page_size,
                       s->attn_threads);
    if ((rc = lin(s->attn_out, l->o_w, l->o_b, s->x, s->x, B, hid, qn, hid, s->threads))) return rc;
    norm(s->x, l->ln2, s->hs, B, hid, hid, s->eps, s->threads);
    if ((rc = lin(s->hs, l->gu_w, l->gu_b, NULL, s->gu, B, 2 * s->inter, hid, 2 * s->inter, s->threads))) return rc;
    ((silu_fn)s->silu)(s->gu, s->act, B, s->inter, s->threads);
    return lin(s->act, l->down_w, l->down_b, s->x, s->x, B, hid, s->inter, hid, s->threads);
}

/* What a whole step adds around the layers. */
struct Ends {
    const int64_t* ids;           /* [B] the step's tokens */
    const void* embed;            /* [V, hidden] fp32 or bf16 */
    int64_t embed_bf16;
    const float* norm_w;          /* [hidden] the final norm's weight */
    const void* head;             /* the LM head's packed panels */
    int64_t vocab;
    float* logits;                /* [B, V] */
    const volatile int32_t* stop; /* polled after every layer: nonzero stops the step there */
    void* sample;                 /* kernels/sampling.py's sample_rows, or NULL: the draws after the head */
    const float* temps;           /* [B] its inputs (sampling.py DrawPlan) */
    const float* min_p;           /* [B] */
    const double* uniforms;       /* [B] */
    int64_t* tokens;              /* [B] its outputs */
    float* logprobs;              /* [B] */
    const int64_t* pos;           /* [B] the rows' positions: the step's rope tables are built here (s->cos, s->sin) */
    const float* cos_tab;         /* [max_pos, D] the model's tables */
    const float* sin_tab;         /* [max_pos, D] */
    const float* rope_mul;        /* [H + 2Hkv] per head row: the softmax scale for q, 1 for k, 0 for v */
    const float* cos_add;         /* [H + 2Hkv] 1 for v rows (cos = 1, sin = 0: v passes unchanged), else 0 */
};

typedef void (*sample_fn)(const float*, const float*, const float*, const double*, int64_t*, float*, int64_t, int64_t,
                          int64_t);

/* The embedding rows, every layer, the final norm, the LM head and (e->sample) the draws: 0 when done, 1 when
   *stop cut it short after a layer, else the failing product's code. */
int decode_step(const struct Step* s, const struct Layer* layers, int64_t n_layers, const struct Ends* e) {
    const int64_t B = s->B, hid = s->hidden;
    if (e->pos) { /* model.forward's tables: cos = add + tab[pos] * mul, sin = tab[pos] * mul, per head row. add is 0
                     wherever mul is not, so the sum is exact and equals torch.addcmul's whether or not it fuses */
        const int64_t rows = s->H + 2 * s->Hkv, D = s->D;
        for (int64_t b = 0; b < B; b++) {
            const float* ct = e->cos_tab + e->pos[b] * D;
            const float* st = e->sin_tab + e->pos[b] * D;
            for (int64_t r = 0; r < rows; r++) {
                float* c = (float*)s->cos + (b * rows + r) * D;
                float* sn = (float*)s->sin + (b * rows + r) * D;
                const float mul = e->rope_mul[r], add = e->cos_add[r];
                for (int64_t d = 0; d < D; d++) {
                    c[d] = add + ct[d] * mul;
                    sn[d] = st[d] * mul;
                }
            }
        }
    }
    for (int64_t b = 0; b < B; b++) {  /* rows widened exactly, as torch's embedding(...).float() */
        float* xb = s->x + b * hid;
        if (e->embed_bf16)
            for (int64_t i = 0; i < hid; i++) xb[i] = bf2f(((const uint16_t*)e->embed)[e->ids[b] * hid + i]);
        else
            memcpy(xb, (const float*)e->embed + e->ids[b] * hid, sizeof(float) * (size_t)hid);
    }
    for (int64_t li = 0; li < n_layers; li++) {
        const int rc = decode_layer(s, layers + li);
        if (rc) return rc;
        if (*e->stop) return 1;
    }
    ((norm_fn)s->norm)(s->x, e->norm_w, s->hs, B, hid, hid, s->eps, s->threads);
    const linear_fn lin = (linear_fn)s->linear;
    const int rc = lin(s->hs, e->head, NULL, NULL, e->logits, B, e->vocab, hid, e->vocab, s->threads);
    if (rc) return rc;
    if (e->sample)
        ((sample_fn)e->sample)(e->logits, e->temps, e->min_p, e->uniforms, e->tokens, e->logprobs, B, e->vocab,
                               s->threads);
    return 0;
}
"""
)

MAX_HEAD_DIM = 512  # rope_store's row buffer

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Step(ctypes.Structure):
    _fields_ = [
        *[(n, _P) for n in ("linear", "norm", "silu", "attn")],
        *[(n, _I64) for n in ("B", "hidden", "H", "Hkv", "D", "inter", "P", "page_size", "threads", "attn_threads")],
        ("kv_bf16", _I64),
        ("eps", ctypes.c_float),
        *[(n, _P) for n in ("cos", "sin", "write_slots", "table", "lens", "x", "hs", "qkv", "q", "attn_out", "gu")],
        ("act", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        (n, _P) for n in ("ln1", "ln2", "qkv_w", "qkv_b", "o_w", "o_b", "gu_w", "gu_b", "down_w", "down_b", "kv")
    ]


class _Ends(ctypes.Structure):
    _fields_ = [("ids", _P), ("embed", _P), ("embed_bf16", _I64), ("norm_w", _P), ("head", _P), ("vocab", _I64)]
    _fields_ += [("logits", _P), ("stop", _P), *[(n, _P) for n in ("sample", "temps", "min_p", "uniforms")]]
    _fields_ += [("tokens", _P), ("logprobs", _P), *[(n, _P) for n in ("pos", "cos_tab", "sin_tab", "rope_mul")]]
    _fields_ += [("cos_add", _P)]


class InterruptWord:
    """The engine's "cut the step short" flag, readable both ways: called from Python (as `forward`'s `interrupt`
    callbacks are) and polled from C through `address` (a whole decode step in one call polls it between layers)."""

    def __init__(self) -> None:
        self._word = ctypes.c_int32(0)
        self.address = ctypes.addressof(self._word)

    def __call__(self) -> bool:
        return bool(self._word.value)

    def set(self, on: bool) -> None:
        self._word.value = 1 if on else 0


def load_library_for(march: str | None = None) -> ctypes.CDLL | None:
    """The built driver for `march` (default: build.default_march()), or None (`AREAL_CPU_FUSED_DECODE=0` turns it
    off)."""
    return load_library("decode_layer", _SOURCE, "AREAL_CPU_FUSED_DECODE", "the op-by-op decode layer", march)


def _addr(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


class FusedDecode:
    """Runs a model's decode layers through the C driver. Holds the per-layer argument blocks, rebuilt whenever any
    weight they point at was written (its version moved) or repacked."""

    def __init__(self, lib: ctypes.CDLL, model: Any):
        self._fn = lib.decode_layer
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(_Step), ctypes.POINTER(_Layer)]
        self._step_fn = lib.decode_step
        self._step_fn.restype = ctypes.c_int
        self._step_fn.argtypes = [ctypes.POINTER(_Step), ctypes.POINTER(_Layer), ctypes.c_int64, ctypes.POINTER(_Ends)]
        self._array: Any = None  # the layer blocks as one C array (decode_step)
        self._no_stop = ctypes.c_int32(0)
        self.model = model
        self._layers: list[_Layer] = []
        self._key: tuple = ()
        self._tensors: list[torch.Tensor | None] = []
        self._keep: list[torch.Tensor] = []  # the fp32 copies the blocks point at
        self._arena: dict[str, torch.Tensor] = {}  # scratch for the largest batch so far; a step takes rows [:B]

    def _scratch(self, b: int) -> dict[str, torch.Tensor]:
        """A step's scratch buffers for b rows, [b, ...] fp32, contiguous: views of buffers kept from step to step
        (grown when b outgrows them) instead of nine allocations a step, each a torch call run cold and each new
        buffer cold memory."""
        spec = self.model.spec
        d, h, hkv, i, hid = spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.hidden_size
        if not self._arena or self._arena["x"].shape[0] < b:
            shapes = {
                "x": (hid,),  # the residual stream (whole steps)
                "hs": (hid,),
                "qkv": ((h + 2 * hkv) * d,),
                "q": (h, d),
                "attn": (h * d,),  # attention's output
                "gu": (2 * i,),  # gate|up
                "act": (i,),  # silu(gate) * up
                "cos": (h + 2 * hkv, d),  # rope tables (whole steps build them in C)
                "sin": (h + 2 * hkv, d),
            }
            self._arena = {k: torch.empty(b, *s, dtype=torch.float32) for k, s in shapes.items()}
        return {k: t[:b] for k, t in self._arena.items()}

    def applies(self, batch: Any) -> bool:
        """Whether this step can take the fused layers: one paged decode group of every token, packed products for
        its rows, the elementwise and attention kernels built, no per-head q/k norm, head dim within bounds."""
        m = self.model
        mm = m.mm
        if mm.packed is None or m.elementwise is None or m._kernel is None or not m.paged_decode:
            return False
        if len(batch.groups) != 1 or m.spec.head_dim > MAX_HEAD_DIM or m.layers[0].qk_norm is not None:
            return False
        g, w = batch.groups[0], m.layers[0].qkv_w
        limit = mm.packed.max_rows_f32 if w.dtype == torch.float32 else mm.packed.max_rows_bf16
        return g.table is not None and g.start == 0 and g.end == batch.num_tokens and 1 <= batch.num_tokens <= limit

    def _f32(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        f = t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
        self._keep.append(f)
        return f.data_ptr()

    def _blocks(self, cache: Any) -> list[_Layer]:
        m = self.model
        if not self._tensors:  # the model's tensors are fixed objects: loads copy into them
            self._tensors = [
                t
                for la in m.layers
                for t in (la.qkv_w, la.o_w, la.gate_up_w, la.down_w, la.ln1, la.ln2, la.qkv_b, la.o_b, la.gate_up_b)
                + (la.down_b,)
            ]
        # every version the blocks depend on (a write moves it, and with it the packed panels), cheaply per step
        key = (tuple(-1 if t is None else t._version for t in self._tensors), cache.kv.data_ptr(), id(m.mm.packed))
        if key != self._key:
            self._keep = []
            self._layers = []
            for li, la in enumerate(m.layers):
                qkv, o, gu, down = (m.mm._panels(w) for w in (la.qkv_w, la.o_w, la.gate_up_w, la.down_w))  # repacked
                self._layers.append(
                    _Layer(
                        self._f32(la.ln1),
                        self._f32(la.ln2),
                        qkv.data_ptr(),
                        self._f32(la.qkv_b),
                        o.data_ptr(),
                        self._f32(la.o_b),
                        gu.data_ptr(),
                        self._f32(la.gate_up_b),
                        down.data_ptr(),
                        self._f32(la.down_b),
                        cache.kv[li].data_ptr(),
                    )  # fmt: skip
                )
            self._key = key
            self._array = (_Layer * len(self._layers))(*self._layers)
        return self._layers

    def _step_args(self, x: torch.Tensor, batch: Any, cache: Any, cos: torch.Tensor, sin: torch.Tensor) -> _Step:
        """The argument block every layer of this step shares (its scratch buffers and tables kept alive on it)."""
        m = self.model
        spec, mm = m.spec, m.mm
        b, d, h, hkv, i = batch.num_tokens, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
        g = batch.groups[0]
        if cache.kv.shape[2] > cpu_attention.MAX_PAGE:  # the attention kernel's page buffers, as its wrapper checks
            raise ValueError(f"page size {cache.kv.shape[2]} is above the kernel's {cpu_attention.MAX_PAGE}")
        table, lens = g.table.contiguous(), g.lens.contiguous()
        slots = batch.write_slots.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        scratch = self._scratch(b)
        bufs = [scratch[k] for k in ("hs", "qkv", "q", "attn", "gu", "act")]
        packed, ew, att = mm.packed, m.elementwise, m._kernel
        bf16_w = m.layers[0].qkv_w.dtype == torch.bfloat16
        kv_bf16 = cache.kv.dtype == torch.bfloat16
        threads = torch.get_num_threads()
        step = _Step(
            _addr(packed.bf16_fn if bf16_w else packed.f32_fn), _addr(ew._norm), _addr(ew._silu),
            _addr(att.bf16 if kv_bf16 else att.f32),
            b, spec.hidden_size, h, hkv, d, i, table.shape[1], cache.kv.shape[2], threads, min(threads, b),
            int(kv_bf16), spec.rms_norm_eps,
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), table.data_ptr(), lens.data_ptr(), x.data_ptr(),
            *(t.data_ptr() for t in bufs),
        )  # fmt: skip
        step._keep = (table, lens, slots, cos, sin, bufs)  # type: ignore[attr-defined]
        return step

    def run(self, x: torch.Tensor, batch: Any, cache: Any, cos: torch.Tensor, sin: torch.Tensor, interrupt) -> bool:
        """Every layer over x [B, hidden] fp32 (contiguous, updated in place); cos, sin [B, H + 2Hkv, D] fp32.
        `interrupt` (or None) is polled after every layer; returns True when it asked to stop there."""
        step = self._step_args(x, batch, cache, cos, sin)
        layers = self._blocks(cache)
        sp = ctypes.byref(step)
        for li in range(len(layers)):
            rc = self._fn(sp, ctypes.byref(layers[li]))
            if rc != 0:
                raise MemoryError("decode_layer: a product could not allocate its input copy")
            if interrupt is not None and interrupt():
                return True
        return False

    def whole_step(self, batch: Any, interrupt) -> bool:
        """Whether `step` can take this batch: every row wants its logits (a decode step's rows do) and the
        interrupt, if any, is an InterruptWord that C can poll."""
        m = self.model
        return (
            (interrupt is None or isinstance(interrupt, InterruptWord))
            and len(batch.logits_idx) == batch.num_tokens
            and batch.input_ids.dtype == torch.int64
            and batch.positions.dtype == torch.int64
            and m.cos.dtype == torch.float32  # the rope tables C builds the step's from
            and m.embed.is_contiguous()
            and m.lm_head.is_contiguous()
        )

    def step(self, batch: Any, cache: Any, interrupt, draws: DrawPlan | None = None) -> torch.Tensor | None:
        """The whole decode step in one C call: embedding rows, every layer, final norm and LM head (the same
        kernels, so the same bits as `run` and the model's own head) -> fp32 logits [B, V], or None when the
        interrupt word stopped it after a layer; with `draws` (one per row), also the sampling kernel on the logits,
        filling its tokens and logprobs (`done`). Why: what a step did in Python between its kernels (~20 small torch
        ops and 30 calls) ran with cold caches, each step's weights having just streamed through them; perf of a
        batch-1 bf16 step put ~10% of the engine thread there."""
        m = self.model
        b, vocab = batch.num_tokens, m.lm_head.shape[0]
        scratch = self._scratch(b)
        logits = torch.empty(b, vocab, dtype=torch.float32)  # [B, V]
        step = self._step_args(scratch["x"], batch, cache, scratch["cos"], scratch["sin"])  # tables filled in C
        self._blocks(cache)
        ids = batch.input_ids.contiguous()
        norm_w = m.norm if m.norm.dtype == torch.float32 else m.norm.float()
        stop = interrupt.address if interrupt is not None else ctypes.addressof(self._no_stop)
        ends = _Ends(
            ids.data_ptr(), m.embed.data_ptr(), int(m.embed.dtype == torch.bfloat16), norm_w.data_ptr(),
            m.mm._panels(m.lm_head).data_ptr(), vocab, logits.data_ptr(), stop,
        )  # fmt: skip
        pos = batch.positions.contiguous()
        ends.pos, ends.cos_tab, ends.sin_tab = pos.data_ptr(), m.cos.data_ptr(), m.sin.data_ptr()
        ends.rope_mul, ends.cos_add = m._rope_mul.data_ptr(), m._cos_add.data_ptr()
        if draws is not None and draws.temps.shape[0] == b:
            ends.sample, ends.temps, ends.min_p = draws.kernel.address, draws.temps.data_ptr(), draws.min_p.data_ptr()
            ends.uniforms, ends.tokens, ends.logprobs = (
                draws.uniforms.data_ptr(),
                draws.tokens.data_ptr(),
                draws.logprobs.data_ptr(),
            )
        rc = self._step_fn(ctypes.byref(step), self._array, len(self._layers), ctypes.byref(ends))
        if rc not in (0, 1):
            raise MemoryError("decode_step: a product could not allocate its input copy")
        if rc == 1:
            return None
        if ends.sample:
            draws.done = True  # type: ignore[union-attr]
        return logits
