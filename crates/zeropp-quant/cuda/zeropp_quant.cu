// zeropp-quant's GPU kernels. Every result is bit-identical to the CPU scalar
// kernels (src/simd/scalar.rs, src/core.rs): the same f32 formulas in the same
// order, every float operation written with an explicit round-to-nearest
// intrinsic (`__fmul_rn`, `__fadd_rn`, ...) so that neither NVRTC nor the
// driver's PTX JIT can contract a multiply and an add into an FMA (PTX never
// fuses `.rn`-qualified instructions), and compiled with `--fmad=false` on top.
//
// Compiled by `cargo xtask ptx` with NVRTC (no host code, no #include): the
// checked-in zeropp_quant.ptx and the sm_80 / sm_90 cubins next to this file are
// its outputs. Edit this file, then run `cargo xtask ptx`. emulate.cpp compiles
// this same file for the CPU (threads for a block), so that the kernels' results
// are checked against the Rust CPU kernels on machines without a GPU too.
//
// Layout: the quantized outputs are written straight into the wire layout
// (src/wire.rs): the host writes the 32-byte header, the kernels write the
// per-group scales (`1/s`), offsets (asymmetric only) and the packed data.
//
// One thread block per group (blocks loop over groups when there are more than
// the grid): the block reduces the group's max (or min and max), thread 0
// computes `s`, `1/s` and the offset with the CPU's formulas, and the block then
// rounds the group's elements while they are still in L1/L2.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define ZQ_BLOCK 256
#define ZQ_FLT_MAX 3.40282346638528859812e+38f

// One quantized input of the fused kernel and of dequantization, pointing into
// a wire buffer on the device. Matches `cuda::InDesc` in src/cuda/mod.rs.
struct InDesc {
    const u8* data;
    const float* scales;
    const float* offsets;  // null for the symmetric scheme
    u32 group_size;
    u32 bits;  // 4 or 8
};

// ---- the counter-based RNG of src/rng.rs ----------------------------------

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u32 lowbias32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

// The uniform in [0, 1) of element `i` (rng::keys + scalar::uniform).
__device__ __forceinline__ float uniform(u64 seed, u64 i) {
    const u64 z = splitmix64(seed ^ splitmix64(i >> 32));
    const u32 k1 = (u32)z;
    const u32 k2 = (u32)(z >> 32);
    const u32 h = lowbias32(lowbias32((u32)i ^ k1) ^ k2);
    // A 24-bit integer and a power of two: both steps are exact.
    return __fmul_rn(__uint2float_rn(h >> 8), 1.0f / 16777216.0f);
}

// ---- element sources -------------------------------------------------------

__device__ __forceinline__ bool finite(float v) { return fabsf(v) <= ZQ_FLT_MAX; }

struct SrcF32 {
    const float* x;
    __device__ __forceinline__ float operator()(u64 i) const { return x[i]; }
};

// bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
struct SrcBf16 {
    const u16* x;
    __device__ __forceinline__ float operator()(u64 i) const { return __uint_as_float((u32)x[i] << 16); }
};

// f16 -> f32 is exact (subnormals included); `half`'s conversion on the CPU too.
struct SrcF16 {
    const u16* x;
    __device__ __forceinline__ float operator()(u64 i) const {
#ifdef ZQ_HOST_EMULATION
        return zq_host_f16_to_f32(x[i]);  // emulate.cpp: the CPU test of this file
#else
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x[i]));
        return f;
#endif
    }
};

// The quantized integer of element `i` (core::q_at).
__device__ __forceinline__ int q_at(u32 bits, const u8* data, u64 i) {
    if (bits == 4) {
        const u8 b = data[i >> 1];
        return (i & 1) == 0 ? ((int)(signed char)b >> 4) : ((int)(signed char)(u8)(b << 4) >> 4);
    }
    return (int)(signed char)data[i];
}

