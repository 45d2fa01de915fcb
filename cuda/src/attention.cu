// The target's causal attention in one kernel, forward only (the target is frozen): queries
// against keys and values in bf16, the scores kept in registers with the running softmax of
// FlashAttention-2 (Dao, 2023), never written to memory. The target's bf16 forward materialised
// every block of scores (write, mask, softmax, read again); transformers' default (sdpa) does not,
// and that was most of the distance between them on an H200 (BENCHMARKS.md).
//
// Compiled to PTX that the driver JITs when the module is loaded, so no build needs nvcc.
// Regenerate attention.ptx after a change (from cuda/src; scripts/cuda-toolkit.sh fetches nvcc):
//   nvcc -ptx -arch=compute_80 -o attention.ptx attention.cu
// then put the source's digest on its first line (cuda's tests compare it with this file):
//   sed -i "1i // source sha256 $(sha256sum attention.cu | cut -c1-64)" attention.ptx
// compute_80: mma.sync on bf16 needs sm_80 (A100) or newer; nvcc 13 writes PTX ISA 9.0, which
// drivers for CUDA 13 read, as the bindings hspipe is built with require anyway.
//
// Layout: q [T, heads, D], k and v [T, kv_heads, D], out [T, heads, D], all contiguous bf16, the
// batch's sequences one after another; sequence s is rows starts[s]..starts[s + 1]. Query head h
// reads kv head h / (heads / kv_heads) (grouped-query attention; no copy of k or v per head).
//
// Work: one block of 4 warps per (head, sequence, 64 queries); each warp owns 16 query rows.
// Keys and values go through shared memory 64 rows at a time; a block stops at the tile holding
// its last query (causal), and masks only that tile. The grid's z (which the hardware hands out
// last) counts query tiles from the end, so every head's and sequence's longest blocks (the
// last in their sequence) start first and the short ones fill in behind them.
//
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4 * g + t:
//   A 16x16 row-major, 4 registers of 2 bf16: a0 (row g, cols 2t, 2t+1), a1 (row g + 8, same),
//     a2 (row g, cols 8 + 2t, 9 + 2t), a3 (row g + 8, same); the lower column in the low half.
//   B 16x8 (k x n), 2 registers: b0 (k 2t, 2t+1; n g), b1 (k 8 + 2t, 9 + 2t; n g).
//   C 16x8 f32, 4 values: c0, c1 (row g, cols 2t, 2t + 1), c2, c3 (row g + 8, same).
// So a score tile's C fragments, packed to bf16, are the A fragments of P for P x V with no
// exchange between lanes, and each lane holds two query rows (g and g + 8) whose softmax state it
// shares with the three other lanes of its group (reduced with shuffles over lanes t).

#include <stdint.h>

namespace {

constexpr int ROWS = 64;   // queries per block (16 per warp)
constexpr int KEYS = 64;   // keys per tile
constexpr int THREADS = 128;

}  // namespace

#ifdef __CUDACC__
#include <cuda_bf16.h>

namespace {

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory (ldmatrix .x4): lanes 8j..8j+7 give the addresses of
// matrix j's rows (16 bytes each), and lane 4 * g + t receives in r[j] matrix j's row g, columns
// 2t and 2t + 1 (the lower in the low half): an mma fragment's layout. `_t` (.trans) gives row
// 2t and 2t + 1 of column g instead: the fragment of the transposed matrix.
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const uint16_t* p) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const uint16_t* p) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Two floats as bf16 (rounded to nearest even), `lo` in the low half (the lower column).
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace
#endif
// Without nvcc, the includer (attention_host.cpp, cuda's CPU test of this file) defines
// mma_bf16, ldsm_x4, ldsm_x4_t, pack, the shuffle, the barrier and the thread indices.

namespace {

// Two bf16 bit patterns as one register, `lo` in the low half.
__device__ __forceinline__ uint32_t pair(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16);
}

