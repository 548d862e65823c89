//! The x86 layer shared by the AVX2 and AVX-512 kernels: `x86_kernels!`
//! builds a module's `lanes` vocabulary (see [`super::vector`]) from its
//! intrinsics and expands the shared bodies, plus the dequantization loop
//! (`x86_dequant!`), over `WIDTH`-byte loads (`deq`) and float stores
//! (`store_f`, `add_f`).

/// Defines the shared layer of an x86 kernel module: `loadu` and `storeu`
/// (`$loadu`, `$storeu` behind a bounds assert), the `lanes` module (the
/// vocabulary of the shared bodies, see the module docs) from the module's
/// intrinsics, and the shared bodies (`vector_rounding!`, `vector_reductions!`, `x86_dequant!`). `ops`
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
        mask: [$m:ty, $ones:expr],
        abs_f($absv:ident): $abs:expr,
        le_f($lea:ident, $leb:ident): $le:expr,
        and_m($anda:ident, $andb:ident): $and:expr,
        all_set($allm:ident): $all:expr,
        horizontal: [$hmax:path, $hmin:path],
        accumulators: [$abs_acc:literal, $mm_acc:literal],
        store: $store:ident,
        deq: [$load_bytes:path, $widen:path] $(,)?
    ) => {
        vector_rounding!($feature);
        vector_reductions!($feature);
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
                $add_i as add_i, $mullo_i as mullo_i, $shr_i as shr_i, $xor_i as xor_i,
            };
            pub(super) use $hmax as hmax;
            pub(super) use $hmin as hmin;
            pub(super) use std::arch::x86_64::{$f as F, $i as I};

            /// Lanes in a vector.
            pub(super) const WIDTH: usize = $width;
            /// Vectors [`store`] takes at once.
            pub(super) const PER_STORE: usize = $per_store;
            /// Accumulators of `abs_max`.
            pub(super) const ABS_ACC: usize = $abs_acc;
            /// Accumulators of `min_max`.
            pub(super) const MM_ACC: usize = $mm_acc;
            /// A lane mask.
            pub(super) type M = $m;

            /// `x` on every 32-bit integer lane.
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn splat_u(x: u32) -> I {
                $splat_i(x as i32)
            }

            /// The mask with every lane set.
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn all_ones() -> M {
                $ones
            }

            /// `|v|` on every lane.
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn abs_f($absv: F) -> F {
                $abs
            }

            /// The lanes where `a <= b` (false for NaN).
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn le_f($lea: F, $leb: F) -> M {
                $le
            }

            /// Lane-wise `a && b`.
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn and_m($anda: M, $andb: M) -> M {
                $and
            }

            /// Whether every lane of the mask is set.
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) fn all_set($allm: M) -> bool {
                $all
            }

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