// `f32::from(q) * scale + offset`, unfused (scalar::dequant).
__device__ __forceinline__ float deq(const InDesc& d, u64 i) {
    // 32-bit division when the index fits (always, below 4 Gi elements): a
    // 64-bit division is several times the instructions, per input, per element.
    const u64 g = i <= 0xFFFFFFFFull ? (u64)((u32)i / d.group_size) : i / d.group_size;
    const float off = d.offsets ? d.offsets[g] : 0.0f;
    return __fadd_rn(__fmul_rn((float)q_at(d.bits, d.data, i), d.scales[g]), off);
}

// The f32 sum of `k` dequantized inputs in input order, from 0.0 (SumSource).
struct SrcSum {
    const InDesc* in;
    u32 k;
    __device__ __forceinline__ float operator()(u64 i) const {
        float acc = 0.0f;
        for (u32 j = 0; j < k; ++j) acc = __fadd_rn(acc, deq(in[j], i));
        return acc;
    }
};

// ---- block reductions ------------------------------------------------------

__device__ __forceinline__ float block_max(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) sh[w] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < (blockDim.x >> 5) ? sh[threadIdx.x] : -ZQ_FLT_MAX;
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    __syncthreads();
    return v;  // valid in thread 0
}

// ---- quantization ----------------------------------------------------------

struct GroupParams {
    float s;
    float offset;
};

// core::params: DeepSpeed's formulas in f32, with the CPU's guards.
__device__ GroupParams params(u32 bits, bool asym, float amax, float lo, float hi) {
    GroupParams p;
    if (!asym) {
        const float half = bits == 4 ? 8.0f : 128.0f;
        float s = amax == 0.0f ? 1.0f : __fdiv_rn(half, amax);
        p.s = fminf(s, ZQ_FLT_MAX);
        p.offset = 0.0f;
    } else {
        lo = __fadd_rn(lo, 0.0f);  // -0.0 -> +0.0
        hi = __fadd_rn(hi, 0.0f);
        const float full = bits == 4 ? 16.0f : 256.0f;
        const float range = __fsub_rn(hi, lo);
        float s;
        if (hi == lo) {
            s = 1.0f;
        } else if (finite(range)) {
            s = __fdiv_rn(full, range);
        } else {
            s = __double2float_rn(__ddiv_rn((double)full, __dsub_rn((double)hi, (double)lo)));
        }
        p.s = fminf(s, ZQ_FLT_MAX);
        const float sum = __fadd_rn(hi, lo);
        p.offset = finite(sum) ? __fdiv_rn(sum, 2.0f) : __fadd_rn(__fdiv_rn(hi, 2.0f), __fdiv_rn(lo, 2.0f));
    }
    return p;
}

struct QuantArgs {
    u64 len;
    u32 gs;
    u32 bits;
    u32 asym;
    u32 stochastic;
    u64 seed;
    u32 atomic_pack;  // INT4 with an odd group size: bytes are shared by two groups
    u32 propagate;    // NonFinite::Propagate: a group holding NaN or ±Inf is poisoned
    float* scales;
    float* offsets;
    u8* data;
    u64* bad;  // atomicMin of the first non-finite index (starts at u64::MAX)
};

// The canonical quiet NaN a poisoned group stores as its scale (and offset):
// wire::POISON_BITS.
#define ZQ_POISON_BITS 0x7FC00000u

// A poisoned group's parameters (core::GroupParams::POISON): `s` NaN.
__device__ __forceinline__ bool is_poison(GroupParams p) { return p.s != p.s; }

