"""Token sampling on CPU in one C pass per row: the temperature-scaled softmax's normaliser, the sampled token and
its exact logprob, without a [B, V] temporary.

Why: through torch's ops, sampling at temperature 0.7 cost 88-90 ms a step at batch 64 over SmolLM2's 49,152-token
vocabulary (1 thread), against 4 ms greedy: the division by the temperature, log_softmax (three passes), exp, and
above all an Exponential(1) draw per vocabulary entry (3.1 M random numbers a step) for the exponential race, each
pass writing a [64, 49,152] temporary. Inverse-CDF sampling needs one uniform per row instead: with
e_i = exp((x_i - max) / T) and S = sum e_i, the token is the first i whose running sum exceeds u * S. Per row here:
1. the max of the logits (and, for a greedy row, the first index holding it, as torch.argmax picks);
2. e_i with the kernels' vectorised exp (build.py), summed in double per block of BLOCK entries (the block sums are
   kept: a few hundred doubles);
3. the draw: walk the block sums to the block where the running sum passes u * S, then that block's entries.
Work is two reads of the row and ~2 BLOCK exps, no writes of [V]. The logprob is log_softmax(x / T) at the
token: x_tok / T - (max / T + log S), the same quantity torch's path reports (max / T is the max of x / T exactly:
division by T > 0 is monotone).

The draw is exact up to rounding: a token is picked with probability e_i / S (its width in [0, S)), and an entry
whose exp underflows (below e^-87, or a banned token's -inf) has width 0 and is never picked. min-p (entries with
e_i < min_p * e_max, e_max = 1, dropped) is applied to the draw's sums only, as the torch path truncates after
taking the logprobs. Each row's uniform comes from its request's generator where it has one (sampling.py), so a
seeded request's samples do not depend on its batch.

Built on first use (build.py); `AREAL_CPU_SAMPLING=0` turns it off, and where it cannot be built sampling.py uses
torch's ops.
"""

from __future__ import annotations

import ctypes

import torch

from areal_async.server.kernels.build import EXP_POLY_C, bind, load_library

BLOCK = 128  # entries per block sum: the draw's last step recomputes at most this many exps

