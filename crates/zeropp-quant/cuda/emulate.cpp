// emulate.cpp: runs the CUDA kernels of zeropp_quant.cu on the CPU, so that the
// kernels' arithmetic, reductions and INT4 packing are checked against the Rust
// CPU kernels (tests/it/gpu_emu.rs) on machines without a GPU, CI included.
//
// The .cu file is compiled unchanged as C++20 (one #ifdef: the f16 conversion)
// with shims for the CUDA built-ins: a thread block of EMU_BLOCK = 256 fibers
// (8 warps, the launch size of the Rust side), scheduled so that a warp
// shuffle is a rendezvous of its warp and __syncthreads one of the whole block
// (so the cross-warp half of block_max runs as on hardware); a grid of
// ZQ_EMU_GRID blocks (default 3), run one after another in reverse order, so
// the grid-stride loops, the INT4 packing's atomicOr into words shared by
// groups of different blocks, and the atomicMin of the first non-finite index
// all run with several blocks, a later block's writes landing first; atomics
// through std::atomic_ref, and the _rn intrinsics as plain IEEE operations with
// FMA contraction off (-ffp-contract=off). What this cannot check: the real
// hardware's instructions (ptxas's code), truly concurrent blocks, launches
// and memory transfers.
//
// Protocol (stdin -> stdout, little-endian), one request per process:
//   u32 op = 1 quantize: u32 dtype (0 f32, 1 bf16, 2 f16), u64 len, OUT, input bytes
//   u32 op = 2 reduce:   u32 k, u64 len, k x (u32 gs, u32 bits, u32 asym, payload), OUT
//   u32 op = 3 dequant:  u64 len, u32 gs, u32 bits, u32 asym, payload, u32 add, f32 x len
//   OUT = u32 gs, u32 bits, u32 asym, u32 stochastic, u64 seed, u32 propagate
//   u32 op = 4 element-wise: u32 kind (0 add_f32, 1 add_bf16, 2 div_f32, 3 to_bf16,
//            4 feedback with beta = by), u64 n, f32 by, src (f32 x n, bf16 x n for
//            kind 1, none for kind 2, c then d: f32 x 2n for kind 4), acc f32 x n
//            (kinds 0-2, and the residual of kind 4)
//   u32 op = 5 hadamard: u64 n, u32 g, u64 pos, u64 seed, f32 scale, u32 inverse, f32 x n
//   reply to 1 and 2: u64 first non-finite index (or 2^64-1), the output payload
//   (scales, offsets, data: the wire layout after the header); to 3: f32 x len;
//   to 4: f32 x n (kinds 0-2) or bf16 x n (kind 3).
// Build: g++ -std=c++20 -O2 -ffp-contract=off -U_FORTIFY_SOURCE emulate.cpp -o zq-emulate

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <csetjmp>
#include <cstdlib>
#include <ucontext.h>
#include <vector>

#define ZQ_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

struct dim3 {
    unsigned x;
};

// 8 warps, as the Rust side launches (the kernels are valid for any multiple
// of 32 up to 1024 threads).
constexpr unsigned EMU_BLOCK = 256;
constexpr unsigned EMU_WARPS = EMU_BLOCK / 32;
dim3 threadIdx{0};
dim3 blockIdx{0};
const dim3 blockDim{EMU_BLOCK};
dim3 gridDim{1};

// The block's threads are fibers (ucontext) on one OS thread. A fiber runs
// until it reaches a barrier and records which: its warp's (a shuffle) or the
// block's (__syncthreads). The scheduler releases a warp when all of its live
// threads wait at a warp barrier, and the block when all of its live threads
// wait at __syncthreads; a round with nothing to run and nothing to release is
// a deadlock (a barrier not every thread reaches), reported as an error.
// ucontext starts each fiber; switches are _setjmp/_longjmp (no signal-mask
// system call per switch, which swapcontext makes).
enum Wait : unsigned char { RUN, WARP, BLOCK };
static ucontext_t g_sched_uc;
static ucontext_t g_fiber_uc[EMU_BLOCK];
static jmp_buf g_sched;
static jmp_buf g_fiber[EMU_BLOCK];
static float g_xchg[EMU_BLOCK];
static Wait g_wait[EMU_BLOCK];

static inline void barrier(Wait kind) {
    g_wait[threadIdx.x] = kind;
    if (!_setjmp(g_fiber[threadIdx.x])) _longjmp(g_sched, 1);
}

static inline void __syncthreads() { barrier(BLOCK); }

static inline float __shfl_xor_sync(unsigned, float v, int o) {
    const unsigned t = threadIdx.x;
    g_xchg[t] = v;
    barrier(WARP);
    const float r = g_xchg[(t & ~31u) | ((t & 31) ^ (unsigned)o)];
    barrier(WARP);
    return r;
}

static inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    std::atomic_ref<unsigned long long> a(*p);
    unsigned long long cur = a.load();
    while (v < cur && !a.compare_exchange_weak(cur, v)) {
    }
    return cur;
}

static inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }

static inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline float __double2float_rn(double d) { return (float)d; }
static inline float __uint2float_rn(unsigned u) { return (float)u; }
static inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float zq_host_f16_to_f32(unsigned short h) {
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}

#include "zeropp_quant.cu"

static const std::function<void()>* g_kernel;
static bool g_done[EMU_BLOCK];

static bool g_started[EMU_BLOCK];
static unsigned g_t;
static bool g_running;
static bool g_ran;

static void fiber_main(int t) {
    g_kernel[0]();
    g_done[t] = true;
    _longjmp(g_sched, 1);  // never resumed
}

// Releases the warps (and then the block) whose live threads all wait at a
// barrier of that kind; returns whether any thread was released.
static bool release() {
    bool any = false;
    for (unsigned w = 0; w < EMU_WARPS; ++w) {
        bool all = true, some = false;
        for (unsigned t = 32 * w; t < 32 * (w + 1); ++t) {
            if (g_done[t]) continue;
            some = true;
            all = all && g_wait[t] == WARP;
        }
        if (some && all) {
            for (unsigned t = 32 * w; t < 32 * (w + 1); ++t) g_wait[t] = RUN;
            any = true;
        }
    }
    bool all = true, some = false;
    for (unsigned t = 0; t < EMU_BLOCK; ++t) {
        if (g_done[t]) continue;
        some = true;
        all = all && g_wait[t] == BLOCK;
    }
    if (some && all) {
        for (unsigned t = 0; t < EMU_BLOCK; ++t) g_wait[t] = RUN;
        any = true;
    }
    return any;
}

// Runs `kernel` as block `blockIdx.x` of EMU_BLOCK threads.
static void launch_block(const std::function<void()>& kernel) {
    constexpr size_t STACK = 64 * 1024;
    static std::vector<char> stacks(EMU_BLOCK * STACK);
    g_kernel = &kernel;
    for (unsigned t = 0; t < EMU_BLOCK; ++t) {
        g_done[t] = false;
        g_started[t] = false;
        g_wait[t] = RUN;
        getcontext(&g_fiber_uc[t]);
        g_fiber_uc[t].uc_stack.ss_sp = stacks.data() + t * STACK;
        g_fiber_uc[t].uc_stack.ss_size = STACK;
        g_fiber_uc[t].uc_link = nullptr;
        makecontext(&g_fiber_uc[t], (void (*)())fiber_main, 1, (int)t);
    }
    // The loop state lives in globals: locals could be clobbered by _longjmp.
    for (g_running = true; g_running;) {
        g_ran = false;
        for (g_t = 0; g_t < EMU_BLOCK; ++g_t) {
            if (g_done[g_t] || g_wait[g_t] != RUN) continue;
            g_ran = true;
            threadIdx.x = g_t;
            if (!_setjmp(g_sched)) {
                if (g_started[g_t]) _longjmp(g_fiber[g_t], 1);
                g_started[g_t] = true;
                swapcontext(&g_sched_uc, &g_fiber_uc[g_t]);
            }
        }
        g_running = false;
        for (unsigned t = 0; t < EMU_BLOCK; ++t) g_running = g_running || !g_done[t];
        if (g_running && !release() && !g_ran) {
            std::fprintf(stderr, "zq-emulate: deadlock: a barrier that not every thread reaches\n");
            std::exit(3);
        }
    }
}

// Runs `kernel` as a grid of ZQ_EMU_GRID blocks (default 3), the last first.
static void launch(const std::function<void()>& kernel) {
    const char* env = std::getenv("ZQ_EMU_GRID");
    const long grid = env ? std::strtol(env, nullptr, 10) : 3;
    gridDim.x = grid > 0 && grid <= 64 ? (unsigned)grid : 3;
    for (unsigned b = gridDim.x; b-- > 0;) {
        blockIdx.x = b;
        launch_block(kernel);
    }
}

template <class T>
static T rd() {
    T v;
    if (std::fread(&v, sizeof v, 1, stdin) != 1) {
        std::fprintf(stderr, "zq-emulate: truncated request\n");
        std::exit(2);
    }
    return v;
}

static std::vector<u8> rd_bytes(size_t n) {
    std::vector<u8> v(n + 4);  // slack: never read, keeps empty buffers addressable
    if (n && std::fread(v.data(), 1, n, stdin) != n) {
        std::fprintf(stderr, "zq-emulate: truncated request\n");
        std::exit(2);
    }
    return v;
}

struct Layout {
    u64 groups, scales, offsets, data, total;  // byte offsets in the payload
};

static Layout layout(u64 len, u32 gs, u32 bits, u32 asym) {
    Layout l;
    l.groups = (len + gs - 1) / gs;
    l.scales = 0;
    l.offsets = 4 * l.groups;
    l.data = 4 * l.groups * (asym ? 2 : 1);
    l.total = l.data + (bits == 4 ? (len + 1) / 2 : len);
    return l;
}

struct Out {
    u32 gs, bits, asym, stochastic;
    u64 seed;
    u32 propagate;
};

static Out rd_out() {
    Out o;
    o.gs = rd<u32>();
    o.bits = rd<u32>();
    o.asym = rd<u32>();
    o.stochastic = rd<u32>();
    o.seed = rd<u64>();
    o.propagate = rd<u32>();
    return o;
}

