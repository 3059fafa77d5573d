// freight's expert-parallel kernels: dispatch and combine between the ranks of one host,
// each writing straight into its peers' workspaces through CUDA IPC mappings (NVLink
// where the GPUs have it). Compiled by NVRTC at run time; no headers needed.
//
// Every rank owns one workspace with the same layout (see `Shape` and layout.rs): one
// block per rank s, holding everything rank s writes here, so that a rank writes into
// one block of each peer (or, through the engine, into a local copy of that block which
// the host then ships):
//
//   signals            4 words: dispatch arrived / released, combine arrived / released
//   dispatch rows      M rows of `row_bytes`: row i is the i-th token rank s sent here
//   dispatch meta      M records: the token's index at s, and for each of its top-k
//                      choices the local expert (or -1) and the weight
//   combine rows       M rows: row t is what rank s sends back for our token t
//
// Signalling is by epochs, so nothing is ever reset. Each rank counts its dispatches and
// combines in device memory (`epochs[0]`, `epochs[1]`: the last one completed), so that
// no launch carries a value from the host and a captured CUDA graph replays correctly.
// A sender writes a peer's rows, makes
// them visible system-wide, then stores the epoch (and, for dispatch, the row count and
// whether the rows are fp8) into the peer's "arrived" word; a receiver that has consumed what a sender wrote stores the
// epoch into the sender's "released" word, and a sender waits for the previous epoch's
// release before it writes again. The last block of a launch to finish sends the signals
// (a counter per kernel decides which block is last).
//
// Waits poll with a deadline and also watch an abort word in host memory (raised by the
// host when a peer is known dead); a wait that gives up records why in the status word
// (host memory) and the kernel returns: the host turns it into an error. Kernels check
// for an earlier failure in a device-memory copy of that word: a read of host memory
// crosses PCIe, and thousands of them (one per thread) cost milliseconds.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

struct Shape {
    u64 row_bytes;   // one token: hidden x 2 bytes (bf16), a multiple of 16
    u64 meta_bytes;  // one dispatch meta record, a multiple of 16
    u64 block_bytes; // one rank's block of the workspace
    u64 off_drows;   // offsets within a block
    u64 off_dmeta;
    u64 off_crows;
    int ranks;       // R
    int me;
    int max_tokens;  // M: tokens per rank and call, at most
    int topk;        // K
    int local_experts;
    int pad;
};

struct Control {
    u64* status;            // host memory: 0, or why a kernel gave up
    const u64* abort;       // host memory: non-zero once a peer is known dead
    u64* input;             // host memory: 0, or what was wrong with the caller's input
    u64* failed;            // device memory: the status word's copy that kernels check
    u64 timeout_ns;
};

// Signal words, by kind.
#define DISPATCH_ARRIVED 0
#define DISPATCH_RELEASED 1
#define COMBINE_ARRIVED 2
#define COMBINE_RELEASED 3

// Status codes (top byte of the status word); the next byte says which wait, the low
// bits which rank or token.
#define STATUS_TIMEOUT 1ull
#define STATUS_ABORTED 2ull
#define STATUS_BAD_EXPERT 3ull
#define STATUS_DUPLICATE_EXPERT 4ull
#define STATUS_FORMAT_MISMATCH 5ull

// In a dispatch "arrived" word's row count: the rows are fp8 (values and scales), not
// bf16. Ranks must agree; a receiver that decoded rows in the other format would hand
// out garbage.
#define FP8_ROWS 0x80000000u

// Where in a workspace the words, rows and records written by rank `src` are.
__device__ __forceinline__ u64 signal_offset(const Shape& s, int kind, int src) {
    return (u64)src * s.block_bytes + (u64)kind * 8;
}

__device__ __forceinline__ char* dispatch_row(const char* ws, const Shape& s, int src, u64 i) {
    return (char*)ws + (u64)src * s.block_bytes + s.off_drows + i * s.row_bytes;
}

