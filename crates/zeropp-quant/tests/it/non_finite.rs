//! `NonFinite::Propagate`: a group with NaN/±Inf is encoded as poisoned (NaN
//! scale, zero integers), decodes to NaN, poisons the sums it enters, and
//! leaves every other group's encoding as the default path makes it.
//!
//! The reference for the clean groups is the default (`NonFinite::Error`)
//! quantizer on the same vector with the bad elements replaced by 0: a
//! group's encoding depends only on its own elements and global indices, so
//! the two must agree on every group that held no bad element.

use proptest::prelude::*;
use zeropp_quant::hadamard::{Hadamard, dequantize_hadamard_into, quantize_hadamard_to_wire};
use zeropp_quant::half::bf16;
use zeropp_quant::wire::POISON_BITS;
use zeropp_quant::{
    Bits, DecodeError, Kernel, NonFinite, Options, QuantError, QuantSpec, Quantized, QuantizedRef, Rounding,
    Scheme, available_kernels, dequant_reduce_quant, dequantize, encoded_len, quantize, quantize_to_wire,
};

use crate::common::config;

fn propagate(o: Options) -> Options {
    o.with_non_finite(NonFinite::Propagate)
}

/// Which groups of `x` (groups of `gs`) hold a non-finite element.
fn bad_groups(x: &[f32], gs: usize) -> Vec<bool> {
    x.chunks(gs).map(|g| g.iter().any(|v| !v.is_finite())).collect()
}

fn cleaned(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| if v.is_finite() { v } else { 0.0 }).collect()
}

/// A vector with non-finite values at some positions, and the options.
fn case() -> impl Strategy<Value = (Vec<f32>, QuantSpec, Options)> {
    (1usize..3000, prop_oneof![Just(1usize), Just(3), Just(7), Just(64), Just(256), 1usize..300])
        .prop_flat_map(|(n, gs)| {
            let bad = prop::collection::vec(
                (0..n, prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)]),
                0..6,
            );
            let kernels: Vec<Kernel> = available_kernels();
            (
                prop::collection::vec(-100.0f32..100.0, n),
                bad,
                Just(gs),
                any::<bool>(),
                any::<bool>(),
                prop::option::of(any::<u64>()),
                prop::sample::select(kernels),
                any::<bool>(),
            )
        })
        .prop_map(|(mut x, bad, gs, int4, asym, seed, kernel, single)| {
            for (i, v) in bad {
                x[i] = v;
            }
            let bits = if int4 { Bits::Int4 } else { Bits::Int8 };
            let scheme = if asym { Scheme::Asymmetric } else { Scheme::Symmetric };
            let spec = QuantSpec::new(bits, scheme, gs).unwrap();
            let mut o = Options::default().with_kernel(kernel);
            if let Some(s) = seed {
                o = o.with_rounding(Rounding::Stochastic { seed: s });
            }
            if single {
                o = o.single_thread();
            }
            (x, spec, o)
        })
}

/// Checks `q` against the default encoding of the cleaned input, group by
/// group: poisoned exactly where `bad` says, equal elsewhere.
fn check_groups(
    q: &Quantized,
    reference: &Quantized,
    bad: &[bool],
    opts: &Options,
) -> Result<(), TestCaseError> {
    let gs = q.spec().group_size();
    let y = dequantize(q, opts).unwrap();
    let r = dequantize(reference, opts).unwrap();
    for (g, &is_bad) in bad.iter().enumerate() {
        let scale = q.scales()[g];
        let range = g * gs..((g + 1) * gs).min(q.len());
        if is_bad {
            prop_assert_eq!(scale.to_bits(), POISON_BITS, "group {} is not poisoned", g);
            if let Some(o) = q.offsets() {
                prop_assert_eq!(o[g].to_bits(), POISON_BITS);
            }
            for i in range.clone() {
                prop_assert_eq!(q.q(i), Some(0), "poisoned group {} holds a nonzero integer at {}", g, i);
                prop_assert!(y[i].is_nan(), "element {} of poisoned group {} decodes to {}", i, g, y[i]);
            }
        } else {
            prop_assert_eq!(scale.to_bits(), reference.scales()[g].to_bits(), "group {} scale", g);
            if let (Some(a), Some(b)) = (q.offsets(), reference.offsets()) {
                prop_assert_eq!(a[g].to_bits(), b[g].to_bits());
            }
            for i in range {
                prop_assert_eq!(q.q(i), reference.q(i), "element {} of clean group {}", i, g);
                prop_assert_eq!(y[i].to_bits(), r[i].to_bits());
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(128))]

    /// Poisoned exactly where a group holds NaN/±Inf; every other group as the
    /// default path encodes it; the wire form validates and decodes alike.
    #[test]
    fn poisons_exactly_the_bad_groups((x, spec, o) in case()) {
        let bad = bad_groups(&x, spec.group_size());
        let q = quantize(&x, spec, &propagate(o)).unwrap();
        let reference = quantize(&cleaned(&x), spec, &o).unwrap();
        check_groups(&q, &reference, &bad, &o)?;
        // The default still refuses the input.
        if bad.iter().any(|&b| b) {
            let is_non_finite = matches!(quantize(&x, spec, &o), Err(QuantError::NonFinite { .. }));
            prop_assert!(is_non_finite);
        }
        // Through the wire: to_wire writes the same bytes, from_bytes accepts them.
        let mut wire = vec![0u8; encoded_len(spec, x.len())];
        quantize_to_wire(&x, spec, &propagate(o), &mut wire).unwrap();
        prop_assert_eq!(&wire, &q.to_bytes());
        let back = QuantizedRef::from_bytes(&wire).unwrap().to_owned();
        check_groups(&back, &reference, &bad, &o)?;
    }

    /// The fused reduce: a group poisoned in any input is poisoned in the sum
    /// (propagating), the others are the sum of the clean inputs.
    #[test]
    fn poison_survives_the_fused_reduce((x, spec, o) in case(), k in 1usize..4) {
        let gs = spec.group_size();
        let clean = cleaned(&x);
        let mut inputs = vec![quantize(&x, spec, &propagate(o)).unwrap()];
        let mut clean_inputs = vec![quantize(&clean, spec, &o).unwrap()];
        for j in 1..k {
            let y: Vec<f32> = clean.iter().map(|v| v * (j as f32 + 0.5)).collect();
            inputs.push(quantize(&y, spec, &o).unwrap());
            clean_inputs.push(quantize(&y, spec, &o).unwrap());
        }
        let out = QuantSpec::new(Bits::Int4, spec.scheme(), gs).unwrap();
        let sum = dequant_reduce_quant(&inputs, out, &propagate(o)).unwrap();
        let reference = dequant_reduce_quant(&clean_inputs, out, &o).unwrap();
        check_groups(&sum, &reference, &bad_groups(&x, gs), &o)?;
        // Without propagation a poisoned input is refused, not summed into garbage.
        if bad_groups(&x, gs).iter().any(|&b| b) {
            prop_assert!(dequant_reduce_quant(&inputs, out, &o).is_err());
        }
    }
}

/// Groups longer than a tile (8192) of a converted input (bf16) take the
/// two-pass path: a bad value in any tile of the group poisons all of it.
#[test]
fn large_groups_poison_whole() {
    let gs = 20_000;
    let mut x: Vec<f32> = (0..50_000).map(|i| (i as f32 * 0.01).sin()).collect();
    x[gs + 15_000] = f32::INFINITY; // the second group's second tile
    let bad = bad_groups(&x, gs);
    assert_eq!(bad, [false, true, false]);
    let b16 = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a)).collect::<Vec<_>>();
    for spec in [QuantSpec::int8(gs).unwrap(), QuantSpec::new(Bits::Int4, Scheme::Asymmetric, gs).unwrap()] {
        let q = quantize(&b16(&x), spec, &propagate(Options::default())).unwrap();
        let reference = quantize(&b16(&cleaned(&x)), spec, &Options::default()).unwrap();
        let r: Result<(), TestCaseError> = check_groups(&q, &reference, &bad, &Options::default());
        r.unwrap();
    }
}

