// The target's attention kernel (cuda/src/attention.cu) run on the CPU, the same source: each
// block's 128 threads are fibers (ucontext) that a scheduler runs in turn, every barrier, shuffle
// and tensor-core product a point where each fiber yields until all 128 have reached it. So
// the kernel's indexing, masking, running softmax and write-out run as written; only the three
// device primitives are stood in for here:
//   mma_bf16   mma.sync.m16n8k16 (bf16 in, f32 accumulate) from the fragment layout the PTX ISA
//              gives (the kernel's header comment), summed in f32;
//   ldsm_x4    ldmatrix .x4 (and .trans) from the fragment layout the PTX ISA gives;
//   shuffles   __shfl_xor_sync through a per-thread exchange;
//   pack       f32 pairs to bf16, rounded to nearest even.
// A barrier reached by some threads of a block while others have returned is reported: on a GPU
// it hangs or is undefined.
//
// Checks (exit 0 when all hold; cuda/tests/attention.rs runs this):
//   1. Each kernel against attention in f64 on the same bf16 inputs: sequences of 1, 17, 64,
//      65 and 150 tokens in one batch (a partial tile, one exact tile, one token past it, several tiles),
//      4 query heads on 2 kv heads, head dims 16, 32, 64 and 128; every output written, none
//      NaN, and within 0.02 of the reference (bf16 keeps 8 bits: the probabilities and the
//      output are rounded to it, about 0.004 relative each).
//   2. Both kernels of a head dim (fragments loaded by ldmatrix, or by plain loads) give the
//      same bits.
//   3. Causal and per sequence, exactly: one token's keys and values made large leaves every
//      row before it in its sequence and every row of the other sequences bit for bit the same,
//      and changes the token's own row.
//
//   c++ -std=c++17 -O2 -fno-strict-aliasing -I cuda/src cuda/tests/attention_host.cpp && ./a.out

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

struct alignas(16) uint4 {
    uint32_t x, y, z, w;
};
static inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct Dim {
    unsigned x, y, z;
};

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

namespace fiber {

constexpr int N = 128;
constexpr size_t STACK = 256 * 1024;
ucontext_t sched;
ucontext_t ctx[N];
bool done[N];
std::vector<char> stacks(N* STACK);
int cur;
std::function<void()> body;

void entry() {
    body();
    done[cur] = true;
}

// A barrier: back to the scheduler, which resumes this thread once every other has got here.
void sync() { swapcontext(&ctx[cur], &sched); }

// Runs one block: every thread until its next barrier, round after round.
void run(std::function<void()> f) {
    body = std::move(f);
    for (int i = 0; i < N; ++i) {
        getcontext(&ctx[i]);
        ctx[i].uc_stack.ss_sp = &stacks[i * STACK];
        ctx[i].uc_stack.ss_size = STACK;
        ctx[i].uc_link = &sched;
        makecontext(&ctx[i], entry, 0);
        done[i] = false;
    }
    for (;;) {
        for (int i = 0; i < N; ++i) {
            if (!done[i]) {
                cur = i;
                swapcontext(&sched, &ctx[i]);
            }
        }
        int finished = 0;
        for (int i = 0; i < N; ++i) finished += done[i];
        if (finished == N) return;
        if (finished != 0) {
            std::fprintf(stderr, "FAIL: %d of %d threads returned while the others wait at a barrier\n",
                         finished, N);
            std::exit(1);
        }
    }
}

}  // namespace fiber

Dim blockIdx, gridDim;
#define threadIdx (Dim{(unsigned)fiber::cur, 0, 0})
#define __syncthreads() fiber::sync()

static float exchange[fiber::N];
static float shfl_xor(float v, int lanemask) {
    exchange[fiber::cur] = v;
    fiber::sync();
    const float r = exchange[fiber::cur ^ lanemask];
    fiber::sync();
    return r;
}
#define __shfl_xor_sync(mask, v, lanemask) shfl_xor(v, lanemask)

static float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return 0x7fc0;
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static float half_of(uint32_t reg, int hi) { return bf16_to_f32((uint16_t)(hi ? reg >> 16 : reg & 0xffff)); }

static inline uint32_t pack(float lo, float hi) { return (uint32_t)f32_to_bf16(lo) | ((uint32_t)f32_to_bf16(hi) << 16); }