__device__ __forceinline__ char* dispatch_meta(const char* ws, const Shape& s, int src, u64 i) {
    return (char*)ws + (u64)src * s.block_bytes + s.off_dmeta + i * s.meta_bytes;
}

__device__ __forceinline__ char* combine_row(const char* ws, const Shape& s, int src, u64 t) {
    return (char*)ws + (u64)src * s.block_bytes + s.off_crows + t * s.row_bytes;
}

__device__ __forceinline__ u64 load_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void fail(const Control& c, u64 code, u64 what, u64 value) {
    const u64 word = (code << 56) | (what << 48) | (value & 0xffffffffffffull);
    if (atomicCAS(c.failed, 0ull, word) == 0) *(volatile u64*)c.status = word;
}

__device__ __forceinline__ bool failed(const Control& c) { return *(volatile u64*)c.failed != 0; }

// failed(c) as thread 0 of the block read it, for a kernel that is about to reach a barrier:
// a failure recorded by another block while this one's threads each read the word could
// send some of them home and leave the others waiting at the barrier.
__device__ bool block_failed(const Control& c) {
    __shared__ int seen;
    if (threadIdx.x == 0) seen = failed(c);
    __syncthreads();
    return seen;
}

// Whether epoch `v >> shift` has reached `want`, by their signed distance: a dispatch
// "arrived" word keeps only the epoch's low 32 bits (the row count takes the rest), so a
// plain >= would wait forever once 2^32 dispatches wrapped it. Ranks are never more than
// an epoch apart, so the distance is always small.
__device__ __forceinline__ bool reached(u64 v, int shift, u64 want) {
    return shift == 32 ? (int)((u32)(v >> 32) - (u32)want) >= 0 : (i64)(v - want) >= 0;
}

// Waits until `*word >> shift` reaches `want`; returns the word, or ~0 after recording
// why it gave up (`what` names the wait, `rank` the peer it waited for).
__device__ u64 wait_for(const u64* word, int shift, u64 want, const Control& c, u64 what, int rank) {
    u64 v = load_acquire(word);
    if (reached(v, shift, want)) return v;
    const u64 start = now_ns();
    for (u32 spins = 0;; ++spins) {
        v = load_acquire(word);
        if (reached(v, shift, want)) return v;
        if ((spins & 255) == 0) {
            if (*(volatile const u64*)c.abort != 0) {
                fail(c, STATUS_ABORTED, what, *(volatile const u64*)c.abort - 1);
                return ~0ull;
            }
            if (failed(c)) return ~0ull;  // another block gave up
            if (now_ns() - start > c.timeout_ns) {
                fail(c, STATUS_TIMEOUT, what, rank);
                return ~0ull;
            }
        }
    }
}

// Threads below R each wait for one peer's word; true when every wait succeeded.
__device__ bool wait_all(const char* signals, const Shape& s, int kind, int shift, u64 want, const Control& c,
                         u64* values) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < s.ranks; r += blockDim.x) {
        u64 v = wait_for((const u64*)(signals + signal_offset(s, kind, r)), shift, want, c, kind, r);
        if (v == ~0ull) failed = 1;
        if (values) values[r] = v;
    }
    __syncthreads();
    return !failed;
}

// True in every thread of the block that finishes last among the launch's blocks (each
// block's writes are made visible system-wide first). Resets the counter for the next
// launch, which the stream orders after this one.
__device__ bool last_block(u32* done) {
    __shared__ int last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1u) == gridDim.x - 1;
        if (last) *done = 0;
    }
    __syncthreads();
    if (last) __threadfence_system();
    return last;
}

// Every peer's `kind` word for us := value (threads below R, one peer each).
__device__ void signal_all(const u64* peers, const Shape& s, int kind, const u64* values, u64 value) {
    for (int r = threadIdx.x; r < s.ranks; r += blockDim.x)
        store_release((u64*)(peers[r] + signal_offset(s, kind, s.me)), values ? values[r] : value);
}

