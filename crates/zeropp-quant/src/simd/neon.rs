//! NEON kernels (aarch64). Each function mirrors its [`super::scalar`]
//! counterpart operation for operation (separate multiply and add, never
//! `vfma`), so results are bit-identical. Vector loops handle whole chunks;
//! remainders go through the scalar code. The reductions and rounding are
//! the shared bodies (`super::vector`) over the 4-lane vocabulary in [`lanes`].

use super::scalar;
use std::arch::aarch64::*;

vector_reductions!("neon");
vector_rounding!("neon");

/// The lane vocabulary of the shared bodies (see `super::vector`), on 4 lanes.
mod lanes {
    pub(super) use super::{load4 as load, store16 as store};
    pub(super) use std::arch::aarch64::vaddq_f32 as add_f;
    use std::arch::aarch64::*;
    pub(super) use std::arch::aarch64::{float32x4_t as F, uint32x4_t as I, uint32x4_t as M};
    pub(super) use std::arch::aarch64::{vabsq_f32 as abs_f, vandq_u32 as and_m, vcleq_f32 as le_f};
    pub(super) use std::arch::aarch64::{vaddq_u32 as add_i, veorq_u32 as xor_i, vmulq_u32 as mullo_i};
    pub(super) use std::arch::aarch64::{
        vcvtq_f32_u32 as i_to_f, vdupq_n_u32 as splat_u, vshrq_n_u32 as shr_i,
    };
    pub(super) use std::arch::aarch64::{vdupq_n_f32 as splat_f, vmulq_f32 as mul_f, vsubq_f32 as sub_f};
    pub(super) use std::arch::aarch64::{
        vmaxq_f32 as max_f, vmaxvq_f32 as hmax, vminq_f32 as min_f, vminvq_f32 as hmin,
    };
    pub(super) use std::arch::aarch64::{vrndmq_f32 as floor_f, vrndnq_f32 as round_f};

    /// Lanes in a vector.
    pub(super) const WIDTH: usize = 4;
    /// Vectors [`store`] takes at once (16 bytes).
    pub(super) const PER_STORE: usize = 4;
    /// Accumulators of `abs_max`.
    pub(super) const ABS_ACC: usize = 4;
    /// Accumulators of `min_max`.
    pub(super) const MM_ACC: usize = 2;

    /// The mask with every lane set.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) fn all_ones() -> M {
        vdupq_n_u32(u32::MAX)
    }

    /// Whether every lane of the all-ones/all-zeros mask `ok` is set.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) fn all_set(ok: M) -> bool {
        vminvq_u32(ok) == u32::MAX
    }

    /// Lane indices 0..4.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) fn lane_ids() -> I {
        let ids: [u32; 4] = [0, 1, 2, 3];
        // SAFETY: `ids` holds exactly the 4 u32 read.
        unsafe { vld1q_u32(ids.as_ptr()) }
    }

    /// `f + 1` in the lanes where `u < frac`, `f + 0` elsewhere (which only
    /// changes -0 to +0, the same integer): the compare mask `and` the bits of 1.0.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) fn add_one_if_lt(f: F, u: F, frac: F, one: F) -> F {
        vaddq_f32(f, vreinterpretq_f32_u32(vandq_u32(vcltq_f32(u, frac), vreinterpretq_u32_f32(one))))
    }
}

float_load_store!("neon", float32x4_t, 4, load4: vld1q_f32, store4: vst1q_f32);

vector_fwht!("neon");

/// Stores 4 words to `out[at..at + 4]`.
#[inline]
#[target_feature(enable = "neon")]
fn store_u32(out: &mut [u32], at: usize, v: uint32x4_t) {
    assert!(at + 4 <= out.len());
    // SAFETY: the assert keeps the 16-byte unaligned store in bounds.
    unsafe { vst1q_u32(out.as_mut_ptr().add(at), v) }
}

/// Flips the sign of lane `k` where bit `k` of `bits` is set (an exact xor of
/// the sign bit).
#[inline]
#[target_feature(enable = "neon")]
fn fwht_flip(v: float32x4_t, bits: u32) -> float32x4_t {
    let ids: [u32; 4] = [1, 2, 4, 8];
    // SAFETY: `ids` holds exactly the 4 u32 read.
    let ids = unsafe { vld1q_u32(ids.as_ptr()) };
    let set = vceqq_u32(vandq_u32(vdupq_n_u32(bits), ids), ids);
    let sign = vandq_u32(set, vdupq_n_u32(0x8000_0000));
    vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(v), sign))
}

/// One butterfly stage inside a vector: `p` is `v` with each lane swapped for
/// its partner; lanes set in `upper` take `p - v` (the scalar `a - b`), the
/// others `v + p` (`a + b`).
#[inline]
#[target_feature(enable = "neon")]
fn fwht_stage(v: float32x4_t, p: float32x4_t, upper: [u32; 4]) -> float32x4_t {
    // SAFETY: `upper` holds exactly the 4 u32 read.
    let m = unsafe { vld1q_u32(upper.as_ptr()) };
    vbslq_f32(m, vsubq_f32(p, v), vaddq_f32(v, p))
}