static uint32_t frag_a[fiber::N][4], frag_b[fiber::N][2];
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the calling thread's warp: each lane
// posts its fragments, then adds its own four C entries from the whole warp's.
static void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    const int me = fiber::cur;
    std::memcpy(frag_a[me], a, sizeof frag_a[me]);
    frag_b[me][0] = b0;
    frag_b[me][1] = b1;
    fiber::sync();
    const int warp = me / 32 * 32, g = (me % 32) / 4, t = me % 4;
    // A (row r, col k): lane 4 (r % 8) + (k % 8) / 2, register (k >= 8 ? 2 : 0) + (r >= 8).
    auto A = [&](int r, int k) {
        return half_of(frag_a[warp + 4 * (r % 8) + (k % 8) / 2][(k >= 8 ? 2 : 0) + (r >= 8 ? 1 : 0)], k % 2);
    };
    // B (k, col n): lane 4 n + (k % 8) / 2, register k >= 8.
    auto B = [&](int k, int n) { return half_of(frag_b[warp + 4 * n + (k % 8) / 2][k >= 8 ? 1 : 0], k % 2); };
    float d[4];
    for (int j = 0; j < 4; ++j) {
        const int r = g + (j >= 2 ? 8 : 0), n = 2 * t + (j & 1);
        float acc = c[j];
        for (int k = 0; k < 16; ++k) acc += A(r, k) * B(k, n);
        d[j] = acc;
    }
    fiber::sync();  // every lane has read the fragments before any posts new ones
    std::memcpy(c, d, sizeof d);
}

static const uint16_t* ldsm_rows[fiber::N];
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 for the calling thread's warp: each lane posts
// its row address, then takes its four registers from the warp's rows (PTX ISA, "ldmatrix":
// lanes 8j..8j+7 address matrix j's rows; lane 4 g + t receives row g, elements 2t and 2t + 1,
// the lower in the low half, or with .trans column g, rows 2t and 2t + 1).
static void ldsm(uint32_t r[4], const uint16_t* p, bool trans) {
    const int me = fiber::cur;
    if ((uintptr_t)p % 16 != 0) {
        std::fprintf(stderr, "FAIL: ldmatrix row address %p is not 16-byte aligned (a GPU faults)\n", (const void*)p);
        std::exit(1);
    }
    ldsm_rows[me] = p;
    fiber::sync();
    const int warp = me / 32 * 32, g = (me % 32) / 4, t = me % 4;
    auto M = [&](int j, int row, int col) { return (uint32_t)ldsm_rows[warp + 8 * j + row][col]; };
    uint32_t out[4];
    for (int j = 0; j < 4; ++j) {
        out[j] = trans ? M(j, 2 * t, g) | M(j, 2 * t + 1, g) << 16 : M(j, g, 2 * t) | M(j, g, 2 * t + 1) << 16;
    }
    fiber::sync();  // every lane has read the rows before any posts new ones
    std::memcpy(r, out, sizeof out);
}
static void ldsm_x4(uint32_t r[4], const uint16_t* p) { ldsm(r, p, false); }
static void ldsm_x4_t(uint32_t r[4], const uint16_t* p) { ldsm(r, p, true); }

#include "attention.cu"

using Kernel = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, const uint32_t*, int, int,
                        float);

struct Case {
    int d;
    Kernel kernel;
    std::vector<uint32_t> starts;
    int heads, kv_heads, tokens;
    std::vector<uint16_t> q, k, v;
};

static std::vector<uint16_t> run(const Case& c) {
    std::vector<uint16_t> out((size_t)c.tokens * c.heads * c.d, 0xffff);  // NaN: unwritten
    int longest = 0;
    for (size_t s = 0; s + 1 < c.starts.size(); ++s) longest = std::max(longest, (int)(c.starts[s + 1] - c.starts[s]));
    gridDim = {(unsigned)c.heads, (unsigned)(c.starts.size() - 1), (unsigned)((longest + ROWS - 1) / ROWS)};
    const float scale_log2 = (float)(1.0 / std::sqrt((double)c.d) * M_LOG2E);
    for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
            for (unsigned x = 0; x < gridDim.x; ++x) {
                blockIdx = {x, y, z};
                fiber::run([&] {
                    c.kernel(c.q.data(), c.k.data(), c.v.data(), out.data(), c.starts.data(), c.heads, c.kv_heads,
                             scale_log2);
                });
            }
    return out;
}

// Attention in f64 on the bf16 inputs.
static std::vector<double> reference(const Case& c) {
    std::vector<double> out((size_t)c.tokens * c.heads * c.d);
    const int group = c.heads / c.kv_heads;
    for (size_t s = 0; s + 1 < c.starts.size(); ++s) {
        const int start = c.starts[s], len = c.starts[s + 1] - start;
        for (int h = 0; h < c.heads; ++h) {
            const int kvh = h / group;
            for (int i = 0; i < len; ++i) {
                std::vector<double> w(i + 1);
                double mx = -INFINITY;
                for (int j = 0; j <= i; ++j) {
                    double dot = 0;
                    for (int e = 0; e < c.d; ++e)
                        dot += (double)bf16_to_f32(c.q[((size_t)(start + i) * c.heads + h) * c.d + e]) *
                               bf16_to_f32(c.k[((size_t)(start + j) * c.kv_heads + kvh) * c.d + e]);
                    w[j] = dot / std::sqrt((double)c.d);
                    mx = std::max(mx, w[j]);
                }
                double sum = 0;
                for (int j = 0; j <= i; ++j) sum += (w[j] = std::exp(w[j] - mx));
                for (int e = 0; e < c.d; ++e) {
                    double acc = 0;
                    for (int j = 0; j <= i; ++j)
                        acc += w[j] * bf16_to_f32(c.v[((size_t)(start + j) * c.kv_heads + kvh) * c.d + e]);
                    out[((size_t)(start + i) * c.heads + h) * c.d + e] = acc / sum;
                }
            }
        }
    }
    return out;
}

