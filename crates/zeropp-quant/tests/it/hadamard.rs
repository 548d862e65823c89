//! The randomized Hadamard transform (`zeropp_quant::hadamard`): every kernel
//! bit-identical to the scalar one, the scalar one against an f64 reference
//! built from the matrix definition and an independent sign stream, the round
//! trip, and the fused quantizer against rotate-then-quantize.

use crate::common::*;
use proptest::prelude::*;
use zeropp_quant::hadamard::{
    MAX_GROUP, dequantize_hadamard_add, dequantize_hadamard_into, quantize_hadamard_to_wire, sign_bits,
};
use zeropp_quant::rng::splitmix64;
use zeropp_quant::{
    Hadamard, Kernel, Options, QuantError, QuantSpec, QuantizedRef, available_kernels, dequant_reduce_quant,
    dequantize_into, encoded_len, quantize_to_wire,
};

const EPS: f64 = 1.0 / (1u64 << 24) as f64;

/// Powers of two from 1 to 8192, weighted towards the small and the usual.
fn pow2_group() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1usize),
        Just(2),
        Just(4),
        Just(8),
        Just(16),
        Just(32),
        Just(64),
        Just(128),
        Just(256),
        Just(512),
        Just(2048),
        Just(8192)
    ]
}

/// The sign stream as the module docs define it, written from the docs:
/// `(k1, k2)` from `splitmix64(seed' ^ splitmix64(hi))`, then two lowbias32 rounds.
fn ref_sign(seed: u64, pos: u64) -> bool {
    fn lowbias32(mut x: u32) -> u32 {
        x ^= x >> 16;
        x = x.wrapping_mul(0x7feb_352d);
        x ^= x >> 15;
        x = x.wrapping_mul(0x846c_a68b);
        x ^ (x >> 16)
    }
    let w = pos / 32;
    let z = splitmix64((seed ^ 0x4841_4441_4D41_5244) ^ splitmix64(w >> 32));
    let (k1, k2) = (z as u32, (z >> 32) as u32);
    (lowbias32(lowbias32(w as u32 ^ k1) ^ k2) >> (pos % 32)) & 1 == 1
}

/// `R·x` in f64 from the matrix definition, `R = H·D/√g`, `H[i][j] =
/// (-1)^popcount(i & j)`, for one group at stream position `pos`.
fn ref_forward(x: &[f32], seed: u64, pos: u64) -> Vec<f64> {
    let g = x.len();
    let s: Vec<f64> = (0..g)
        .map(|j| if ref_sign(seed, pos + j as u64) { -f64::from(x[j]) } else { f64::from(x[j]) })
        .collect();
    (0..g)
        .map(|i| {
            let sum: f64 = (0..g).map(|j| if (i & j).count_ones() % 2 == 1 { -s[j] } else { s[j] }).sum();
            sum / (g as f64).sqrt()
        })
        .collect()
}

fn with(kernel: Kernel) -> Options {
    Options::default().with_kernel(kernel).single_thread()
}

