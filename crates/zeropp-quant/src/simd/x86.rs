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
//!
//! Every operation is the scalar kernel's, in the scalar kernel's order (no
//! FMA), so both expansions stay bit-identical to [`super::scalar`]; only the
//! vocabulary is per-ISA.

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