/// Only the canonical NaN marks a poisoned group: any other non-finite scale,
/// and a poisoned offset beside a real scale, are still decoding errors.
#[test]
fn only_the_canonical_nan_is_poison() {
    let x = [1.0f32, f32::NAN, 3.0, 4.0];
    let asym = QuantSpec::new(Bits::Int8, Scheme::Asymmetric, 2).unwrap();
    let wire = quantize(&x, asym, &propagate(Options::default())).unwrap().to_bytes();
    assert!(QuantizedRef::from_bytes(&wire).is_ok());
    let scale0 = 32; // the first group's scale, then its offset at 32 + 4 * 2
    for bits in [0x7FC0_0001u32, 0xFFC0_0000, f32::INFINITY.to_bits(), 0] {
        let mut w = wire.clone();
        w[scale0..scale0 + 4].copy_from_slice(&bits.to_le_bytes());
        let e = QuantizedRef::from_bytes(&w).unwrap_err();
        assert!(matches!(e, QuantError::Decode(DecodeError::BadScale { group: 0, .. })), "{bits:#x}: {e}");
    }
    // Group 1 is clean: a poisoned offset beside its finite scale is corrupt...
    let mut w = wire.clone();
    w[32 + 12..32 + 16].copy_from_slice(&POISON_BITS.to_le_bytes());
    let e = QuantizedRef::from_bytes(&w).unwrap_err();
    assert!(matches!(e, QuantError::Decode(DecodeError::BadOffset { group: 1, .. })), "{e}");
    // ...and so is a poisoned scale beside a finite offset.
    let mut w = wire.clone();
    w[32 + 4..32 + 8].copy_from_slice(&POISON_BITS.to_le_bytes());
    let e = QuantizedRef::from_bytes(&w).unwrap_err();
    assert!(matches!(e, QuantError::Decode(DecodeError::BadScale { group: 1, .. })), "{e}");
}

/// The Hadamard-fused quantizer: a bad element poisons its (rotated) group,
/// and the inverse hands back NaN over exactly that group.
#[test]
fn hadamard_poisons_its_group() {
    let gs = 64;
    let h = Hadamard::new(gs, 7).unwrap();
    let spec = QuantSpec::int4(gs).unwrap();
    let mut x: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).cos()).collect();
    x[70] = f32::NEG_INFINITY;
    let o = Options::default();
    let mut wire = vec![0u8; encoded_len(spec, x.len())];
    assert!(quantize_hadamard_to_wire(&x, spec, &h, 5, &o, &mut wire).is_err());
    quantize_hadamard_to_wire(&x, spec, &h, 5, &propagate(o), &mut wire).unwrap();
    let mut y = vec![0f32; x.len()];
    dequantize_hadamard_into(&QuantizedRef::from_bytes(&wire).unwrap(), &mut y, &h, 5, &o).unwrap();
    for (i, v) in y.iter().enumerate() {
        assert_eq!(v.is_nan(), (64..128).contains(&i), "element {i}: {v}");
    }
}