proptest! {
    #![proptest_config(config(128))]

    /// The sign bits the kernels use are the documented stream, at any
    /// position (aligned to a word or not).
    #[test]
    fn sign_bits_follow_the_documented_stream(seed: u64, pos in 0u64..1u64 << 40, g in pow2_group()) {
        let bits = sign_bits(seed, pos, g);
        for k in 0..g {
            let got = (bits[k / 32] >> (k % 32)) & 1 == 1;
            prop_assert_eq!(got, ref_sign(seed, pos + k as u64), "bit {} of a group at {}", k, pos);
        }
    }

    /// The scalar transform agrees with the f64 matrix definition within the
    /// f32 roundings of its `log2 g` stages and the scale.
    #[test]
    fn forward_matches_the_matrix_definition(g in pow2_group().prop_filter("O(g^2) reference", |g| *g <= 512),
                                             seed: u64, pos in 0u64..1000, x0 in values(512)) {
        let x = &x0[..g];
        let mut y = x.to_vec();
        Hadamard::new(g, seed).unwrap().forward(&mut y, pos, &with(Kernel::Scalar)).unwrap();
        let r = ref_forward(x, seed, pos);
        let l1: f64 = x.iter().map(|v| f64::from(v.abs())).sum();
        let tol = (g.trailing_zeros() as f64 + 2.0) * 2.0 * EPS * l1;
        for i in 0..g {
            prop_assert!((f64::from(y[i]) - r[i]).abs() <= tol, "element {}: {} vs {} (tol {})", i, y[i], r[i], tol);
        }
    }

    /// Every SIMD kernel is bit-identical to the scalar one, both ways, at every
    /// length (a partial last group untouched), position and seed.
    #[test]
    fn kernels_are_bit_identical(x in vector(), g in pow2_group(), seed: u64, pos in 0u64..1u64 << 34) {
        let h = Hadamard::new(g, seed).unwrap();
        for inverse in [false, true] {
            let mut want = x.clone();
            let run = |y: &mut Vec<f32>, o: &Options| if inverse { h.inverse(y, pos, o) } else { h.forward(y, pos, o) };
            run(&mut want, &with(Kernel::Scalar)).unwrap();
            for k in available_kernels() {
                let mut got = x.clone();
                run(&mut got, &with(k)).unwrap();
                let (a, b): (Vec<u32>, Vec<u32>) =
                    (want.iter().map(|v| v.to_bits()).collect(), got.iter().map(|v| v.to_bits()).collect());
                prop_assert_eq!(a, b, "kernel {} (inverse: {})", k, inverse);
            }
            // Threads change nothing either.
            let mut par = x.clone();
            run(&mut par, &Options::default()).unwrap();
            prop_assert_eq!(want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            par.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    /// Forward then inverse gives the input back within f32 rounding, the
    /// partial last group exactly, and the rotation keeps each group's norm.
    #[test]
    fn round_trip_and_norm(x in vector(), g in pow2_group(), seed: u64, pos in 0u64..1u64 << 34) {
        let h = Hadamard::new(g, seed).unwrap();
        let o = Options::default();
        let mut y = x.clone();
        h.forward(&mut y, pos, &o).unwrap();
        let whole = x.len() / g * g;
        prop_assert_eq!(&y[whole..], &x[whole..], "the partial group is left as it is");
        for (gx, gy) in x[..whole].chunks(g).zip(y[..whole].chunks(g)) {
            let nx: f64 = gx.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            let ny: f64 = gy.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            let l1: f64 = gx.iter().map(|v| f64::from(v.abs())).sum();
            prop_assert!((nx - ny).abs() <= (g.trailing_zeros() as f64 + 2.0) * 2.0 * EPS * l1 + 1e-30,
                         "norm {} became {}", nx, ny);
        }
        h.inverse(&mut y, pos, &o).unwrap();
        for (k, (gx, gy)) in x.chunks(g).zip(y.chunks(g)).enumerate() {
            let l1: f64 = gx.iter().map(|v| f64::from(v.abs())).sum();
            let tol = 2.0 * (2.0 * g.trailing_zeros() as f64 + 4.0) * EPS * l1;
            for (a, b) in gx.iter().zip(gy) {
                prop_assert!((f64::from(*a) - f64::from(*b)).abs() <= tol, "group {}: {} came back as {}", k, a, b);
            }
        }
    }

    /// The fused quantizer is exactly rotate-then-quantize, and its dequantizer
    /// exactly dequantize-then-rotate-back, bytes and bits, at every length,
    /// for both widths and both roundings; the L2 error of each whole group is
    /// within the rotated domain's bound (the rotation is orthonormal).
    #[test]
    fn fused_equals_composed_and_error_is_bounded(x in vector(), g in pow2_group(), four: bool,
                                                  seed: u64, pos in 0u64..1u64 << 34, sr in any::<Option<u64>>()) {
        let spec = if four { QuantSpec::int4(g) } else { QuantSpec::int8(g) }.unwrap();
        let h = Hadamard::for_spec(&spec, seed).unwrap();
        let mut o = Options::default();
        if let Some(s) = sr { o = o.stochastic(s); }
        let mut fused = vec![0u8; encoded_len(spec, x.len())];
        quantize_hadamard_to_wire(&x, spec, &h, pos, &o, &mut fused).unwrap();
        let mut rot = x.clone();
        h.forward(&mut rot, pos, &o).unwrap();
        let mut composed = vec![0u8; fused.len()];
        quantize_to_wire(&rot, spec, &o, &mut composed).unwrap();
        prop_assert_eq!(&fused, &composed);

        let q = QuantizedRef::from_bytes(&fused).unwrap();
        let mut back = vec![0.0f32; x.len()];
        dequantize_hadamard_into(&q, &mut back, &h, pos, &o).unwrap();
        let mut plain = vec![0.0f32; x.len()];
        dequantize_into(&q, &mut plain, &o).unwrap();
        h.inverse(&mut plain, pos, &o).unwrap();
        prop_assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>());

        // Per whole group: every rotated element is within one step of its value
        // (clipping at the max, or stochastic), so the L2 error is at most
        // step·√g, step = scale; plus f32 slack.
        let whole = x.len() / g * g;
        for (k, (gx, gy)) in x[..whole].chunks(g).zip(back[..whole].chunks(g)).enumerate() {
            let scale = f64::from(q.scale(k).unwrap());
            let err: f64 = gx.iter().zip(gy).map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2)).sum::<f64>().sqrt();
            let l1: f64 = gx.iter().map(|v| f64::from(v.abs())).sum();
            let bound = scale * (g as f64).sqrt() + 64.0 * EPS * (l1 + scale * g as f64 * 8.0);
            prop_assert!(err <= bound, "group {}: L2 error {} > {}", k, err, bound);
        }
    }
}