// Rows are cut into segments of SEGMENT_VECTORS 16-byte vectors (2 KiB), and each warp
// takes (row, segment) items in turn, so that a few hundred rows still spread over
// every SM; each lane holds VECTORS_PER_LANE vectors of a segment and issues all of a
// segment's loads before its first store or sum.
#define VECTORS_PER_LANE 4
#define SEGMENT_VECTORS (32 * VECTORS_PER_LANE)

__device__ __forceinline__ int segments_of(u64 row_bytes) {
    return (int)((row_bytes / 16 + SEGMENT_VECTORS - 1) / SEGMENT_VECTORS);
}

// Loads this lane's vectors of segment `seg` of a row (those past the row's end stay
// unloaded, and are not stored by store_segment either).
__device__ __forceinline__ void load_segment(int4* v, const char* row, u64 row_bytes, int seg, int lane) {
    const int4* src = (const int4*)row;
    const u64 n = row_bytes / 16;
#pragma unroll
    for (int j = 0; j < VECTORS_PER_LANE; ++j) {
        const u64 i = (u64)seg * SEGMENT_VECTORS + j * 32 + lane;
        if (i < n) v[j] = __ldg(src + i);
    }
}

__device__ __forceinline__ void store_segment(char* row, const int4* v, u64 row_bytes, int seg, int lane) {
    int4* dst = (int4*)row;
    const u64 n = row_bytes / 16;
#pragma unroll
    for (int j = 0; j < VECTORS_PER_LANE; ++j) {
        const u64 i = (u64)seg * SEGMENT_VECTORS + j * 32 + lane;
        if (i < n) dst[i] = v[j];
    }
}

// store_segment into a row split in two places: its first `head_bytes` at `head`, the
// rest at `tail` (fp8 tokens: the values, then their scales).
__device__ __forceinline__ void store_split(char* head, u64 head_bytes, char* tail, const int4* v, u64 row_bytes,
                                            int seg, int lane) {
    const u64 n = row_bytes / 16, split = head_bytes / 16;
#pragma unroll
    for (int j = 0; j < VECTORS_PER_LANE; ++j) {
        const u64 i = (u64)seg * SEGMENT_VECTORS + j * 32 + lane;
        if (i < split) ((int4*)head)[i] = v[j];
        else if (i < n) ((int4*)tail)[i - split] = v[j];
    }
}

__device__ __forceinline__ float bf16_to_float(u32 bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ u32 float_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN stays a NaN
    return (u + 0x7fff + ((u >> 16) & 1)) >> 16;       // round to nearest even
}

__device__ __forceinline__ void accumulate(float* acc, int4 v, float w) {
    const u32 words[4] = {(u32)v.x, (u32)v.y, (u32)v.z, (u32)v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc[2 * j] += w * bf16_to_float(words[j] & 0xffff);
        acc[2 * j + 1] += w * bf16_to_float(words[j] >> 16);
    }
}

__device__ __forceinline__ int4 pack(const float* acc) {
    u32 words[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) words[j] = float_to_bf16(acc[2 * j]) | (float_to_bf16(acc[2 * j + 1]) << 16);
    return make_int4(words[0], words[1], words[2], words[3]);
}

// acc[j] += w x (this lane's vector j of segment `seg` of `row`), as floats.
__device__ __forceinline__ void accumulate_segment(float (*acc)[8], const char* row, float w, const Shape& s,
                                                   int seg, int lane, bool cached) {
    const int4* src = (const int4*)row;
    const u64 n = s.row_bytes / 16;
    int4 v[VECTORS_PER_LANE];
#pragma unroll
    for (int j = 0; j < VECTORS_PER_LANE; ++j) {
        const u64 i = (u64)seg * SEGMENT_VECTORS + j * 32 + lane;
        if (i < n) v[j] = cached ? __ldg(src + i) : src[i];
    }
#pragma unroll
    for (int j = 0; j < VECTORS_PER_LANE; ++j)
        if ((u64)seg * SEGMENT_VECTORS + j * 32 + lane < n) accumulate(acc[j], v[j], w);
}