// LDSM: the K and V fragments come from shared memory by ldmatrix, four registers an
// instruction (V's transposed on the way); without it, by 4-byte loads for K and 2-byte ones for
// V, four instructions and two packs for each product's V fragment. Both are built: the loader
// prefers LDSM and keeps the other where LDSM's self-check does not pass.
template <int D, bool LDSM>
__device__ __forceinline__ void causal(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                       const uint16_t* __restrict__ v, uint16_t* __restrict__ out,
                                       const uint32_t* __restrict__ starts, int heads, int kv_heads,
                                       float scale_log2) {
    static_assert(D % 16 == 0, "head dim a multiple of 16");
    // Shared rows padded by 8 elements (16 bytes): the fragment reads below then hit 32
    // different banks.
    constexpr int S = D + 8;
    __shared__ __align__(16) uint16_t ks[KEYS * S];
    __shared__ __align__(16) uint16_t vs[KEYS * S];

    const int h = blockIdx.x;
    const int seq = blockIdx.y;
    const int start = (int)starts[seq];
    const int len = (int)starts[seq + 1] - start;
    const int tile = (int)(gridDim.z - 1 - blockIdx.z);
    const int q0 = tile * ROWS;
    if (q0 >= len) {
        return;
    }
    const int kvh = h / (heads / kv_heads);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    // This lane's two query rows, as positions in the sequence.
    const int r0 = q0 + warp * 16 + g;
    const int r1 = r0 + 8;

    // The warp's 16 queries as A fragments, for the whole loop (rows past the sequence are 0).
    uint32_t qa[D / 16][4];
    {
        const uint32_t* q0p = reinterpret_cast<const uint32_t*>(q + ((size_t)(start + r0) * heads + h) * D);
        const uint32_t* q1p = reinterpret_cast<const uint32_t*>(q + ((size_t)(start + r1) * heads + h) * D);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int c = (kk * 16 + 2 * t) / 2;  // in pairs
            qa[kk][0] = r0 < len ? q0p[c] : 0u;
            qa[kk][1] = r1 < len ? q1p[c] : 0u;
            qa[kk][2] = r0 < len ? q0p[c + 4] : 0u;
            qa[kk][3] = r1 < len ? q1p[c + 4] : 0u;
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    }
    // Running max (log2 units) and this lane's part of the running sum, for rows r0 and r1.
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    // Keys up to the block's last query: tiles 0..=tile (ROWS == KEYS).
    const int tiles = tile + 1;
    for (int kt = 0; kt < tiles; ++kt) {
        const int k0 = kt * KEYS;
        __syncthreads();  // every warp is done with the previous tile
        constexpr int VECS = D / 8;  // 16-byte vectors per row
        for (int i = threadIdx.x; i < KEYS * VECS; i += THREADS) {
            const int r = i / VECS;
            const int c = (i % VECS) * 8;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
            if (k0 + r < len) {
                const size_t at = ((size_t)(start + k0 + r) * kv_heads + kvh) * D + c;
                kx = *reinterpret_cast<const uint4*>(k + at);
                vx = *reinterpret_cast<const uint4*>(v + at);
            }
            *reinterpret_cast<uint4*>(&ks[r * S + c]) = kx;
            *reinterpret_cast<uint4*>(&vs[r * S + c]) = vx;
        }
        __syncthreads();

        // Scores: 16 rows x 64 keys, as 8 C fragments of 8 keys.
        float s[KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        }
        if constexpr (LDSM) {
            // Two key blocks at once: matrices (keys n, dims kk lo), (n, kk hi), (n + 1, kk lo),
            // (n + 1, kk hi), lane 8j + i giving key row i of matrix j.
            const int row = (lane / 16) * 8 + lane % 8;
            const int col = ((lane / 8) % 2) * 8;
#pragma unroll
            for (int n = 0; n < KEYS / 8; n += 2) {
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    uint32_t b[4];
                    ldsm_x4(b, &ks[(n * 8 + row) * S + kk * 16 + col]);
                    mma_bf16(s[n], qa[kk], b[0], b[1]);
                    mma_bf16(s[n + 1], qa[kk], b[2], b[3]);
                }
            }
        } else {
#pragma unroll
            for (int n = 0; n < KEYS / 8; ++n) {
                const uint16_t* kp = &ks[(n * 8 + g) * S + 2 * t];
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kp + kk * 16);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kp + kk * 16 + 8);
                    mma_bf16(s[n], qa[kk], b0, b1);
                }
            }
        }
        // Scaled to log2 units; in the last tile, keys after a row's query, or past the
        // sequence, are -inf (earlier tiles end before the block's first query).
        const bool last = kt == tiles - 1;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float x = s[n][j] * scale_log2;
                if (last) {
                    const int key = k0 + n * 8 + 2 * t + (j & 1);
                    const int row = j < 2 ? r0 : r1;
                    if (key > row || key >= len) {
                        x = -INFINITY;
                    }
                }
                s[n][j] = x;
            }
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        // Every row sees key 0 in tile 0, so its max is finite from there on; the guards keep a
        // row with nothing seen yet at 0 rather than NaN (-inf - -inf).
        const float b0 = n0 == -INFINITY ? 0.f : n0;
        const float b1 = n1 == -INFINITY ? 0.f : n1;
        const float a0 = exp2f(m0 - b0), a1 = exp2f(m1 - b1);
        m0 = n0;
        m1 = n1;
        l0 *= a0;
        l1 *= a1;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            o[i][0] *= a0;
            o[i][1] *= a0;
            o[i][2] *= a1;
            o[i][3] *= a1;
        }
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
            s[n][0] = exp2f(s[n][0] - b0);
            s[n][1] = exp2f(s[n][1] - b0);
            s[n][2] = exp2f(s[n][2] - b1);
            s[n][3] = exp2f(s[n][3] - b1);
            l0 += s[n][0] + s[n][1];
            l1 += s[n][2] + s[n][3];
        }

        // out += P x V, 16 keys at a time: P's A fragment is two score fragments packed.
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk) {
            const uint32_t pa[4] = {
                pack(s[2 * kk][0], s[2 * kk][1]),
                pack(s[2 * kk][2], s[2 * kk][3]),
                pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                pack(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
            if constexpr (LDSM) {
                // Two dim blocks at once, transposed: matrices (keys kk lo, dims i),
                // (kk hi, i), (kk lo, i + 1), (kk hi, i + 1), lane 8j + i' giving key row i'.
                const uint16_t* vp = &vs[(kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S + (lane / 16) * 8];
#pragma unroll
                for (int i = 0; i < D / 8; i += 2) {
                    uint32_t b[4];
                    ldsm_x4_t(b, vp + i * 8);
                    mma_bf16(o[i], pa, b[0], b[1]);
                    mma_bf16(o[i + 1], pa, b[2], b[3]);
                }
            } else {
                const uint16_t* vp = &vs[(kk * 16 + 2 * t) * S + g];
#pragma unroll
                for (int i = 0; i < D / 8; ++i) {
                    const uint16_t* c = vp + i * 8;
                    const uint32_t b0 = pair(c[0], c[S]);
                    const uint32_t b1 = pair(c[8 * S], c[9 * S]);
                    mma_bf16(o[i], pa, b0, b1);
                }
            }
        }
    }

    // The sums over the group's four lanes, then out = o / l.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    if (r0 < len) {
        uint32_t* p = reinterpret_cast<uint32_t*>(out + ((size_t)(start + r0) * heads + h) * D);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            p[(i * 8 + 2 * t) / 2] = pack(o[i][0] * i0, o[i][1] * i0);
        }
    }
    if (r1 < len) {
        uint32_t* p = reinterpret_cast<uint32_t*>(out + ((size_t)(start + r1) * heads + h) * D);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            p[(i * 8 + 2 * t) / 2] = pack(o[i][2] * i1, o[i][3] * i1);
        }
    }
}

}  // namespace

