//! The kernel bodies shared by every vector ISA (AVX2, AVX-512F, NEON).
//!
//! The ISAs differ in vector width and in a few instructions, not in what
//! the kernels compute, so `vector_reductions!` (`abs_max`, `min_max`) and
//! `vector_rounding!` (`round_nearest`, `round_stochastic`) write them once,
//! over a small vocabulary of lane operations that each kernel module
//! defines in its own `lanes` module under the same names:
//!
//! | name | AVX2 | AVX-512F | NEON |
//! |---|---|---|---|
//! | `F`, `I`, `M` (f32 lanes, 32-bit integer lanes, a lane mask) | `__m256`, `__m256i`, `__m256` | `__m512`, `__m512i`, `__mmask16` | `float32x4_t`, `uint32x4_t`, `uint32x4_t` |
//! | `WIDTH` (lanes) | 8 | 16 | 4 |
//! | `PER_STORE` (vectors a store takes) | 4 (32 bytes) | 1 (16 bytes) | 4 (16 bytes) |
//! | `ABS_ACC`, `MM_ACC` (accumulators of `abs_max`, `min_max`) | 4, 2 | 2, 1 | 4, 2 |
//! | `splat_f`, `splat_u`, `add_i`, `xor_i`, `mullo_i`, `shr_i`, `i_to_f`, `sub_f`, `mul_f`, `min_f`, `max_f` | `_mm256_*` | `_mm512_*` | `v*q_*` |
//! | `abs_f`, `le_f`, `and_m`, `all_set`, `all_ones` (finiteness mask) | `andnot` sign, `cmp_ps`, `and_ps`, `movemask` | `abs_ps`, `cmp_ps_mask`, `&`, `== 0xFFFF` | `vabsq`, `vcleq`, `vandq`, `vminvq` |
//! | `hmax`, `hmin` (horizontal) | shuffles | `_mm512_reduce_*_ps` | `vmaxvq`, `vminvq` |
//! | `lane_ids` | `0, 1, ..., 7` | `0, 1, ..., 15` | `0, 1, 2, 3` |
//! | `round_f`, `floor_f` | `_mm256_round_ps` | `_mm512_roundscale_ps` | `vrndnq`, `vrndmq` |
//! | `add_one_if_lt` | compare, `and` with 1.0, add | compare to a mask, masked add | compare, `and` with 1.0, add |
//! | `load`, `store` | 8 floats; 4 vectors to 32 bytes | 16 floats; 1 vector to 16 bytes | 4 floats; 4 vectors to 16 bytes |
//!
//! Every operation is the scalar kernel's, in the scalar kernel's order (no
//! FMA), so every expansion stays bit-identical to [`super::scalar`]; only
//! the vocabulary is per-ISA. The reductions keep each ISA's number of
//! accumulators, combined pairwise (`((m0, m1), (m2, m3))`), as before.

/// `$m[0]` after combining the accumulators `$m` pairwise with `$op`:
/// `((m0, m1), (m2, m3))` for four, `(m0, m1)` for two.
macro_rules! pairwise {
    ($m:ident, $op:ident) => {{
        let mut w = $m.len();
        while w > 1 {
            w /= 2;
            for k in 0..w {
                $m[k] = $op($m[2 * k], $m[2 * k + 1]);
            }
        }
        $m[0]
    }};
}

/// Defines `abs_max` and `min_max` (the kernels behind
/// [`super::Dispatch::abs_max`] and [`super::Dispatch::min_max`]) in a
/// kernel module that has a `lanes` module; `$feature` is the module's
/// target feature. Whole chunks of `ACC * WIDTH` elements go through the
/// vector loop, the remainder through the scalar kernel; a non-finite
/// element anywhere gives `None`.
macro_rules! vector_reductions {
    ($feature:literal) => {
        #[target_feature(enable = $feature)]
        pub(super) fn abs_max(x: &[f32]) -> Option<f32> {
            use lanes::*;
            let fmax = splat_f(f32::MAX);
            let mut m = [splat_f(0.0); ABS_ACC];
            let mut ok = all_ones();
            let chunks = x.chunks_exact(ABS_ACC * WIDTH);
            let rem = chunks.remainder();
            for c in chunks {
                for (j, mj) in m.iter_mut().enumerate() {
                    let a = abs_f(load(c, WIDTH * j));
                    // `a <= MAX` is false for ±Inf and NaN.
                    ok = and_m(ok, le_f(a, fmax));
                    *mj = max_f(*mj, a);
                }
            }
            if !all_set(ok) {
                return None;
            }
            let t = $crate::simd::scalar::abs_max(rem)?;
            Some(hmax(pairwise!(m, max_f)).max(t))
        }

        #[target_feature(enable = $feature)]
        pub(super) fn min_max(x: &[f32]) -> Option<(f32, f32)> {
            use lanes::*;
            let fmax = splat_f(f32::MAX);
            let mut lo = [splat_f(f32::INFINITY); MM_ACC];
            let mut hi = [splat_f(f32::NEG_INFINITY); MM_ACC];
            let mut ok = all_ones();
            let chunks = x.chunks_exact(MM_ACC * WIDTH);
            let rem = chunks.remainder();
            for c in chunks {
                for (j, (l, h)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                    let v = load(c, WIDTH * j);
                    ok = and_m(ok, le_f(abs_f(v), fmax));
                    *l = min_f(*l, v);
                    *h = max_f(*h, v);
                }
            }
            if !all_set(ok) {
                return None;
            }
            let (tl, th) = $crate::simd::scalar::min_max(rem)?;
            Some((hmin(pairwise!(lo, min_f)).min(tl), hmax(pairwise!(hi, max_f)).max(th)))
        }
    };
}

/// Defines `round_nearest` and `round_stochastic` (the kernels behind
/// [`super::Dispatch::round`]) in a kernel module that has a `lanes`
/// module (see the module docs); `$feature` is the module's target
/// feature. Whole blocks of `WIDTH * PER_STORE` elements go through the
/// vector loop, the remainder through the scalar kernel.
macro_rules! vector_rounding {
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
            x = mullo_i(x, splat_u(0x7feb_352d));
            x = xor_i(x, shr_i::<15>(x));
            x = mullo_i(x, splat_u(0x846c_a68b));
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
            let k1 = splat_u(st.k1);
            let k2 = splat_u(st.k2);
            let ids = lane_ids();
            let mut i = 0;
            while i < body {
                let mut r = [vlo; PER_STORE];
                for (j, rj) in r.iter_mut().enumerate() {
                    let at = i + WIDTH * j;
                    // Lane k hashes element index `st.lo + at + k` (mod 2^32).
                    let idx = add_i(splat_u(st.lo.wrapping_add(at as u32)), ids);
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
