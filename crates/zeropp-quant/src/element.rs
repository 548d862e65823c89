//! Input/output element types: `f32`, `bf16`, `f16`.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A floating-point element type that can be quantized from and
/// dequantized into: `f32`, [`half::bf16`] or [`half::f16`].
///
/// Sealed: the crate's kernels compute in f32 and convert at the edges.
pub trait Element: Copy + Send + Sync + Default + sealed::Sealed + 'static {
    /// Converts `src` into `dst` (same length) as f32, exactly.
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// Converts `src` into `dst` (same length), rounding to nearest even.
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
    /// The slice itself if `Self` is `f32` (lets kernels skip conversion).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// The mutable slice itself if `Self` is `f32`.
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    /// One element as f32.
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// The half-precision elements: converted through `half`'s slice kernels,
/// never viewable as f32.
macro_rules! half_element {
    ($($t:ident),*) => {$(
        impl Element for $t {
            fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
                src.convert_to_f32_slice(dst);
            }
            fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
                dst.convert_from_f32_slice(src);
            }
            fn as_f32(_: &[Self]) -> Option<&[f32]> {
                None
            }
            fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
                None
            }
            fn to_f32(self) -> f32 {
                $t::to_f32(self)
            }
        }
    )*};
}

half_element!(bf16, f16);