/// Sums of rotated encodings (the fused qgZ kernel, unchanged) rotate back to
/// the sum of the inputs: the transform is linear and keyed by position only.
#[test]
fn sums_in_the_rotated_domain_rotate_back_to_the_sum() {
    let spec = QuantSpec::int8(256).unwrap();
    let h = Hadamard::for_spec(&spec, 9).unwrap();
    let o = Options::default();
    let n = 256 * 5 + 17;
    let xs: Vec<Vec<f32>> =
        (0..3).map(|r| (0..n).map(|i| ((i * 31 + r * 7) % 97) as f32 / 50.0 - 1.0).collect()).collect();
    let encs: Vec<Vec<u8>> = xs
        .iter()
        .map(|x| {
            let mut b = vec![0u8; encoded_len(spec, n)];
            quantize_hadamard_to_wire(x, spec, &h, 1000, &o, &mut b).unwrap();
            b
        })
        .collect();
    let refs: Vec<QuantizedRef<'_>> = encs.iter().map(|b| QuantizedRef::from_bytes(b).unwrap()).collect();
    let sum = dequant_reduce_quant(&refs, spec, &o).unwrap();
    let mut y = vec![0.0f32; n];
    dequantize_hadamard_into(&sum, &mut y, &h, 1000, &o).unwrap();
    let mut acc = vec![0.0f32; n];
    for r in &refs {
        dequantize_hadamard_add(r, &mut acc, &h, 1000, &o).unwrap();
    }
    for i in 0..n {
        let want: f32 = xs.iter().map(|x| x[i]).sum();
        assert!((y[i] - want).abs() < 0.05, "element {i}: {} vs {want}", y[i]);
        assert!((acc[i] - want).abs() < 0.03, "element {i}: {} vs {want}", acc[i]);
    }
    // With the wrong position the signs differ and the sum does not come back.
    let mut wrong = vec![0.0f32; n];
    dequantize_hadamard_into(&sum, &mut wrong, &h, 1001, &o).unwrap();
    assert!((0..256).any(|i| (wrong[i] - y[i]).abs() > 0.1));
}