// scalar::round_nearest / round_stochastic for one element; 0 in a poisoned group.
__device__ __forceinline__ int round_one(const QuantArgs& a, GroupParams p, float v, u64 i) {
    if (is_poison(p)) return 0;
    const float y = __fmul_rn(__fsub_rn(v, p.offset), p.s);
    float r;
    if (a.stochastic) {
        const float f = floorf(y);
        const float frac = __fsub_rn(y, f);
        r = uniform(a.seed, i) < frac ? __fadd_rn(f, 1.0f) : f;
    } else {
        r = rintf(y);  // round half to even
    }
    const float qmin = a.bits == 4 ? -8.0f : -128.0f;
    const float qmax = a.bits == 4 ? 7.0f : 127.0f;
    return (int)fminf(fmaxf(r, qmin), qmax);
}

template <class Src>
__device__ void quantize_groups(const Src& src, const QuantArgs& a) {
    __shared__ float sh_a[32];
    __shared__ float sh_b[32];
    __shared__ GroupParams sh_p;
    __shared__ int sh_nonfinite;  // some element of this group is NaN or ±Inf
    if (threadIdx.x == 0) sh_nonfinite = 0;
    __syncthreads();
    const u64 groups = (a.len + a.gs - 1) / a.gs;
    const bool asym = a.asym != 0;
    for (u64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const u64 start = g * a.gs;
        const u64 end = min(start + a.gs, a.len);
        // Pass 1: range statistics and the finiteness check.
        float m = 0.0f, nlo = -ZQ_FLT_MAX, hi = -ZQ_FLT_MAX;
        for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            const float v = src(i);
            if (!finite(v)) {
                atomicMin(a.bad, i);
                sh_nonfinite = 1;  // every writer stores the same value
            }
            m = fmaxf(m, fabsf(v));
            nlo = fmaxf(nlo, -v);  // min(x) = -max(-x): exact, one reduction kind
            hi = fmaxf(hi, v);
        }
        float lo = 0.0f;
        if (asym) {
            nlo = block_max(nlo, sh_a);
            hi = block_max(hi, sh_b);
            lo = -nlo;
        } else {
            m = block_max(m, sh_a);
        }
        // block_max's barriers order every thread's pass 1 (and its write of
        // sh_nonfinite) before thread 0 reads here; thread 0 clears the flag
        // before the barrier below, so before any thread starts the next group.
        if (threadIdx.x == 0) {
            GroupParams p;
            if (a.propagate && sh_nonfinite) {
                p.s = __uint_as_float(ZQ_POISON_BITS);
                p.offset = p.s;
                a.scales[g] = p.s;
                if (asym) a.offsets[g] = p.s;
            } else {
                p = params(a.bits, asym, m, lo, hi);
                a.scales[g] = __fdiv_rn(1.0f, p.s);
                if (asym) a.offsets[g] = p.offset;
            }
            sh_nonfinite = 0;
            sh_p = p;
        }
        __syncthreads();
        const GroupParams p = sh_p;
        // Pass 2: round (the group is in L1/L2 now) and pack.
        if (a.bits == 8) {
            for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
                a.data[i] = (u8)(signed char)round_one(a, p, src(i), i);
            }
        } else {
            const u64 b1 = (end + 1) >> 1;
            for (u64 b = (start >> 1) + threadIdx.x; b < b1; b += blockDim.x) {
                const u64 e0 = b << 1;
                const u64 e1 = e0 + 1;
                u32 byte = 0;
                if (e0 >= start) byte |= ((u32)round_one(a, p, src(e0), e0) & 0xFu) << 4;
                if (e1 < end) byte |= (u32)round_one(a, p, src(e1), e1) & 0xFu;
                if (a.atomic_pack) {
                    // The data region is zeroed first and 4-byte aligned (wire
                    // offset 32 + 4G or 32 + 8G), so OR-ing each group's nibbles
                    // into the word is exact whatever the order.
                    u32* word = (u32*)(a.data + (b & ~(u64)3));
                    atomicOr(word, byte << (8 * (u32)(b & 3)));
                } else {
                    a.data[b] = (u8)byte;
                }
            }
        }
        __syncthreads();  // sh_p and the reduction scratch are reused by the next group
    }
}