/// The butterfly stages h = 1, 2 inside one vector of 4 lanes.
#[inline]
#[target_feature(enable = "neon")]
fn fwht_lanes(v: float32x4_t) -> float32x4_t {
    let v = fwht_stage(v, vrev64q_f32(v), [0, u32::MAX, 0, u32::MAX]);
    fwht_stage(v, vextq_f32::<2>(v, v), [0, 0, u32::MAX, u32::MAX])
}

/// Narrows four vectors of 4 clamped integral floats to 16 i8 at `out[at..]`.
#[inline]
#[target_feature(enable = "neon")]
fn store16(r: [float32x4_t; 4], out: &mut [u8], at: usize) {
    // The values are integral and within i8, so the conversions are exact.
    let h0 = vcombine_s16(vqmovn_s32(vcvtq_s32_f32(r[0])), vqmovn_s32(vcvtq_s32_f32(r[1])));
    let h1 = vcombine_s16(vqmovn_s32(vcvtq_s32_f32(r[2])), vqmovn_s32(vcvtq_s32_f32(r[3])));
    let b = vreinterpretq_u8_s8(vcombine_s8(vqmovn_s16(h0), vqmovn_s16(h1)));
    assert!(at + 16 <= out.len());
    // SAFETY: the assert keeps the 16-byte unaligned store in bounds.
    unsafe { vst1q_u8(out.as_mut_ptr().add(at), b) }
}

/// Converts `q[at..at + 16]` to f32 and applies `* scale + offset`.
#[inline]
#[target_feature(enable = "neon")]
fn deq16(q: &[u8], at: usize, vs: float32x4_t, vo: float32x4_t) -> [float32x4_t; 4] {
    assert!(at + 16 <= q.len());
    // SAFETY: the assert keeps the 16-byte unaligned load in bounds.
    let b = vreinterpretq_s8_u8(unsafe { vld1q_u8(q.as_ptr().add(at)) });
    let w0 = vmovl_s8(vget_low_s8(b));
    let w1 = vmovl_s8(vget_high_s8(b));
    let d = [
        vmovl_s16(vget_low_s16(w0)),
        vmovl_s16(vget_high_s16(w0)),
        vmovl_s16(vget_low_s16(w1)),
        vmovl_s16(vget_high_s16(w1)),
    ];
    // Separate multiply and add (no fused multiply-add), as in the scalar code.
    d.map(|v| vaddq_f32(vmulq_f32(vcvtq_f32_s32(v), vs), vo))
}

/// Dequantizes `q` into `dst` (`ADD`: adds into it) — the one loop behind
/// [`dequant`] and [`dequant_add`]; the remainder goes through the scalar kernel.
#[inline]
#[target_feature(enable = "neon")]
fn dequant_into<const ADD: bool>(q: &[u8], scale: f32, offset: f32, dst: &mut [f32]) {
    let n = q.len().min(dst.len());
    let body = n - n % 16;
    let vs = vdupq_n_f32(scale);
    let vo = vdupq_n_f32(offset);
    let mut i = 0;
    while i < body {
        for (j, v) in deq16(q, i, vs, vo).into_iter().enumerate() {
            let at = i + 4 * j;
            let r = if ADD { vaddq_f32(load4(dst, at), v) } else { v };
            store4(dst, at, r);
        }
        i += 16;
    }
    scalar::dequant_into::<ADD>(&q[body..n], scale, offset, &mut dst[body..n]);
}

dequant_entry_points!("neon");

int4_entry_points!("neon", pack: 16, unpack: 16);

/// Packs the 16 pairs of `q[2i..2i + 32]` into `out[i..i + 16]`.
#[inline]
#[target_feature(enable = "neon")]
fn pack_block(q: &[u8], out: &mut [u8], i: usize) {
    assert!(2 * i + 32 <= q.len());
    // SAFETY: the assert keeps the 32-byte deinterleaving load in bounds.
    let v = unsafe { vld2q_u8(q.as_ptr().add(2 * i)) };
    let p = vorrq_u8(vshlq_n_u8::<4>(v.0), vandq_u8(v.1, vdupq_n_u8(0x0F)));
    assert!(i + 16 <= out.len());
    // SAFETY: the assert keeps the 16-byte unaligned store in bounds.
    unsafe { vst1q_u8(out.as_mut_ptr().add(i), p) };
}

/// Unpacks `data[i..i + 16]` into `out[2i..2i + 32]`.
#[inline]
#[target_feature(enable = "neon")]
fn unpack_block(data: &[u8], out: &mut [u8], i: usize) {
    assert!(i + 16 <= data.len());
    // SAFETY: the assert keeps the 16-byte unaligned load in bounds.
    let b = vreinterpretq_s8_u8(unsafe { vld1q_u8(data.as_ptr().add(i)) });
    let even = vshrq_n_s8::<4>(b);
    let odd = vshrq_n_s8::<4>(vshlq_n_s8::<4>(b));
    let r = uint8x16x2_t(vreinterpretq_u8_s8(even), vreinterpretq_u8_s8(odd));
    assert!(2 * i + 32 <= out.len());
    // SAFETY: the assert keeps the 32-byte interleaving store in bounds.
    unsafe { vst2q_u8(out.as_mut_ptr().add(2 * i), r) };
}
