//! The rounding bodies shared by the AVX2 and AVX-512 kernels.
//!
//! The two modules differ in vector width and in a few instructions, not in
//! what rounding computes, so `x86_rounding!` writes `round_nearest` and
//! `round_stochastic` once, over a small vocabulary of lane operations that
//! each module defines in its own `lanes` module under the same names:
//!
//! | name | AVX2 | AVX-512F |
//! |---|---|---|
//! | `F`, `I` (f32, i32 lanes) | `__m256`, `__m256i` | `__m512`, `__m512i` |
//! | `WIDTH` (lanes) | 8 | 16 |
//! | `PER_STORE` (vectors a store takes) | 4 (32 bytes) | 1 (16 bytes) |
//! | `splat_f`, `splat_i`, `add_i`, `xor_i`, `mullo_i`, `shr_i`, `i_to_f`, `sub_f`, `mul_f`, `min_f`, `max_f` | `_mm256_*` | `_mm512_*` |
//! | `lane_ids` | `0, 1, ..., 7` | `0, 1, ..., 15` |
//! | `round_f`, `floor_f` | `_mm256_round_ps` | `_mm512_roundscale_ps` |
//! | `add_one_if_lt` | compare, `and` with 1.0, add | compare to a mask, masked add |
//! | `load`, `store` | 8 floats; 4 vectors to 32 bytes | 16 floats; 1 vector to 16 bytes |
//! | `store_f`, `add_f` (dequantization) | 8 floats, `_mm256_add_ps` | 16 floats, `_mm512_add_ps` |
//! | `deq` (`WIDTH` bytes to `* scale + offset`) | `_mm256_cvtepi8_epi32` | `_mm512_cvtepi8_epi32` |
//!
//! Every operation is the scalar kernel's, in the scalar kernel's order (no
//! FMA), so both expansions stay bit-identical to [`super::scalar`]; only the
//! vocabulary is per-ISA.

/// Defines the shared layer of an x86 kernel module: `loadu` and `storeu`
/// (`$loadu`, `$storeu` behind a bounds assert), the `lanes` module (the
/// vocabulary of the shared bodies, see the module docs) from the module's
/// intrinsics, and the shared bodies (`x86_rounding!`, `x86_dequant!`). `ops`
/// lists, in this order, the intrinsics behind `add_i`, `mullo_i`,
/// `splat_i`, `shr_i`, `xor_i`, `i_to_f`, `add_f`, `sub_f`, `mul_f`, `min_f`,
/// `max_f`, `splat_f`; `lane_ids`, `round_f`, `floor_f` and `add_one_if_lt`
/// are given as bodies over their arguments; `store` names the kernel
/// module's function; `deq` loads `WIDTH` bytes and sign-extends them to i32
/// lanes.
macro_rules! x86_kernels {
    (
        feature: $feature:literal, width: $width:literal, per_store: $per_store:literal,
        load_store: [$loadu:path, $storeu:path],
        types: [$f:ident, $i:ident],
        ops: [$add_i:ident, $mullo_i:ident, $splat_i:ident, $shr_i:ident, $xor_i:ident, $i_to_f:ident, $add_f:ident, $sub_f:ident, $mul_f:ident, $min_f:ident, $max_f:ident, $splat_f:ident],
        lane_ids: $ids:expr,
        round_f($ry:ident): $round:expr,
        floor_f($fy:ident): $floor:expr,
        add_one_if_lt($af:ident, $au:ident, $afrac:ident, $aone:ident): $add_one:expr,
        store: $store:ident,
        deq: [$load_bytes:path, $widen:path] $(,)?
    ) => {
        x86_rounding!($feature);
        x86_dequant!($feature);
        float_load_store!($feature, $f, $width, loadu: $loadu, storeu: $storeu);

        #[doc = concat!("Converts `q[at..at + ", $width, "]` to f32 and applies `* scale + offset`.")]
        #[inline]
        #[target_feature(enable = $feature)]
        fn deq(q: &[u8], at: usize, vs: $f, vo: $f) -> $f {
            use lanes::*;
            assert!(at + WIDTH <= q.len());
            // SAFETY: the assert keeps the `WIDTH`-byte unaligned load in bounds.
            let b = unsafe { $load_bytes(q.as_ptr().add(at).cast::<__m128i>()) };
            add_f(mul_f(i_to_f($widen(b)), vs), vo)
        }

        #[doc = concat!("The lane vocabulary of the shared x86 bodies, on ", $width, " lanes.")]
        mod lanes {
            pub(super) use super::{$store as store, deq, loadu as load, storeu as store_f};
            use std::arch::x86_64::*;
            pub(super) use std::arch::x86_64::{
                $add_f as add_f, $i_to_f as i_to_f, $max_f as max_f, $min_f as min_f, $mul_f as mul_f,
                $splat_f as splat_f, $sub_f as sub_f,
            };
            pub(super) use std::arch::x86_64::{
                $add_i as add_i, $mullo_i as mullo_i, $shr_i as shr_i, $splat_i as splat_i, $xor_i as xor_i,
            };
            pub(super) use std::arch::x86_64::{$f as F, $i as I};

            /// Lanes in a vector.
            pub(super) const WIDTH: usize = $width;
            /// Vectors [`store`] takes at once.
            pub(super) const PER_STORE: usize = $per_store;

            #[doc = concat!("Lane indices 0..", $width, " as i32.")]
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn lane_ids() -> I {
                $ids
            }

            /// Round to nearest, ties to even (as `f32::round_ties_even`).
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn round_f($ry: F) -> F {
                $round
            }

            /// Round toward negative infinity (as `f32::floor`).
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn floor_f($fy: F) -> F {
                $floor
            }

            /// `f + 1` in the lanes where `u < frac`, `f` (or `f + 0`, the same
            /// integer) elsewhere.
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn add_one_if_lt($af: F, $au: F, $afrac: F, $aone: F) -> F {
                $add_one
            }
        }
    };
}