#define ZQ_QUANT_ARGS                                                                                   \
    u64 len, u32 gs, u32 bits, u32 asym, u32 stochastic, u64 seed, u32 atomic_pack, u32 propagate, \
        float *scales, float *offsets, u8 *data, u64 *bad
#define ZQ_QUANT_INIT {len, gs, bits, asym, stochastic, seed, atomic_pack, propagate, scales, offsets, data, bad}

extern "C" __global__ void __launch_bounds__(ZQ_BLOCK) zq_quantize_f32(const float* x, ZQ_QUANT_ARGS) {
    const QuantArgs a = ZQ_QUANT_INIT;
    quantize_groups(SrcF32{x}, a);
}

extern "C" __global__ void __launch_bounds__(ZQ_BLOCK) zq_quantize_bf16(const u16* x, ZQ_QUANT_ARGS) {
    const QuantArgs a = ZQ_QUANT_INIT;
    quantize_groups(SrcBf16{x}, a);
}

extern "C" __global__ void __launch_bounds__(ZQ_BLOCK) zq_quantize_f16(const u16* x, ZQ_QUANT_ARGS) {
    const QuantArgs a = ZQ_QUANT_INIT;
    quantize_groups(SrcF16{x}, a);
}

// The fused qgZ kernel: dequantize `k` inputs, sum in f32, requantize.
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK)
    zq_reduce_quantize(const InDesc* in, u32 k, ZQ_QUANT_ARGS) {
    const QuantArgs a = ZQ_QUANT_INIT;
    quantize_groups(SrcSum{in, k}, a);
}

// The value of element `i` (for the NonFinite error, which names it).
extern "C" __global__ void zq_value_f32(const float* x, u64 i, float* out) { *out = SrcF32{x}(i); }
extern "C" __global__ void zq_value_bf16(const u16* x, u64 i, float* out) { *out = SrcBf16{x}(i); }
extern "C" __global__ void zq_value_f16(const u16* x, u64 i, float* out) { *out = SrcF16{x}(i); }
extern "C" __global__ void zq_value_sum(const InDesc* in, u32 k, u64 i, float* out) { *out = SrcSum{in, k}(i); }

// ---- dequantization ----------------------------------------------------------

// out[i] = q·scale + offset (add == 0) or out[i] += q·scale + offset (add != 0).
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK)
    zq_dequant(const u8* data, const float* scales, const float* offsets, u32 gs, u32 bits, u64 len,
               float* out, u32 add) {
    const u64 groups = (len + gs - 1) / gs;
    for (u64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const u64 start = g * gs;
        const u64 end = min(start + gs, len);
        const float scale = scales[g];
        const float off = offsets ? offsets[g] : 0.0f;
        for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            const float v = __fadd_rn(__fmul_rn((float)q_at(bits, data, i), scale), off);
            out[i] = add ? __fadd_rn(out[i], v) : v;
        }
    }
}

// ---- element-wise helpers of zeropp-comm's device collectives ----------------
// Grid-stride loops over `n` elements; every float op is an explicit _rn
// intrinsic, so the results equal the CPU's (Rust's `+=`, `/=`, half's bf16).

// acc[i] += x[i] (f32), the reduce-scatter's and all-reduce's sum.
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK) zq_add_f32(const float* x, u64 n, float* acc) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)blockDim.x * gridDim.x) {
        acc[i] = __fadd_rn(acc[i], x[i]);
    }
}

// acc[i] += f32(x[i]) for bf16 x (exact widening), the bf16 baseline's sum.
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK) zq_add_bf16(const u16* x, u64 n, float* acc) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)blockDim.x * gridDim.x) {
        acc[i] = __fadd_rn(acc[i], SrcBf16{x}(i));
    }
}

// x[i] /= by (correctly rounded), the mean.
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK) zq_div_f32(float* x, u64 n, float by) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)blockDim.x * gridDim.x) {
        x[i] = __fdiv_rn(x[i], by);
    }
}

