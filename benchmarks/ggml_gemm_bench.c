/* ggml's matmul rate on given shapes and thread count, for the inference benchmark's roofline.
 *
 * Why not test-backend-ops: its perf mode runs its own shapes, and on the CPU backend it uses half the cores
 * (hardware_concurrency / 2), one thread on a 2-core machine; the roofline needs the model's own matmul shapes at the
 * engine's thread count. This runs ggml_mul_mat exactly as llama.cpp's CPU backend does in a decode step: weights
 * [in, out] of the given type (f32, bf16, q8_0), activations [in, rows] in f32 (ggml converts them to the weights'
 * dot type inside the op, as in inference), one graph with every matmul of the model, timed best of several rounds.
 *
 *   ggml-gemm-bench TYPE ROWS THREADS SECONDS IN:OUT:COUNT [IN:OUT:COUNT ...]
 * prints one JSON line: {"type": ..., "rows": ..., "threads": ..., "flops": ..., "best_s": ..., "gflops": ...}
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

#define MAX_SHAPES 16

struct shape {
    long in, out, count;
};

static enum ggml_type parse_type(const char *s) {
    if (strcmp(s, "f32") == 0) return GGML_TYPE_F32;
    if (strcmp(s, "bf16") == 0) return GGML_TYPE_BF16;
    if (strcmp(s, "q8_0") == 0) return GGML_TYPE_Q8_0;
    fprintf(stderr, "unknown type %s (f32, bf16, q8_0)\n", s);
    exit(2);
}

/* Fill a weight tensor with small pseudo-random values in its own type (the rate does not depend on the values, but
 * denormals or NaNs could change it). */
static void fill_weight(struct ggml_tensor *w, float *scratch, unsigned *seed) {
    const long n = w->ne[0] * w->ne[1];
    for (long i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        scratch[i] = ((float)(*seed >> 8) / 16777216.0f - 0.5f) * 0.1f;
    }
    if (w->type == GGML_TYPE_F32) {
        memcpy(w->data, scratch, n * sizeof(float));
    } else if (w->type == GGML_TYPE_BF16) {
        ggml_fp32_to_bf16_row(scratch, (ggml_bf16_t *)w->data, n);
    } else {
        ggml_quantize_chunk(w->type, scratch, w->data, 0, w->ne[1], w->ne[0], NULL);
    }
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s TYPE ROWS THREADS SECONDS IN:OUT:COUNT ...\n", argv[0]);
        return 2;
    }
    const enum ggml_type type = parse_type(argv[1]);
    const long rows = atol(argv[2]);
    const int threads = atoi(argv[3]);
    const double seconds = atof(argv[4]);
    struct shape shapes[MAX_SHAPES];
    int n_shapes = 0;
    long max_elems = 0;
    size_t mem = 0;
    double flops = 0;
    for (int i = 5; i < argc && n_shapes < MAX_SHAPES; i++) {
        struct shape s;
        if (sscanf(argv[i], "%ld:%ld:%ld", &s.in, &s.out, &s.count) != 3) {
            fprintf(stderr, "bad shape %s (IN:OUT:COUNT)\n", argv[i]);
            return 2;
        }
        shapes[n_shapes++] = s;
        if (s.in * s.out > max_elems) max_elems = s.in * s.out;
        /* every copy has its own weights, as the model's layers do: the rate includes reading them from memory */
        mem += s.count * (ggml_row_size(type, s.in) * s.out + ggml_row_size(GGML_TYPE_F32, s.in) * rows +
                          ggml_row_size(GGML_TYPE_F32, s.out) * rows + 4 * ggml_tensor_overhead());
        flops += 2.0 * rows * s.in * s.out * s.count;
    }
    ggml_time_init();
    ggml_cpu_init();
    struct ggml_init_params ip = {mem + ggml_graph_overhead() + (1 << 20), NULL, false};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    float *scratch = malloc(max_elems * sizeof(float));
    unsigned seed = 1234;
    for (int i = 0; i < n_shapes; i++) {
        for (long c = 0; c < shapes[i].count; c++) {
            struct ggml_tensor *w = ggml_new_tensor_2d(ctx, type, shapes[i].in, shapes[i].out);
            struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, shapes[i].in, rows);
            fill_weight(w, scratch, &seed);
            float *xd = (float *)x->data;
            for (long k = 0; k < shapes[i].in * rows; k++) xd[k] = (float)((k * 7919) % 201 - 100) * 1e-3f;
            ggml_build_forward_expand(gf, ggml_mul_mat(ctx, w, x));
        }
    }
    free(scratch);
    /* one work buffer for every round (ggml_graph_compute_with_ctx would allocate a new one in ctx per call) */
    struct ggml_cplan plan = ggml_graph_plan(gf, threads, NULL);
    plan.work_data = plan.work_size ? malloc(plan.work_size) : NULL;
    ggml_graph_compute(gf, &plan); /* warm-up: threads, caches */
    double best = 1e30;
    const int64_t end = ggml_time_us() + (int64_t)(seconds * 1e6);
    int rounds = 0;
    while (rounds < 3 || ggml_time_us() < end) {
        const int64_t t0 = ggml_time_us();
        ggml_graph_compute(gf, &plan);
        const double dt = (ggml_time_us() - t0) / 1e6;
        if (dt < best) best = dt;
        rounds++;
    }
    printf("{\"type\": \"%s\", \"rows\": %ld, \"threads\": %d, \"flops\": %.0f, \"best_s\": %.6f, \"rounds\": %d, "
           "\"gflops\": %.3f}\n",
           argv[1], rows, threads, flops, best, rounds, flops / best / 1e9);
    free(plan.work_data);
    ggml_free(ctx);
    return 0;
}