/// On a group with one outlier, the rotation cuts INT4's error (the point of it).
#[test]
fn an_outlier_costs_less_after_the_rotation() {
    let spec = QuantSpec::int4(256).unwrap();
    let h = Hadamard::for_spec(&spec, 3).unwrap();
    let o = Options::default();
    let mut x: Vec<f32> = (0..256).map(|i| ((i * 13 % 29) as f32 - 14.0) * 1e-3).collect();
    x[77] = 1.0;
    let mut b = vec![0u8; encoded_len(spec, x.len())];
    quantize_hadamard_to_wire(&x, spec, &h, 0, &o, &mut b).unwrap();
    let mut y = vec![0.0f32; 256];
    dequantize_hadamard_into(&QuantizedRef::from_bytes(&b).unwrap(), &mut y, &h, 0, &o).unwrap();
    quantize_to_wire(&x, spec, &o, &mut b).unwrap();
    let mut z = vec![0.0f32; 256];
    dequantize_into(&QuantizedRef::from_bytes(&b).unwrap(), &mut z, &o).unwrap();
    let mse = |v: &[f32]| x.iter().zip(v).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>() / 256.0;
    assert!(mse(&y) < 0.5 * mse(&z), "rotated {} vs plain {}", mse(&y), mse(&z));
}

/// Bad arguments are errors that say what is wrong; a NaN is named at its
/// index in the input, not where the rotation spread it.
#[test]
fn errors_name_the_problem() {
    for g in [0usize, 3, 100, 2 * MAX_GROUP] {
        let e = Hadamard::new(g, 1).unwrap_err();
        assert!(
            matches!(e, QuantError::HadamardGroupSize { got, max } if got == g && max == MAX_GROUP),
            "{e}"
        );
    }
    let h = Hadamard::new(64, 1).unwrap();
    let spec = QuantSpec::int4(128).unwrap();
    let mut b = vec![0u8; encoded_len(spec, 256)];
    let e = quantize_hadamard_to_wire(&[0.0f32; 256], spec, &h, 0, &Options::default(), &mut b).unwrap_err();
    assert!(e.to_string().contains("(64 elements) differ from the quantization groups (128)"), "{e}");
    let spec = QuantSpec::int4(64).unwrap();
    let mut b = vec![0u8; encoded_len(spec, 256)];
    let mut x = vec![0.5f32; 256];
    x[130] = f32::NAN;
    let e = quantize_hadamard_to_wire(&x, spec, &h, 0, &Options::default(), &mut b).unwrap_err();
    assert!(matches!(e, QuantError::NonFinite { index: 130, .. }), "{e}");
}

/// Inputs of many tiles, split over threads: the fused quantizer and
/// dequantizer key every tile and every thread's part by its own position.
#[test]
fn many_tiles_and_threads_equal_the_composed_form() {
    let n = 300_000 + 37;
    let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 300.0).collect();
    for g in [64usize, 8192] {
        let spec = QuantSpec::int4(g).unwrap();
        let h = Hadamard::for_spec(&spec, 5).unwrap();
        let o = Options::default();
        let mut fused = vec![0u8; encoded_len(spec, n)];
        quantize_hadamard_to_wire(&x, spec, &h, 12_345, &o, &mut fused).unwrap();
        let mut rot = x.clone();
        h.forward(&mut rot, 12_345, &o.single_thread()).unwrap();
        let mut composed = vec![0u8; fused.len()];
        quantize_to_wire(&rot, spec, &o, &mut composed).unwrap();
        assert!(fused == composed, "group {g}: fused bytes differ");
        let q = QuantizedRef::from_bytes(&fused).unwrap();
        let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
        dequantize_hadamard_into(&q, &mut a, &h, 12_345, &o).unwrap();
        dequantize_into(&q, &mut b, &o.single_thread()).unwrap();
        h.inverse(&mut b, 12_345, &o.single_thread()).unwrap();
        assert!(
            a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()),
            "group {g}: dequantized bits differ"
        );
    }
}