// out[i] = bf16(x[i]), round to nearest even, NaN kept quiet with its sign:
// bit for bit `half::bf16::from_f32`.
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK) zq_to_bf16(const float* x, u64 n, u16* out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)blockDim.x * gridDim.x) {
        const u32 b = __float_as_uint(x[i]);
        u32 r;
        if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
            r = (b >> 16) | 0x0040u;
        } else if ((b & 0x8000u) != 0 && (b & 0x17FFFu) != 0) {
            r = (b >> 16) + 1;
        } else {
            r = b >> 16;
        }
        out[i] = (u16)r;
    }
}

// qgZ error feedback (LoCo): r = beta·r + k·(c − d) with k = 1 − beta computed by
// the caller, in Rust's evaluation order: (beta·r) + (k·(c − d)).
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK)
    zq_feedback(const float* c, const float* d, float* r, u64 n, float beta, float k) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)blockDim.x * gridDim.x) {
        r[i] = __fadd_rn(__fmul_rn(beta, r[i]), __fmul_rn(k, __fsub_rn(c[i], d[i])));
    }
}

// ---- the randomized Hadamard rotation (src/hadamard.rs) ----------------------

// Bit (p mod 32) of sign word p/32: hadamard.rs's SignStream (keys from the
// seed, domain-separated, and the word's high bits; one lowbias32 hash per word).
__device__ __forceinline__ u32 hadamard_sign(u64 seed, u64 p) {
    const u64 w = p >> 5;
    const u64 z = splitmix64((seed ^ 0x484144414D415244ull) ^ splitmix64(w >> 32));  // "HADAMARD"
    const u32 k1 = (u32)z;
    const u32 k2 = (u32)(z >> 32);
    return (lowbias32(lowbias32((u32)w ^ k1) ^ k2) >> (u32)(p & 31)) & 1u;
}

// Flips the sign of v when bit is 1 (an exact xor of the sign bit).
__device__ __forceinline__ float hadamard_flip(float v, u32 bit) {
    return __uint_as_float(__float_as_uint(v) ^ (bit << 31));
}

// Rotates every whole group of `g` (a power of two) of the `n` floats at `x`
// in place, one block per group, x[0] at stream position `pos`; a partial last
// group is left as it is. Forward: flip, butterfly stages h = 1, 2, ..., g/2
// ((a, b) -> (a + b, a - b)), multiply by `scale`; inverse (`inverse` != 0):
// the stages, the scale, then the flip. Each butterfly is one _rn add or
// subtract on the same pair as the CPU's, stage by stage: bit-identical.
extern "C" __global__ void __launch_bounds__(ZQ_BLOCK)
    zq_hadamard(float* x, u64 n, u32 g, u64 pos, u64 seed, float scale, u32 inverse) {
    const u64 groups = n / g;
    for (u64 k = blockIdx.x; k < groups; k += gridDim.x) {
        float* y = x + k * g;
        const u64 p0 = pos + k * g;
        if (!inverse) {
            for (u32 i = threadIdx.x; i < g; i += blockDim.x) y[i] = hadamard_flip(y[i], hadamard_sign(seed, p0 + i));
        }
        __syncthreads();
        for (u32 h = 1; h < g; h <<= 1) {
            for (u32 t = threadIdx.x; t < g / 2; t += blockDim.x) {
                const u32 j = (t / h) * 2 * h + (t % h);
                const float a = y[j];
                const float b = y[j + h];
                y[j] = __fadd_rn(a, b);
                y[j + h] = __fsub_rn(a, b);
            }
            __syncthreads();
        }
        for (u32 i = threadIdx.x; i < g; i += blockDim.x) {
            const float v = __fmul_rn(y[i], scale);
            y[i] = inverse ? hadamard_flip(v, hadamard_sign(seed, p0 + i)) : v;
        }
        __syncthreads();
    }
}
