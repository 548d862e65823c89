//! AVX2 kernels (x86-64). Each function mirrors its [`super::scalar`]
//! counterpart operation for operation (no FMA), so results are bit-identical.
//! Vector loops handle whole chunks; remainders go through the scalar code.
//! The reductions, rounding and dequantization are the shared bodies
//! (`super::vector`, `super::x86`) over the 8-lane vocabulary in [`lanes`].

use super::scalar;
use std::arch::x86_64::*;

x86_kernels! {
    feature: "avx2", width: 8, per_store: 4,
    load_store: [_mm256_loadu_ps, _mm256_storeu_ps],
    types: [__m256, __m256i],
    ops: [_mm256_add_epi32, _mm256_mullo_epi32, _mm256_set1_epi32, _mm256_srli_epi32, _mm256_xor_si256, _mm256_cvtepi32_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps, _mm256_min_ps, _mm256_max_ps, _mm256_set1_ps],
    lane_ids: _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    round_f(y): _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y),
    floor_f(y): _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(y),
    // Adds `1.0 & mask`: +0 in the other lanes (which only changes -0 to +0).
    add_one_if_lt(f, u, frac, one): _mm256_add_ps(f, _mm256_and_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(u, frac), one)),
    mask: [__m256, _mm256_castsi256_ps(_mm256_set1_epi32(-1))],
    abs_f(v): _mm256_andnot_ps(_mm256_set1_ps(-0.0), v),
    le_f(a, b): _mm256_cmp_ps::<_CMP_LE_OQ>(a, b),
    and_m(a, b): _mm256_and_ps(a, b),
    all_set(ok): _mm256_movemask_ps(ok) == 0xFF,
    horizontal: [super::hmax, super::hmin],
    accumulators: [4, 2],
    store: store32,
    deq: [_mm_loadl_epi64, _mm256_cvtepi8_epi32],
}

vector_fwht!("avx2");

/// Stores 8 words to `out[at..at + 8]`.
#[inline]
#[target_feature(enable = "avx2")]
fn store_u32(out: &mut [u32], at: usize, v: __m256i) {
    assert!(at + 8 <= out.len());
    // SAFETY: the assert keeps the 32-byte unaligned store in bounds.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(at).cast::<__m256i>(), v) }
}

/// Flips the sign of lane `k` where bit `k` of `bits` is set (an exact xor of
/// the sign bit).
#[inline]
#[target_feature(enable = "avx2")]
fn fwht_flip(v: __m256, bits: u32) -> __m256 {
    let ids = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits as i32), ids), ids);
    let sign = _mm256_and_si256(set, _mm256_set1_epi32(i32::MIN));
    _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), sign))
}

/// One butterfly stage inside a vector: `p` is `v` with each lane swapped for
/// its partner; lanes in `MASK` (the upper of each pair) take `p - v` (the
/// scalar `a - b`), the others `v + p` (`a + b`).
#[inline]
#[target_feature(enable = "avx2")]
fn fwht_stage<const MASK: i32>(v: __m256, p: __m256) -> __m256 {
    _mm256_blend_ps::<MASK>(_mm256_add_ps(v, p), _mm256_sub_ps(p, v))
}

/// The butterfly stages h = 1, 2, 4 inside one vector of 8 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn fwht_lanes(v: __m256) -> __m256 {
    let v = fwht_stage::<0b1010_1010>(v, _mm256_permute_ps::<0b10_11_00_01>(v));
    let v = fwht_stage::<0b1100_1100>(v, _mm256_permute_ps::<0b01_00_11_10>(v));
    fwht_stage::<0b1111_0000>(v, _mm256_permute2f128_ps::<0x01>(v, v))
}