// Allocates the output payload (zeroed, as the host zeroes it for packed ORs),
// runs `kernel(args)` and writes the reply.
template <class K>
static void quantize_reply(u64 len, const Out& o, K kernel) {
    const Layout l = layout(len, o.gs, o.bits, o.asym);
    std::vector<u8> out(l.total + 4, 0);
    u64 bad = ~0ull;
    float* scales = (float*)(out.data() + l.scales);
    float* offsets = o.asym ? (float*)(out.data() + l.offsets) : nullptr;
    u8* data = out.data() + l.data;
    const u32 atomic_pack = o.bits == 4 && o.gs % 2 == 1;
    if (len > 0) {
        launch([&] { kernel(len, o.gs, o.bits, o.asym, o.stochastic, o.seed, atomic_pack, o.propagate, scales, offsets, data, &bad); });
    }
    std::fwrite(&bad, 8, 1, stdout);
    std::fwrite(out.data(), 1, l.total, stdout);
}

int main() {
    const u32 op = rd<u32>();
    if (op == 1) {
        const u32 dtype = rd<u32>();
        const u64 len = rd<u64>();
        const Out o = rd_out();
        const auto x = rd_bytes(len * (dtype == 0 ? 4 : 2));
        quantize_reply(len, o, [&](auto... a) {
            if (dtype == 0) zq_quantize_f32((const float*)x.data(), a...);
            else if (dtype == 1) zq_quantize_bf16((const u16*)x.data(), a...);
            else zq_quantize_f16((const u16*)x.data(), a...);
        });
    } else if (op == 2) {
        const u32 k = rd<u32>();
        const u64 len = rd<u64>();
        std::vector<std::vector<u8>> bodies;
        std::vector<InDesc> in;
        for (u32 j = 0; j < k; ++j) {
            const u32 gs = rd<u32>(), bits = rd<u32>(), asym = rd<u32>();
            const Layout l = layout(len, gs, bits, asym);
            bodies.push_back(rd_bytes(l.total));
            const u8* b = bodies.back().data();
            in.push_back(InDesc{b + l.data, (const float*)(b + l.scales), asym ? (const float*)(b + l.offsets) : nullptr, gs, bits});
        }
        const Out o = rd_out();
        quantize_reply(len, o, [&](auto... a) { zq_reduce_quantize(in.data(), k, a...); });
    } else if (op == 3) {
        const u64 len = rd<u64>();
        const u32 gs = rd<u32>(), bits = rd<u32>(), asym = rd<u32>();
        const Layout l = layout(len, gs, bits, asym);
        const auto body = rd_bytes(l.total);
        const u32 add = rd<u32>();
        std::vector<float> acc(len + 1);
        if (len && std::fread(acc.data(), 4, len, stdin) != len) return 2;
        const u8* b = body.data();
        if (len > 0) {
            launch([&] {
                zq_dequant(b + l.data, (const float*)(b + l.scales), asym ? (const float*)(b + l.offsets) : nullptr, gs,
                           bits, len, acc.data(), add);
            });
        }
        std::fwrite(acc.data(), 4, len, stdout);
    } else if (op == 4) {
        const u32 kind = rd<u32>();
        const u64 n = rd<u64>();
        const float by = rd<float>();
        const auto src = rd_bytes(kind == 2 ? 0 : n * (kind == 1 ? 2 : kind == 4 ? 8 : 4));
        std::vector<float> acc(n + 1);
        if (kind != 3 && n && std::fread(acc.data(), 4, n, stdin) != n) return 2;
        std::vector<u16> out(n + 1);
        if (n > 0) {
            launch([&] {
                if (kind == 0) zq_add_f32((const float*)src.data(), n, acc.data());
                else if (kind == 1) zq_add_bf16((const u16*)src.data(), n, acc.data());
                else if (kind == 2) zq_div_f32(acc.data(), n, by);
                else if (kind == 4) {
                    const float* c = (const float*)src.data();
                    zq_feedback(c, c + n, acc.data(), n, by, 1.0f - by);
                }
                else zq_to_bf16((const float*)src.data(), n, out.data());
            });
        }
        if (kind == 3) std::fwrite(out.data(), 2, n, stdout);
        else std::fwrite(acc.data(), 4, n, stdout);
    } else if (op == 5) {
        const u64 n = rd<u64>();
        const u32 g = rd<u32>();
        const u64 pos = rd<u64>(), seed = rd<u64>();
        const float scale = rd<float>();
        const u32 inverse = rd<u32>();
        std::vector<float> x(n + 1);
        if (n && std::fread(x.data(), 4, n, stdin) != n) return 2;
        if (n >= g) launch([&] { zq_hadamard(x.data(), n, g, pos, seed, scale, inverse); });
        std::fwrite(x.data(), 4, n, stdout);
    } else {
        std::fprintf(stderr, "zq-emulate: unknown op %u\n", op);
        return 2;
    }
    return std::fflush(stdout) == 0 ? 0 : 1;
}