__device__ __forceinline__ void store_sums(char* row, float (*acc)[8], const Shape& s, int seg, int lane) {
    int4 v[VECTORS_PER_LANE];
#pragma unroll
    for (int j = 0; j < VECTORS_PER_LANE; ++j) v[j] = pack(acc[j]);
    store_segment(row, v, s.row_bytes, seg, lane);
}

__device__ __forceinline__ int* meta_expert(char* meta) { return (int*)(meta + 4); }
__device__ __forceinline__ float* meta_weight(char* meta, int topk) { return (float*)(meta + 4 + 4 * topk); }

// Block-wide exclusive scan of one flag per thread, in thread order; `*total` gets the
// sum. Every thread of the block must call it.
__device__ int scan_flags(int flag, int* total) {
    __shared__ int warp_base[32];
    __shared__ int sum;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) warp_base[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
            const int n = warp_base[w];
            warp_base[w] = run;
            run += n;
        }
        sum = run;
    }
    __syncthreads();
    const int out = warp_base[warp] + __popc(ballot & ((1u << lane) - 1));
    *total = sum;
    __syncthreads();
    return out;
}

// fp8 (e4m3) encoding of a float already scaled into [-448, 448]: round to nearest even,
// saturating (written out because NVRTC has no fp8 header without the toolkit).
__device__ __forceinline__ u32 to_e4m3(float f) {
    const u32 sign = (__float_as_uint(f) >> 24) & 0x80;
    if (isnan(f)) return sign | 0x7f;  // before the clamp, which would make it 448
    const float a = fminf(fabsf(f), 448.0f);
    if (a < 0.015625f) return sign | __float2uint_rn(a * 512.0f);  // subnormals: steps of 2^-9
    int e;
    const float m = frexpf(a, &e);  // a = m x 2^e, m in [0.5, 1)
    u32 mant = __float2uint_rn((m * 2.0f - 1.0f) * 8.0f);
    int exp = e - 1 + 7;
    if (mant == 8) {
        mant = 0;
        exp += 1;
    }
    if (exp > 15 || (exp == 15 && mant > 6)) {
        exp = 15;
        mant = 6;
    }
    return sign | ((u32)exp << 3) | mant;
}

// fp8 tokens with a scale per 128 channels: each warp takes (token, group of 128
// channels) items; lane i encodes channels 4i..4i+3 after the warp agrees on the group's
// largest magnitude. Row t of `packed` is the token's hidden fp8 values, then its
// hidden / 128 float scales (value = fp8 x scale).
extern "C" __global__ void __launch_bounds__(512, 1)
ep_quantize_fp8(const char* x, int tokens, Shape s, char* packed) {
    const int hidden = (int)(s.row_bytes / 2), groups = hidden / 128;
    const u64 packed_bytes = (u64)hidden + groups * 4;
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (i64 q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < (i64)tokens * groups; q += warps) {
        const int t = (int)(q / groups), g = (int)(q % groups);
        const uint2 raw = *(const uint2*)(x + (u64)t * s.row_bytes + (u64)(g * 128 + lane * 4) * 2);
        float v[4] = {bf16_to_float(raw.x & 0xffff), bf16_to_float(raw.x >> 16), bf16_to_float(raw.y & 0xffff),
                      bf16_to_float(raw.y >> 16)};
        // fmaxf passes over a NaN, so the group's other channels keep a scale of their own;
        // the NaN itself stays a NaN (to_e4m3).
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        u32 word = 0;
        for (int j = 0; j < 4; ++j) word |= to_e4m3(v[j] / scale) << (8 * j);
        char* row = packed + (u64)t * packed_bytes;
        *(u32*)(row + g * 128 + lane * 4) = word;
        if (lane == 0) *(float*)(row + hidden + g * 4) = scale;
    }
}

// Up to this many choices per token, the layout keeps a token's choices in registers:
// all its loads are in flight at once, and the duplicate check reads no memory.
#define LAYOUT_REGS 8