// Two kernels per head dim, `causal_bf16_d{D}` (plain loads) and `causal_bf16_ldsm_d{D}`, the
// latter at d = 128 held to three blocks an SM (65536 registers: at most 168 a thread; left
// free, ptxas gave it 171, which fits only two). Launch: grid (heads,
// sequences, ceil(longest / 64)), 128 threads, no dynamic shared memory; `starts` holds
// sequences + 1 offsets into the token rows; `scale_log2` is the softmax scale times log2(e).
#define CAUSAL_KERNEL(D, BOUNDS)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) causal_bf16_d##D(                          \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,                      \
        const uint32_t* starts, int heads, int kv_heads, float scale_log2) {                          \
        causal<D, false>(q, k, v, out, starts, heads, kv_heads, scale_log2);                          \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__ BOUNDS causal_bf16_ldsm_d##D(                       \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,                      \
        const uint32_t* starts, int heads, int kv_heads, float scale_log2) {                          \
        causal<D, true>(q, k, v, out, starts, heads, kv_heads, scale_log2);                           \
    }

CAUSAL_KERNEL(16, (THREADS))
CAUSAL_KERNEL(32, (THREADS))
CAUSAL_KERNEL(64, (THREADS))
CAUSAL_KERNEL(128, (THREADS, 3))