/// Defines a horizontal reduction of 8 lanes with one 4-lane op and its
/// lowest-lane (`_ss`) form: halves, then quarters, then the last pair.
macro_rules! horizontal {
    ($(#[$doc:meta] $name:ident: $op:ident, $op_ss:ident;)*) => {$(
        #[$doc]
        #[inline]
        #[target_feature(enable = "avx2")]
        fn $name(v: __m256) -> f32 {
            let m = $op(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let m = $op(m, _mm_movehl_ps(m, m));
            let m = $op_ss(m, _mm_shuffle_ps::<0b01>(m, m));
            _mm_cvtss_f32(m)
        }
    )*};
}

horizontal! {
    /// Horizontal max of 8 lanes.
    hmax: _mm_max_ps, _mm_max_ss;
    /// Horizontal min of 8 lanes.
    hmin: _mm_min_ps, _mm_min_ss;
}

/// Packs four vectors of 8 clamped integral floats into 32 i8 at `out[at..]`.
#[inline]
#[target_feature(enable = "avx2")]
fn store32(r: [__m256; 4], out: &mut [u8], at: usize) {
    let i0 = _mm256_cvtps_epi32(r[0]);
    let i1 = _mm256_cvtps_epi32(r[1]);
    let i2 = _mm256_cvtps_epi32(r[2]);
    let i3 = _mm256_cvtps_epi32(r[3]);
    let p01 = _mm256_packs_epi32(i0, i1);
    let p23 = _mm256_packs_epi32(i2, i3);
    let p = _mm256_packs_epi16(p01, p23);
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    assert!(at + 32 <= out.len());
    // SAFETY: the assert keeps the 32-byte unaligned store in bounds.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(at).cast::<__m256i>(), p) }
}

/// Packs 32 bytes (16 pairs) of `q[at..]` into 16 nibble pairs (in 16-bit
/// lanes, one result byte per lane low byte): `(q[2k] << 4) | (q[2k+1] & 0xF)`.
#[inline]
#[target_feature(enable = "avx2")]
fn pack_pairs(q: &[u8], at: usize) -> __m256i {
    assert!(at + 32 <= q.len());
    // SAFETY: the assert keeps the 32-byte unaligned load in bounds.
    let v = unsafe { _mm256_loadu_si256(q.as_ptr().add(at).cast::<__m256i>()) };
    // Little endian: each 16-bit lane is `odd << 8 | even`.
    let hi = _mm256_and_si256(_mm256_slli_epi16::<4>(v), _mm256_set1_epi16(0x00F0));
    let lo = _mm256_and_si256(_mm256_srli_epi16::<8>(v), _mm256_set1_epi16(0x000F));
    _mm256_or_si256(hi, lo)
}

int4_entry_points!("avx2", pack: 32, unpack: 16);

/// Packs the 32 pairs of `q[2i..2i + 64]` into `out[i..i + 32]`.
#[inline]
#[target_feature(enable = "avx2")]
fn pack_block(q: &[u8], out: &mut [u8], i: usize) {
    let a = pack_pairs(q, 2 * i);
    let b = pack_pairs(q, 2 * i + 32);
    // Every lane is <= 0xFF, so the saturating pack is exact; it
    // interleaves 128-bit halves (a.lo, b.lo, a.hi, b.hi), undone by the
    // 64-bit permute.
    let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(a, b));
    assert!(i + 32 <= out.len());
    // SAFETY: the assert keeps the 32-byte unaligned store in bounds.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(i).cast::<__m256i>(), p) };
}

/// Unpacks `data[i..i + 16]` into `out[2i..2i + 32]`.
#[inline]
#[target_feature(enable = "avx2")]
fn unpack_block(data: &[u8], out: &mut [u8], i: usize) {
    assert!(i + 16 <= data.len());
    // SAFETY: the assert keeps the 16-byte unaligned load in bounds.
    let b = unsafe { _mm_loadu_si128(data.as_ptr().add(i).cast::<__m128i>()) };
    // One packed byte per 16-bit lane.
    let w = _mm256_cvtepu8_epi16(b);
    // Low nibble, sign-extended, into the lane's high byte (odd element).
    let odd = _mm256_srai_epi16::<4>(_mm256_slli_epi16::<12>(w));
    // High nibble, sign-extended, into the lane's low byte (even element).
    let even =
        _mm256_and_si256(_mm256_srai_epi16::<12>(_mm256_slli_epi16::<8>(w)), _mm256_set1_epi16(0x00FF));
    let r = _mm256_or_si256(odd, even);
    assert!(2 * i + 32 <= out.len());
    // SAFETY: the assert keeps the 32-byte unaligned store in bounds.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(2 * i).cast::<__m256i>(), r) };
}

/// Prefetches `x` into L1, one hint per 64-byte line (16 floats). Plain SSE,
/// part of the x86-64 baseline: any x86-64 kernel may call it.
#[inline]
pub(super) fn prefetch(x: &[f32]) {
    for line in x.chunks(16) {
        // SAFETY: a prefetch is a hint that never faults; the address is inside
        // a live slice anyway, and SSE is always present on x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
}