// One token's part of the layout, for topk <= LAYOUT_REGS: counts its choices of this
// block's experts and returns whether it has any; the block that checks the token
// reports a bad or repeated expert.
__device__ __forceinline__ int layout_token_in_registers(const i64* choices, int t, int r, int E, const Shape& s,
                                                         int* counts, const Control& c) {
    i64 e[LAYOUT_REGS];
#pragma unroll
    for (int k = 0; k < LAYOUT_REGS; ++k) e[k] = k < s.topk ? choices[k] : -1;
    int flag = 0;
    const bool checks = t % s.ranks == r;  // each token is checked by one block
#pragma unroll
    for (int k = 0; k < LAYOUT_REGS; ++k) {
        if (k >= s.topk) break;
        if (checks) {
            if (e[k] < -1 || e[k] >= E) atomicCAS(c.input, 0ull, (STATUS_BAD_EXPERT << 56) | (u64)t);
#pragma unroll
            for (int j = 0; j < k; ++j)
                if (e[k] >= 0 && e[j] == e[k]) atomicCAS(c.input, 0ull, (STATUS_DUPLICATE_EXPERT << 56) | (u64)t);
        }
        if (e[k] >= 0 && e[k] < E && e[k] / s.local_experts == r) {
            flag = 1;
            atomicAdd(&counts[e[k] - (i64)r * s.local_experts], 1);
        }
    }
    return flag;
}

