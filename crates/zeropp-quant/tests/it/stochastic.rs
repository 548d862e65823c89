//! Stochastic rounding: unbiasedness (statistical, with a stated bound) and
//! determinism.

use zeropp_quant::{Bits, Options, QuantSpec, Rounding, Scheme, dequantize, quantize};

const TRIALS: usize = 4000;

/// Per-element values in (-1, 1) and a group max of exactly 1, so
/// s = 2^(b-1) and scale = 2^(1-b) are exact and x·s is computed exactly.
fn input() -> Vec<f32> {
    let mut x = vec![1.0f32];
    let mut st = 12345u64;
    for _ in 0..63 {
        st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        x.push(((st >> 40) as f32 / 16_777_216.0) * 1.7 - 0.85);
    }
    x
}

/// Mean of `TRIALS` seeded dequantizations per element.
fn means(bits: Bits, scheme: Scheme, rounding: impl Fn(u64) -> Rounding) -> (Vec<f64>, f64) {
    let x = input();
    let spec = QuantSpec::new(bits, scheme, x.len()).unwrap();
    let mut sum = vec![0f64; x.len()];
    let mut scale = 0.0;
    for t in 0..TRIALS as u64 {
        let o = Options::default().with_rounding(rounding(t));
        let q = quantize(&x, spec, &o).unwrap();
        scale = f64::from(q.scales()[0]);
        for (s, y) in sum.iter_mut().zip(dequantize(&q, &o).unwrap()) {
            *s += f64::from(y);
        }
    }
    (sum.iter().map(|s| s / TRIALS as f64).collect(), scale)
}

/// Each x̂ is one of two adjacent grid points `scale` apart, so by
/// Hoeffding's inequality the mean of N independent trials deviates from
/// its expectation by t with probability at most 2·exp(-2·N·t²/scale²).
/// With t = 3·scale/√N that is 2·e^-18 ≈ 3.0e-8 per element; over the 63
/// tested elements and 2 configurations the false-failure probability is
/// below 4e-6. (Bias from the 24-bit uniform is at most 2^-24·scale.)
#[test]
fn stochastic_rounding_is_unbiased() {
    let x = input();
    for (bits, scheme) in [(Bits::Int8, Scheme::Symmetric), (Bits::Int4, Scheme::Symmetric)] {
        let (m, scale) = means(bits, scheme, |t| Rounding::Stochastic { seed: t });
        let tol = 3.0 * scale / (TRIALS as f64).sqrt();
        // Element 0 is the group max (clipped); the rest are unclipped.
        for i in 1..x.len() {
            let err = (m[i] - f64::from(x[i])).abs();
            assert!(
                err <= tol,
                "{bits:?} element {i}: mean {} vs x {} (|d| = {err:e} > {tol:e})",
                m[i],
                x[i]
            );
        }
    }
}

/// The test above has power: nearest rounding (deterministic, biased per
/// element) fails it for most elements.
#[test]
fn unbiasedness_test_detects_bias() {
    let x = input();
    let (m, scale) = means(Bits::Int4, Scheme::Symmetric, |_| Rounding::NearestEven);
    let tol = 3.0 * scale / (TRIALS as f64).sqrt();
    let failing = (1..x.len()).filter(|&i| (m[i] - f64::from(x[i])).abs() > tol).count();
    assert!(failing > x.len() / 2, "only {failing} elements detected");
}

#[test]
fn stochastic_is_deterministic_per_seed() {
    let x: Vec<f32> = (0..100_000).map(|i| ((i * 7919) % 1000) as f32 / 333.0 - 1.5).collect();
    let spec = QuantSpec::int4(129).unwrap();
    let a = quantize(&x, spec, &Options::default().stochastic(5)).unwrap();
    let b = quantize(&x, spec, &Options::default().stochastic(5).single_thread()).unwrap();
    let c = quantize(&x, spec, &Options::default().stochastic(6)).unwrap();
    let n = quantize(&x, spec, &Options::default()).unwrap();
    assert_eq!(a, b);
    assert_ne!(a.data(), c.data());
    assert_ne!(a.data(), n.data());
    assert_eq!(a.scales(), n.scales());
}