_SOURCE = (
    EXP_POLY_C
    + r"""
#include <math.h>
#include <float.h>
#include <stdlib.h>

#define BLOCK """
    + str(BLOCK)
    + r"""

/* e^d, or exactly 0 where e^d is below what exp_poly represents (d < -87, -inf included): such entries must never
   be drawn, and exp_poly would clamp them to e^-87 */
static inline float weight(float d) { return d < -87.0f ? 0.0f : exp_poly(d); }

/* the first index of x [n] holding mx: 64 entries compared at a time, then the one block walked */
static int64_t first_index_of(const float* x, int64_t n, float mx) {
    int64_t i0 = 0;
    for (; i0 + 64 <= n; i0 += 64) {
        int hit = 0;
        #pragma omp simd reduction(|:hit)
        for (int64_t i = i0; i < i0 + 64; i++) hit |= x[i] == mx;
        if (hit) break;
    }
    for (int64_t i = i0; i < n; i++)
        if (x[i] == mx) return i;
    return 0;  /* no entry equals the max: NaNs; torch would return a NaN's index, 0 keeps the caller in range */
}

/* One token per row of logits x [rows, n] (fp32, processed): temp[r] <= 0 means greedy (argmax, logprob of the
   plain softmax), else the token is drawn from softmax(x / temp[r]) with min_p[r] truncation by the uniform
   u[r] in [0, 1). tok [rows], logprob [rows] = log_softmax(x / T)[tok] (T = 1 for greedy rows). */
void sample_rows(const float* x, const float* temp, const float* min_p, const double* u, int64_t* tok,
                 float* logprob, int64_t rows, int64_t n, int64_t threads) {
    const int64_t nblocks = (n + BLOCK - 1) / BLOCK;
    #pragma omp parallel num_threads(rows >= 2 ? threads : 1)
    {
        double* bsum = (double*)malloc((size_t)nblocks * sizeof(double));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float* xr = x + r * n;
            const int greedy = !(temp[r] > 0.f);
            const float t = greedy ? 1.f : temp[r], inv_t = 1.f / t;
            float mx = -INFINITY;
            #pragma omp simd reduction(max:mx)
            for (int64_t i = 0; i < n; i++) mx = xr[i] > mx ? xr[i] : mx;
            /* the draw's weights: min-p drops what is below min_p of the top entry's weight (1) */
            const float floor_w = greedy ? 0.f : min_p[r];
            double total = 0.0, kept = 0.0;
            for (int64_t k = 0; k < nblocks; k++) {
                const int64_t hi = (k + 1) * BLOCK < n ? (k + 1) * BLOCK : n;
                double s = 0.0, sk = 0.0;
                #pragma omp simd reduction(+:s, sk)
                for (int64_t i = k * BLOCK; i < hi; i++) {
                    const float e = weight((xr[i] - mx) * inv_t);
                    s += (double)e;
                    sk += e >= floor_w ? (double)e : 0.0;
                }
                total += s;
                kept += sk;
                bsum[k] = sk;
            }
            int64_t pick;
            if (greedy) {
                pick = first_index_of(xr, n, mx);
            } else {
                double target = u[r] * kept, c = 0.0;
                int64_t k = 0;
                while (k < nblocks - 1 && c + bsum[k] <= target) c += bsum[k++];
                if (bsum[k] == 0.0) {  /* rounding ran past the last weighted block: its last weighted entry */
                    target = INFINITY;
                    while (k > 0 && bsum[k] == 0.0) k--;
                }
                const int64_t hi = (k + 1) * BLOCK < n ? (k + 1) * BLOCK : n;
                pick = -1;
                for (int64_t i = k * BLOCK; i < hi; i++) {
                    const float e = weight((xr[i] - mx) * inv_t);
                    if (e >= floor_w && e > 0.f) {
                        pick = i;  /* the last weighted entry so far: where a rounding short of target ends */
                        c += (double)e;
                        if (c > target) break;
                    }
                }
                if (pick < 0) pick = first_index_of(xr, n, mx);  /* every weight 0 (NaNs): the argmax */
            }
            tok[r] = pick;
            logprob[r] = (float)((double)(xr[pick] / t) - ((double)(mx / t) + log(total)));
        }
        free(bsum);
    }
}
"""
)


class Kernel:
    """The built sampling function, with the tensor-level call."""

    def __init__(self, lib: ctypes.CDLL):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = bind(lib, "sample_rows", [ptr] * 6 + [i64] * 3)
        self.address: int = ctypes.cast(self._fn, ctypes.c_void_p).value or 0  # for C callers (decode_layer.py)

    def sample(
        self, logits: torch.Tensor, temps: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] contiguous fp32 (processed); temps [B] fp32 (<= 0: greedy); min_p [B] fp32; uniforms [B]
        float64 in [0, 1) -> (tokens [B] long, logprobs [B] fp32: log_softmax(logits / T) at the token)."""
        rows, n = logits.shape
        temps, min_p, uniforms = temps.contiguous(), min_p.contiguous(), uniforms.contiguous()
        if temps.dtype != torch.float32 or min_p.dtype != torch.float32 or uniforms.dtype != torch.float64:
            raise TypeError("temps and min_p are fp32, uniforms float64")
        tok = torch.empty(rows, dtype=torch.long)
        lp = torch.empty(rows, dtype=torch.float32)
        self._fn(
            logits.data_ptr(),
            temps.data_ptr(),
            min_p.data_ptr(),
            uniforms.data_ptr(),
            tok.data_ptr(),
            lp.data_ptr(),
            rows,
            n,
            torch.get_num_threads(),
        )
        return tok, lp


def load(march: str | None = None) -> Kernel | None:
    """The kernel built for `march` (default: cpu_build.default_march()), or None where it cannot be built
    (build.py; `AREAL_CPU_SAMPLING=0` turns it off)."""
    lib = load_library("sampling", _SOURCE, "AREAL_CPU_SAMPLING", "torch's sampling ops", march)
    return Kernel(lib) if lib is not None else None