// Layout: one block per destination rank r. slot[t][r] = the row token t takes among
// those this rank sends to r (in token order), or -1; send_count[r] = how many;
// expert_count[e] = tokens that chose global expert e. The blocks also check the indices:
// a bad one is reported in the input word and otherwise ignored, so that every rank
// still goes through the same steps (the caller raises once the dispatch is complete).
extern "C" __global__ void __launch_bounds__(1024)
ep_layout(const i64* topk_idx, int tokens, Shape s, int* slot, int* send_count, int* expert_count, Control c) {
    // This block's experts are its own: counted in shared memory, written once.
    __shared__ int counts[1024];
    const int r = blockIdx.x, E = s.ranks * s.local_experts;
    for (int e = threadIdx.x; e < s.local_experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    int base = 0;
    for (int start = 0; start < tokens; start += blockDim.x) {
        const int t = start + threadIdx.x;
        int flag = 0;
        if (t < tokens && s.topk <= LAYOUT_REGS) {
            flag = layout_token_in_registers(topk_idx + (i64)t * s.topk, t, r, E, s, counts, c);
        } else if (t < tokens) {
            const bool checks = t % s.ranks == r;  // each token is checked by one block
            for (int k = 0; k < s.topk; ++k) {
                const i64 e = topk_idx[(i64)t * s.topk + k];
                if (checks) {
                    if (e < -1 || e >= E) atomicCAS(c.input, 0ull, (STATUS_BAD_EXPERT << 56) | (u64)t);
                    for (int j = 0; j < k; ++j)
                        if (e >= 0 && topk_idx[(i64)t * s.topk + j] == e)
                            atomicCAS(c.input, 0ull, (STATUS_DUPLICATE_EXPERT << 56) | (u64)t);
                }
                if (e >= 0 && e < E && e / s.local_experts == r) {
                    flag = 1;
                    atomicAdd(&counts[e - (i64)r * s.local_experts], 1);
                }
            }
        }
        int total;
        const int pos = scan_flags(flag, &total);
        if (t < tokens) slot[(i64)t * s.ranks + r] = flag ? base + pos : -1;
        base += total;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < s.local_experts; e += blockDim.x) expert_count[r * s.local_experts + e] = counts[e];
    if (threadIdx.x == 0) send_count[r] = base;
}

// Dispatch, sending side: each warp takes (token, segment) items in turn, loads the
// segment once and writes it into the rows of every rank that owns one of the token's
// experts (the segment-0 warp also writes the token's meta record there); the last block
// tells every rank how many rows it got.
extern "C" __global__ void __launch_bounds__(512, 1)
ep_dispatch_send(const char* x, u64 x_row_bytes, const i64* topk_idx, const float* topk_weights, const int* slot,
                 int tokens, Shape s, const u64* peers, const u64* epochs, const int* send_count, u32* done,
                 Control c) {
    if (block_failed(c)) return;
    const u64 epoch = epochs[0] + 1;
    const char* own = (const char*)peers[s.me];
    if (!wait_all(own, s, DISPATCH_RELEASED, 0, epoch - 1, c, 0)) return;
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const int segments = segments_of(x_row_bytes);
    const i64 items = (i64)tokens * segments;
    for (i64 q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < items; q += warps) {
        const int t = (int)(q / segments), seg = (int)(q % segments);
        int4 v[VECTORS_PER_LANE];
        load_segment(v, x + (u64)t * x_row_bytes, x_row_bytes, seg, lane);
        for (int r = 0; r < s.ranks; ++r) {
            const int row = slot[(i64)t * s.ranks + r];
            if (row < 0) continue;
            char* peer = (char*)peers[r];
            store_segment(dispatch_row(peer, s, s.me, row), v, x_row_bytes, seg, lane);
            if (seg != 0) continue;
            char* meta = dispatch_meta(peer, s, s.me, row);
            if (lane == 0) *(int*)meta = t;
            const i64* choices = topk_idx + (i64)t * s.topk;
            for (int k = lane; k < s.topk; k += 32) {
                const i64 e = choices[k];
                bool here = e >= 0 && e / s.local_experts == r;
                // A repeat of an earlier choice is dropped (ep_layout reported it), so that
                // the expert gets the token once and combine adds its output once.
                for (int j = 0; j < k && here; ++j) here = choices[j] != e;
                meta_expert(meta)[k] = here ? (int)(e % s.local_experts) : -1;
                meta_weight(meta, s.topk)[k] = here ? topk_weights[(i64)t * s.topk + k] : 0.0f;
            }
        }
    }
    if (last_block(done) && !failed(c)) {
        for (int r = threadIdx.x; r < s.ranks; r += blockDim.x)
            store_release((u64*)(peers[r] + signal_offset(s, DISPATCH_ARRIVED, s.me)),
                          (epoch << 32) | (u32)send_count[r] | (x_row_bytes != s.row_bytes ? FP8_ROWS : 0u));
    }
}

// Dispatch, receiving side, first pass: one block per local expert e waits until every
// rank's rows are in, then numbers the rows that chose e, in (source rank, row) order:
// expert_pos[e][row] (or -1), expert_count[e]. Unless `host_counts` is null (low-latency
// mode), the counts per source rank and per expert also go to host memory, for the host
// to size its outputs.
extern "C" __global__ void __launch_bounds__(1024)
ep_dispatch_plan(Shape s, const char* own, const u64* epochs, int* recv_count, int* expert_pos, int* expert_count,
                 int* host_counts, u64 x_row_bytes, Control c) {
    __shared__ u64 arrived[1024];
    if (block_failed(c)) return;
    const u64 epoch = epochs[0] + 1;
    if (!wait_all(own, s, DISPATCH_ARRIVED, 32, epoch, c, arrived)) return;
    // Rows of another format than this rank's (`x_row_bytes`, as it sent them) are
    // refused, not expanded: every block sees the same words and leaves together.
    const u32 format = x_row_bytes != s.row_bytes ? FP8_ROWS : 0u;
    for (int src = 0; src < s.ranks; ++src) {
        if (((u32)arrived[src] & FP8_ROWS) != format) {
            if (threadIdx.x == 0) fail(c, STATUS_FORMAT_MISMATCH, DISPATCH_ARRIVED, src);
            return;
        }
    }
    const int e = blockIdx.x;
    const u64 rows = (u64)s.ranks * s.max_tokens;
    int base = 0;
    for (int src = 0; src < s.ranks; ++src) {
        const int count = (int)((u32)arrived[src] & ~FP8_ROWS);
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            recv_count[src] = count;
            if (host_counts) host_counts[src] = count;
        }
        for (int start = 0; start < count; start += blockDim.x) {
            const int i = start + threadIdx.x;
            const u64 row = (u64)src * s.max_tokens + i;
            int flag = 0;
            if (i < count) {
                char* meta = dispatch_meta(own, s, src, i);
                for (int k = 0; k < s.topk; ++k) flag |= meta_expert(meta)[k] == e;
            }
            int total;
            const int pos = scan_flags(flag, &total);
            if (i < count) expert_pos[e * rows + row] = flag ? base + pos : -1;
            base += total;
        }
    }
    if (threadIdx.x == 0) {
        expert_count[e] = base;
        if (host_counts) host_counts[s.ranks + e] = base;
    }
}

