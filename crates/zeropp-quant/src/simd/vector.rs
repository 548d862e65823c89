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

/// Defines `fwht` (the kernel behind [`super::Dispatch::fwht`]) and
/// `hash_words` ([`super::Dispatch::hash_words`]) in a kernel module that has
/// a `lanes` module (`F`, `I`, `WIDTH`, `add_f`, `sub_f`, `mul_f`, `splat_f`,
/// `splat_u`, `add_i`, `xor_i`, `lane_ids`), the unchecked `raw::{load,
/// store}` of `float_load_store!`, the `lowbias32` of `vector_rounding!`, a
/// `store_u32(out, at, v)` of `WIDTH` words, and two lane helpers of its own:
/// `fwht_flip(v, bits)`, which flips the sign of lane `k` where bit `k` of
/// `bits` is set, and `fwht_lanes(v)`, the butterfly stages `h = 1, 2, …,
/// WIDTH/2` inside one vector, in that order (a permute, an add, a subtract
/// and a blend per stage).
///
/// The passes over a group (in L1): the first takes blocks of four vectors and
/// runs every stage below `4·WIDTH` on them in registers (the in-vector
/// stages, then `h = WIDTH` and `2·WIDTH` between the four); the later passes
/// pair whole vectors at a stride, three stages at a time (eight vectors in
/// registers) while three remain, then two, then one. The last pass
/// multiplies by `scale` (and flips, for the inverse). Every butterfly is the
/// scalar kernel's `(a, b) → (a + b, a − b)` on the same pair, stage by stage
/// in the same order, so the results are bit-identical. Groups shorter than
/// a vector, or of a length that is not a power of two, go through the scalar
/// kernel.
///
/// The loops address the group through `raw` (no bounds check per vector):
/// `n = x.len()` is a power of two and a multiple of `WIDTH`, and every index
/// they form is `j + k·h` with `j + WIDTH <= h·(1 + k0)`, `k0 + k < K`,
/// `K·h` dividing `n`, so every access `[at, at + WIDTH)` lies in `0..n`.
macro_rules! vector_fwht {
    ($feature:literal) => {
        /// `(a + b, a - b)`.
        #[inline]
        #[target_feature(enable = $feature)]
        fn fwht_pair(a: lanes::F, b: lanes::F) -> (lanes::F, lanes::F) {
            (lanes::add_f(a, b), lanes::sub_f(a, b))
        }

        /// What a pass does to the vector it stores at `at`: nothing, unless it
        /// is the last pass (`LAST`): then multiply by the scale `vs` and, for
        /// the inverse (`INV`), flip by the bits of `signs` from `at`.
        #[inline]
        #[target_feature(enable = $feature)]
        fn fwht_finish<const INV: bool, const LAST: bool>(
            v: lanes::F,
            vs: lanes::F,
            signs: &[u32],
            at: usize,
        ) -> lanes::F {
            if !LAST {
                return v;
            }
            let v = lanes::mul_f(v, vs);
            if INV { fwht_flip(v, fwht_bits64(signs, at) as u32) } else { v }
        }

        /// The 64 sign bits from position `at` (a multiple of `WIDTH`; zeros
        /// where `signs` ends).
        #[inline]
        fn fwht_bits64(signs: &[u32], at: usize) -> u64 {
            let w = at / 32;
            let lo = u64::from(signs.get(w).copied().unwrap_or(0));
            let hi = u64::from(signs.get(w + 1).copied().unwrap_or(0));
            (lo | hi << 32) >> (at % 32)
        }

        /// The first pass over the `n` floats at `p`, in blocks of `B` vectors
        /// (1, 2 or 4): forward, the sign flip; the in-vector stages; then the
        /// stages `WIDTH` (and `2·WIDTH`) between the block's vectors.
        ///
        /// # Safety
        /// `p` points to `n` live, writable f32, `n` a multiple of `B·WIDTH`.
        #[inline]
        #[target_feature(enable = $feature)]
        unsafe fn fwht_first<const B: usize, const INV: bool, const LAST: bool>(
            p: *mut f32,
            n: usize,
            signs: &[u32],
            vs: lanes::F,
        ) {
            use lanes::WIDTH;
            let mut at = 0;
            while at < n {
                let bits = if INV { 0 } else { fwht_bits64(signs, at) };
                let ld = |k: usize| {
                    // SAFETY: at + B·WIDTH <= n (the contract), and k < B.
                    let u = unsafe { raw::load(p, at + k * WIDTH) };
                    fwht_lanes(if INV { u } else { fwht_flip(u, (bits >> (k * WIDTH)) as u32) })
                };
                // SAFETY: as for `ld`.
                let st = |k: usize, v: lanes::F| unsafe {
                    raw::store(p, at + k * WIDTH, fwht_finish::<INV, LAST>(v, vs, signs, at + k * WIDTH))
                };
                match B {
                    1 => st(0, ld(0)),
                    2 => {
                        let (v0, v1) = fwht_pair(ld(0), ld(1));
                        st(0, v0);
                        st(1, v1);
                    }
                    _ => {
                        let (v0, v1) = fwht_pair(ld(0), ld(1));
                        let (v2, v3) = fwht_pair(ld(2), ld(3));
                        let (v0, v2) = fwht_pair(v0, v2);
                        let (v1, v3) = fwht_pair(v1, v3);
                        st(0, v0);
                        st(1, v1);
                        st(2, v2);
                        st(3, v3);
                    }
                }
                at += B * WIDTH;
            }
        }

        /// One pass of `log2 K` stages from `h` (`K` = 2, 4 or 8) over the `n`
        /// floats at `p`: the vectors at `j + k·h`, `k < K`, for every `j` of
        /// the pass, the stages written out so that the `K` vectors stay in
        /// registers.
        ///
        /// # Safety
        /// `p` points to `n` live, writable f32; `n` and `h` are powers of two
        /// with `WIDTH <= h` and `K·h <= n`.
        #[inline]
        #[target_feature(enable = $feature)]
        unsafe fn fwht_pass<const K: usize, const INV: bool, const LAST: bool>(
            p: *mut f32,
            n: usize,
            h: usize,
            signs: &[u32],
            vs: lanes::F,
        ) {
            let mut base = 0;
            while base < n {
                let mut j = base;
                while j < base + h {
                    // SAFETY: j + WIDTH <= base + h and base + K·h <= n (the
                    // contract), so j + k·h + WIDTH <= n for every k < K.
                    let ld = |k: usize| unsafe { raw::load(p, j + k * h) };
                    // SAFETY: as for `ld`.
                    let st = |k: usize, v: lanes::F| unsafe {
                        raw::store(p, j + k * h, fwht_finish::<INV, LAST>(v, vs, signs, j + k * h))
                    };
                    match K {
                        2 => {
                            let (v0, v1) = fwht_pair(ld(0), ld(1));
                            st(0, v0);
                            st(1, v1);
                        }
                        4 => {
                            let (v0, v1) = fwht_pair(ld(0), ld(1));
                            let (v2, v3) = fwht_pair(ld(2), ld(3));
                            let (v0, v2) = fwht_pair(v0, v2);
                            let (v1, v3) = fwht_pair(v1, v3);
                            st(0, v0);
                            st(1, v1);
                            st(2, v2);
                            st(3, v3);
                        }
                        _ => {
                            let (v0, v1) = fwht_pair(ld(0), ld(1));
                            let (v2, v3) = fwht_pair(ld(2), ld(3));
                            let (v4, v5) = fwht_pair(ld(4), ld(5));
                            let (v6, v7) = fwht_pair(ld(6), ld(7));
                            let (v0, v2) = fwht_pair(v0, v2);
                            let (v1, v3) = fwht_pair(v1, v3);
                            let (v4, v6) = fwht_pair(v4, v6);
                            let (v5, v7) = fwht_pair(v5, v7);
                            let (v0, v4) = fwht_pair(v0, v4);
                            let (v1, v5) = fwht_pair(v1, v5);
                            let (v2, v6) = fwht_pair(v2, v6);
                            let (v3, v7) = fwht_pair(v3, v7);
                            st(0, v0);
                            st(1, v1);
                            st(2, v2);
                            st(3, v3);
                            st(4, v4);
                            st(5, v5);
                            st(6, v6);
                            st(7, v7);
                        }
                    }
                    j += lanes::WIDTH;
                }
                base += K * h;
            }
        }

        /// [`fwht`] in one direction.
        #[inline]
        #[target_feature(enable = $feature)]
        fn fwht_dir<const INV: bool>(x: &mut [f32], signs: &[u32], scale: f32) {
            use lanes::*;
            let n = x.len();
            let p = x.as_mut_ptr();
            let vs = splat_f(scale);
            // Each first pass below: `p` holds `n` floats, `n` a power of two
            // and a multiple of the block's `B·WIDTH`.
            let mut h = if n >= 4 * WIDTH {
                if n == 4 * WIDTH {
                    // SAFETY: see above.
                    unsafe { fwht_first::<4, INV, true>(p, n, signs, vs) };
                } else {
                    // SAFETY: see above.
                    unsafe { fwht_first::<4, INV, false>(p, n, signs, vs) };
                }
                4 * WIDTH
            } else if n == 2 * WIDTH {
                // SAFETY: see above.
                unsafe { fwht_first::<2, INV, true>(p, n, signs, vs) };
                n
            } else {
                // SAFETY: see above.
                unsafe { fwht_first::<1, INV, true>(p, n, signs, vs) };
                n
            };
            while h < n {
                let left = (n / h).trailing_zeros();
                let k = left.min(3);
                // SAFETY: `p` holds `n` floats; `h` is a power of two with
                // `WIDTH <= h` and `2^k·h <= n`.
                unsafe {
                    match (k, left == k) {
                        (3, true) => fwht_pass::<8, INV, true>(p, n, h, signs, vs),
                        (3, false) => fwht_pass::<8, INV, false>(p, n, h, signs, vs),
                        (2, true) => fwht_pass::<4, INV, true>(p, n, h, signs, vs),
                        (2, false) => fwht_pass::<4, INV, false>(p, n, h, signs, vs),
                        (_, true) => fwht_pass::<2, INV, true>(p, n, h, signs, vs),
                        (_, false) => fwht_pass::<2, INV, false>(p, n, h, signs, vs),
                    }
                }
                h <<= k;
            }
        }

        #[target_feature(enable = $feature)]
        pub(super) fn fwht(x: &mut [f32], signs: &[u32], scale: f32, inverse: bool) {
            let n = x.len();
            if n < lanes::WIDTH || !n.is_power_of_two() {
                return $crate::simd::scalar::fwht(x, signs, scale, inverse);
            }
            if inverse { fwht_dir::<true>(x, signs, scale) } else { fwht_dir::<false>(x, signs, scale) }
        }

        /// `out[i] = hash32(k1, k2, lo + i)`, `WIDTH` words at a time.
        #[target_feature(enable = $feature)]
        pub(super) fn hash_words(k1: u32, k2: u32, lo: u32, out: &mut [u32]) {
            use lanes::*;
            let body = out.len() - out.len() % WIDTH;
            let (vk1, vk2) = (splat_u(k1), splat_u(k2));
            let mut i = 0;
            while i < body {
                let idx = add_i(splat_u(lo.wrapping_add(i as u32)), lane_ids());
                store_u32(out, i, lowbias32(xor_i(lowbias32(xor_i(idx, vk1)), vk2)));
                i += WIDTH;
            }
            $crate::simd::scalar::hash_words(k1, k2, lo.wrapping_add(body as u32), &mut out[body..]);
        }
    };
}