/// Defines `dequant_into::<ADD>` (the one loop behind `dequant` and
/// `dequant_add`, see `dequant_entry_points!`) in an x86 kernel module with a
/// `lanes` module: whole vectors of `WIDTH` bytes, the remainder through the
/// scalar kernel.
macro_rules! x86_dequant {
    ($feature:literal) => {
        #[inline]
        #[target_feature(enable = $feature)]
        fn dequant_into<const ADD: bool>(q: &[u8], scale: f32, offset: f32, dst: &mut [f32]) {
            use lanes::*;
            let n = q.len().min(dst.len());
            let body = n - n % WIDTH;
            let vs = splat_f(scale);
            let vo = splat_f(offset);
            let mut i = 0;
            while i < body {
                let v = deq(q, i, vs, vo);
                let r = if ADD { add_f(load(dst, i), v) } else { v };
                store_f(dst, i, r);
                i += WIDTH;
            }
            $crate::simd::scalar::dequant_into::<ADD>(&q[body..n], scale, offset, &mut dst[body..n]);
        }

        dequant_entry_points!($feature);
    };
}

/// Defines `round_nearest` and `round_stochastic` (the kernels behind
/// [`super::Dispatch::round`]) in an x86 kernel module that has a `lanes`
/// module (see the module docs); `$feature` is the module's target
/// feature. Whole blocks of `WIDTH * PER_STORE` elements go through the
/// vector loop, the remainder through the scalar kernel.
macro_rules! x86_rounding {
    ($feature:literal) => {
        #[target_feature(enable = $feature)]
        pub(super) fn round_nearest(x: &[f32], p: &$crate::simd::RoundParams, out: &mut [u8]) {
            use lanes::*;
            const STEP: usize = WIDTH * PER_STORE;
            let n = x.len().min(out.len());
            let body = n - n % STEP;
            let [vs, vo, vlo, vhi] = splat_params(p);
            let mut i = 0;
            while i < body {
                let mut r = [vlo; PER_STORE];
                for (j, rj) in r.iter_mut().enumerate() {
                    let y = round_f(mul_f(sub_f(load(x, i + WIDTH * j), vo), vs));
                    *rj = min_f(max_f(y, vlo), vhi);
                }
                store(r, out, i);
                i += STEP;
            }
            $crate::simd::scalar::round_nearest(&x[body..n], p, &mut out[body..n]);
        }

        /// `[s, offset, qmin, qmax]` on every lane.
        #[inline]
        #[target_feature(enable = $feature)]
        fn splat_params(p: &$crate::simd::RoundParams) -> [lanes::F; 4] {
            use lanes::*;
            [splat_f(p.s), splat_f(p.offset), splat_f(p.qmin), splat_f(p.qmax)]
        }

        /// lowbias32 on every lane (see [`crate::rng`]).
        #[inline]
        #[target_feature(enable = $feature)]
        fn lowbias32(mut x: lanes::I) -> lanes::I {
            use lanes::*;
            x = xor_i(x, shr_i::<16>(x));
            x = mullo_i(x, splat_i(0x7feb_352d));
            x = xor_i(x, shr_i::<15>(x));
            x = mullo_i(x, splat_i(0x846c_a68b_u32 as i32));
            xor_i(x, shr_i::<16>(x))
        }

        #[target_feature(enable = $feature)]
        pub(super) fn round_stochastic(
            x: &[f32],
            p: &$crate::simd::RoundParams,
            st: $crate::simd::Stoch,
            out: &mut [u8],
        ) {
            use lanes::*;
            const STEP: usize = WIDTH * PER_STORE;
            let n = x.len().min(out.len());
            let body = n - n % STEP;
            let [vs, vo, vlo, vhi] = splat_params(p);
            let one = splat_f(1.0);
            let inv24 = splat_f(1.0 / 16_777_216.0);
            let k1 = splat_i(st.k1 as i32);
            let k2 = splat_i(st.k2 as i32);
            let ids = lane_ids();
            let mut i = 0;
            while i < body {
                let mut r = [vlo; PER_STORE];
                for (j, rj) in r.iter_mut().enumerate() {
                    let at = i + WIDTH * j;
                    // Lane k hashes element index `st.lo + at + k` (mod 2^32).
                    let idx = add_i(splat_i(st.lo.wrapping_add(at as u32) as i32), ids);
                    let h = lowbias32(xor_i(lowbias32(xor_i(idx, k1)), k2));
                    let u = mul_f(i_to_f(shr_i::<8>(h)), inv24);
                    let y = mul_f(sub_f(load(x, at), vo), vs);
                    let f = floor_f(y);
                    let frac = sub_f(y, f);
                    *rj = min_f(max_f(add_one_if_lt(f, u, frac, one), vlo), vhi);
                }
                store(r, out, i);
                i += STEP;
            }
            let tail = $crate::simd::Stoch { lo: st.lo.wrapping_add(body as u32), ..st };
            $crate::simd::scalar::round_stochastic(&x[body..n], p, tail, &mut out[body..n]);
        }
    };
}