// Dispatch, receiving side, second pass: each warp takes (received row, segment) items
// and copies the segment to the output row of every local expert that chose the row (each expert's rows in (source
// rank, row) order; experts one after the other, or `expert_stride` rows apart in
// low-latency mode); records what combine needs to send each row back, and how many
// rows came (`received_out`); the last block releases the rows to their senders.
extern "C" __global__ void __launch_bounds__(512, 1)
ep_dispatch_expand(Shape s, const u64* peers, u64* epochs, const int* recv_count, const int* expert_pos,
                   const int* expert_count, u64 expert_stride, u64 x_row_bytes, u64 head_bytes, char* recv_x,
                   char* recv_tail, int* recv_expert, float* recv_weight, int* row_pairs, int* row_source,
                   int* received_out, u32* done, Control c) {
    __shared__ int source_start[1025];
    __shared__ int expert_start[1025];
    if (block_failed(c)) return;
    const u64 epoch = epochs[0] + 1;
    if (threadIdx.x == 0) {
        source_start[0] = 0;
        for (int r = 0; r < s.ranks; ++r) source_start[r + 1] = source_start[r] + recv_count[r];
        expert_start[0] = 0;
        for (int e = 0; e < s.local_experts; ++e)
            expert_start[e + 1] = expert_stride ? (int)((e + 1) * expert_stride) : expert_start[e] + expert_count[e];
        if (blockIdx.x == 0) *received_out = source_start[s.ranks];
    }
    __syncthreads();
    const char* own = (const char*)peers[s.me];
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const int received = source_start[s.ranks];
    const u64 rows = (u64)s.ranks * s.max_tokens;
    const int segments = segments_of(x_row_bytes);
    const u64 tail_bytes = x_row_bytes - head_bytes;
    for (i64 q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < (i64)received * segments; q += warps) {
        const int u = (int)(q / segments), seg = (int)(q % segments);
        int src = 0;
        while (source_start[src + 1] <= u) ++src;
        const u64 i = u - source_start[src], row = (u64)src * s.max_tokens + i;
        char* meta = dispatch_meta(own, s, src, i);
        int4 v[VECTORS_PER_LANE];
        load_segment(v, dispatch_row(own, s, src, i), x_row_bytes, seg, lane);
        if (seg == 0 && lane == 0) {
            row_source[2 * u] = src;
            row_source[2 * u + 1] = *(int*)meta;
        }
        for (int k = 0; k < s.topk; ++k) {
            const int e = meta_expert(meta)[k];
            // A record is a peer's writing: an expert out of range would index past the
            // tables, so it is taken for no choice.
            if (e < 0 || e >= s.local_experts) {
                if (seg == 0 && lane == 0) row_pairs[(i64)u * s.topk + k] = -1;
                continue;
            }
            const int p = expert_start[e] + expert_pos[e * rows + row];
            store_split(recv_x + (u64)p * head_bytes, head_bytes, recv_tail + (u64)p * tail_bytes, v, x_row_bytes, seg,
                        lane);
            if (seg == 0 && lane == 0) {
                row_pairs[(i64)u * s.topk + k] = p;
                if (recv_expert) recv_expert[p] = e;
                recv_weight[p] = meta_weight(meta, s.topk)[k];
            }
        }
    }
    if (last_block(done) && !failed(c)) {
        signal_all(peers, s, DISPATCH_RELEASED, 0, epoch);
        if (threadIdx.x == 0) epochs[0] = epoch;
    }
}

