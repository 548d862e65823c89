//! Case generation shared by the GPU kernels' tests on the device (`gpu.rs`)
//! and in the CPU emulator (`gpu_emu.rs`): the scalar CPU reference options,
//! the spec and rounding strategies, and the inputs of the reduce check.

use proptest::prelude::*;
use zeropp_quant::{Bits, Kernel, Options, QuantSpec, Quantized, Rounding, Scheme, quantize};

use crate::common::group_size;

/// The reference: the scalar CPU kernel, one thread, rounding `r`.
pub(crate) fn cpu(r: Rounding) -> Options {
    Options::default().with_kernel(Kernel::Scalar).single_thread().with_rounding(r)
}

/// INT4 or INT8, symmetric or asymmetric, any group size.
pub(crate) fn spec_strategy() -> impl Strategy<Value = QuantSpec> {
    (
        prop_oneof![Just(Bits::Int4), Just(Bits::Int8)],
        prop_oneof![Just(Scheme::Symmetric), Just(Scheme::Asymmetric)],
        group_size(),
    )
        .prop_map(|(b, s, g)| QuantSpec::new(b, s, g).unwrap())
}

/// Round to nearest even, or stochastic with any seed.
pub(crate) fn rounding_strategy() -> impl Strategy<Value = Rounding> {
    prop_oneof![Just(Rounding::NearestEven), any::<u64>().prop_map(|seed| Rounding::Stochastic { seed })]
}

/// The `k` inputs of a dequantize-reduce-quantize check: `len` pseudo-random
/// values each (an LCG seeded from `seed` and the input's index, scaled by
/// 2^(j % 5) so the inputs differ in magnitude), input `j` quantized with
/// `specs[j]` by the CPU reference, rounding to nearest.
pub(crate) fn reduce_inputs(k: usize, specs: &[QuantSpec], len: usize, seed: u64) -> Vec<Quantized> {
    (0..k)
        .map(|j| {
            let mut st = seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let x: Vec<f32> = (0..len)
                .map(|_| {
                    st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((st >> 40) as f32 / 16_777_216.0 - 0.5) * (1 << (j % 5)) as f32
                })
                .collect();
            quantize(&x, specs[j], &cpu(Rounding::NearestEven)).unwrap()
        })
        .collect()
}