int main() {
    const std::vector<int> lens = {1, 17, 64, 65, 150};
    const struct {
        int d;
        const char* name;
        Kernel kernel;
    } dims[] = {
        {16, "plain", causal_bf16_d16},      {32, "plain", causal_bf16_d32},
        {64, "plain", causal_bf16_d64},      {128, "plain", causal_bf16_d128},
        {16, "ldsm", causal_bf16_ldsm_d16},  {32, "ldsm", causal_bf16_ldsm_d32},
        {64, "ldsm", causal_bf16_ldsm_d64},  {128, "ldsm", causal_bf16_ldsm_d128},
    };
    int failures = 0;
    for (const auto& dim : dims) {
        Case c{dim.d, dim.kernel, {0}, 4, 2, 0, {}, {}, {}};
        for (int l : lens) c.starts.push_back(c.starts.back() + l);
        c.tokens = c.starts.back();
        std::mt19937 rng(dim.d);
        std::normal_distribution<float> normal(0.f, 1.f);
        auto fill = [&](std::vector<uint16_t>& x, size_t n, float scale) {
            x.resize(n);
            for (auto& e : x) e = f32_to_bf16(normal(rng) * scale);
        };
        // Queries scaled up so some rows attend sharply (a wrong key then shows).
        fill(c.q, (size_t)c.tokens * c.heads * c.d, 2.f);
        fill(c.k, (size_t)c.tokens * c.kv_heads * c.d, 1.f);
        fill(c.v, (size_t)c.tokens * c.kv_heads * c.d, 1.f);

        const auto got = run(c);
        const auto want = reference(c);
        double worst = 0;
        size_t bad = 0;
        for (size_t i = 0; i < got.size(); ++i) {
            const double g = bf16_to_f32(got[i]);
            const double err = std::isnan(g) ? INFINITY : std::fabs(g - want[i]);
            worst = std::max(worst, err);
            bad += !(err <= 0.02);
        }
        std::printf("d=%d %s: largest error %.5f against f64 over %zu outputs, %zu over 0.02\n", dim.d, dim.name,
                    worst, got.size(), bad);
        failures += bad != 0;
        // The two ways of loading fragments give the same fragments: the same bits out.
        static std::vector<uint16_t> plain_out[129];
        if (std::strcmp(dim.name, "plain") == 0) {
            plain_out[dim.d] = got;
        } else {
            size_t differ = 0;
            for (size_t i = 0; i < got.size(); ++i) differ += got[i] != plain_out[dim.d][i];
            std::printf("d=%d %s: %zu outputs differ from plain's\n", dim.d, dim.name, differ);
            failures += differ != 0 || plain_out[dim.d].size() != got.size();
        }

        // Token 100 of the 150-token sequence (the last), then token 5 of the 17-token one.
        for (const auto [seq, pos] : {std::pair{4, 100}, std::pair{1, 5}}) {
            Case p = c;
            const int at = c.starts[seq] + pos;
            for (int h = 0; h < c.kv_heads; ++h)
                for (int e = 0; e < c.d; ++e) {
                    const size_t i = ((size_t)at * c.kv_heads + h) * c.d + e;
                    p.k[i] = f32_to_bf16(bf16_to_f32(c.k[i]) * 8.f);
                    p.v[i] = f32_to_bf16(50.f);
                }
            const auto moved = run(p);
            size_t wrong = 0, same_row = 0;
            for (int tok = 0; tok < c.tokens; ++tok) {
                const bool may_change = tok >= at && tok < (int)c.starts[seq + 1];
                for (size_t e = 0; e < (size_t)c.heads * c.d; ++e) {
                    const size_t i = (size_t)tok * c.heads * c.d + e;
                    if (!may_change && moved[i] != got[i]) ++wrong;
                    if (tok == at && moved[i] == got[i]) ++same_row;
                }
            }
            std::printf("d=%d %s: token %d of sequence %d made large: %zu outputs it must not reach changed; "
                        "%zu of its own row unchanged\n",
                        dim.d, dim.name, pos, seq, wrong, same_row);
            failures += wrong != 0 || same_row == (size_t)c.heads * c.d;
        }
    }
    if (failures) {
        std::printf("FAIL: %d checks\n", failures);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