// Combine, expert side: each warp takes (received row, segment) items, sums the row's
// experts' outputs with their weights (fp32), and writes the sum into the row its source
// keeps for us; the
// last block tells every rank that our rows are in.
extern "C" __global__ void __launch_bounds__(512, 1)
ep_combine_send(Shape s, const u64* peers, const char* expert_out, const float* weights, const int* row_pairs,
                const int* row_source, const int* received_rows, const u64* epochs, u32* done, Control c) {
    if (block_failed(c)) return;
    const u64 epoch = epochs[1] + 1;
    const int received = *received_rows;
    if (!wait_all((const char*)peers[s.me], s, COMBINE_RELEASED, 0, epoch - 1, c, 0)) return;
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const int segments = segments_of(s.row_bytes);
    for (i64 q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < (i64)received * segments; q += warps) {
        const int u = (int)(q / segments), seg = (int)(q % segments);
        const int src = row_source[2 * u], token = row_source[2 * u + 1];
        // Lane k holds choice k's output row and weight (topk <= 32).
        const int mine = lane < s.topk ? row_pairs[(i64)u * s.topk + lane] : -1;
        const float my_weight = mine >= 0 ? weights[mine] : 0.0f;
        const u32 present = __ballot_sync(0xffffffffu, mine >= 0);
        float acc[VECTORS_PER_LANE][8] = {};
        for (u32 left = present; left; left &= left - 1) {
            const int k = __ffs(left) - 1;
            const int p = __shfl_sync(0xffffffffu, mine, k);
            const float w = __shfl_sync(0xffffffffu, my_weight, k);
            accumulate_segment(acc, expert_out + (u64)p * s.row_bytes, w, s, seg, lane, true);
        }
        store_sums(combine_row((const char*)peers[src], s, s.me, token), acc, s, seg, lane);
    }
    if (last_block(done) && !failed(c)) signal_all(peers, s, COMBINE_ARRIVED, 0, epoch);
}

// Combine, source side: once every rank's rows are in, each warp takes (token, segment)
// items and sums the rows the token's ranks sent back, in rank order (so results do not depend on
// timing); the last block releases the rows.
extern "C" __global__ void __launch_bounds__(512, 1)
ep_combine_reduce(Shape s, const u64* peers, const int* slot, int tokens, char* out, u64* epochs, u32* done,
                  Control c) {
    if (block_failed(c)) return;
    const u64 epoch = epochs[1] + 1;
    const char* own = (const char*)peers[s.me];
    if (!wait_all(own, s, COMBINE_ARRIVED, 0, epoch, c, 0)) return;
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const int segments = segments_of(s.row_bytes);
    for (i64 q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < (i64)tokens * segments; q += warps) {
        const int t = (int)(q / segments), seg = (int)(q % segments);
        float acc[VECTORS_PER_LANE][8] = {};
        for (int base = 0; base < s.ranks; base += 32) {
            const int d = base + lane;
            const u32 sent = __ballot_sync(0xffffffffu, d < s.ranks && slot[(i64)t * s.ranks + d] >= 0);
            for (u32 left = sent; left; left &= left - 1) {
                const int from = base + __ffs(left) - 1;
                // Written by peers during this kernel's wait: not through the read-only cache.
                accumulate_segment(acc, combine_row(own, s, from, t), 1.0f, s, seg,
                                   lane, false);
            }
        }
        store_sums(out + (u64)t * s.row_bytes, acc, s, seg, lane);
    }
    if (last_block(done) && !failed(c)) {
        signal_all(peers, s, COMBINE_RELEASED, 0, epoch);
        if (threadIdx.x == 0) epochs[1] = epoch;
    }
}
