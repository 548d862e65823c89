//! Property tests against the independent reference in `common`.

use crate::common::*;
use proptest::prelude::*;
use zeropp_quant::{
    Bits, Kernel, Options, QuantSpec, Quantized, Rounding, Scheme, available_kernels, dequant_reduce_quant,
    dequantize, dequantize_add, quantize,
};

const EPS: f64 = 1.0 / (1u64 << 24) as f64; // f32 unit roundoff

fn spec(bits: u32, asym: bool, gs: usize) -> QuantSpec {
    let b = Bits::from_bits(bits).unwrap();
    let s = if asym { Scheme::Asymmetric } else { Scheme::Symmetric };
    QuantSpec::new(b, s, gs).unwrap()
}

fn single() -> Options {
    Options::default().single_thread()
}

/// Checks |x - x̂| against the bound: half a step (one step where the exact
/// value lies beyond the clipping point, or with stochastic rounding), plus
/// slack for the f32 roundings in `(x - offset) * s`, `1/s`, `q * scale` and
/// `+ offset`: each is at most EPS relative to a magnitude bounded by
/// `|x| + |offset| + 2^(b-1) * scale`, and 4 of them are covered by 4x that.
fn check_bound(x: &[f32], q: &Quantized, y: &[f32], stochastic: bool) -> Result<(), String> {
    let spec = q.spec();
    let gs = spec.group_size();
    let qmax = f64::from(spec.bits().qmax());
    let qmin = f64::from(spec.bits().qmin());
    for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
        let g = i / gs;
        let scale = f64::from(q.scales()[g]);
        let off = q.offsets().map_or(0.0, |o| f64::from(o[g]));
        let exact = (f64::from(a) - off) / scale;
        let clipped = exact > qmax + 0.5 || exact < qmin - 0.5;
        let step = if stochastic || clipped { 1.0 } else { 0.5 };
        let slack = 4.0 * EPS * (f64::from(a).abs() + off.abs() + (qmax + 1.0) * scale);
        let err = (f64::from(a) - f64::from(b)).abs();
        if err > step * scale + slack {
            return Err(format!(
                "element {i}: x={a:e} x̂={b:e} err={err:e} > {step}*scale({scale:e}) + {slack:e}"
            ));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    /// Error bound for both widths, both schemes, both roundings.
    #[test]
    fn error_bound(x in vector(), gs in group_size(), bits in prop_oneof![Just(4u32), Just(8)],
                   asym: bool, seed in proptest::option::of(any::<u64>())) {
        let mut o = single();
        if let Some(s) = seed {
            o = o.stochastic(s);
        }
        let q = quantize(&x, spec(bits, asym, gs), &o).unwrap();
        let y = dequantize(&q, &o).unwrap();
        prop_assert_eq!(y.len(), x.len());
        check_bound(&x, &q, &y, seed.is_some()).map_err(TestCaseError::fail)?;
    }

    /// Nearest-even results equal the naive reference bit for bit (bytes,
    /// scales; offsets numerically: the crate maps -0.0 offsets to +0.0).
    #[test]
    fn matches_reference(x in vector(), gs in group_size(), bits in prop_oneof![Just(4u32), Just(8)], asym: bool) {
        let q = quantize(&x, spec(bits, asym, gs), &single()).unwrap();
        let r = ref_quantize(&x, bits, asym, gs);
        prop_assert_eq!(q.data(), &ref_pack(&r.q, bits)[..]);
        let sb: Vec<u32> = q.scales().iter().map(|v| v.to_bits()).collect();
        let rb: Vec<u32> = r.scales.iter().map(|v| v.to_bits()).collect();
        prop_assert_eq!(sb, rb);
        if asym {
            prop_assert_eq!(q.offsets().unwrap(), &r.offsets[..]);
        }
        for i in 0..x.len() {
            prop_assert_eq!(q.q(i), Some(r.q[i]));
        }
        let y = dequantize(&q, &single()).unwrap();
        prop_assert_eq!(y, ref_dequant(&r, gs));
    }

    /// Integers times a power of two are reproduced exactly (symmetric:
    /// every element; asymmetric: every element but the clipped maximum).
    #[test]
    fn exact_for_representable(len in 1usize..400, gs in 1usize..70, e in -30i32..30,
                               shift in -50i32..50, seed: u64, bits in prop_oneof![Just(4u32), Just(8)]) {
        let c = 2f32.powi(e);
        let half = 1i32 << (bits - 1);
        let mut st = seed | 1;
        let ks: Vec<i32> = (0..len).map(|i| {
            st ^= st << 13; st ^= st >> 7; st ^= st << 17;
            if i % gs == 0 { -half } else { (st % (2 * half as u64)) as i32 - half }
        }).collect();
        // Symmetric: each group's amax is exactly 2^(b-1) * c.
        let x: Vec<f32> = ks.iter().map(|&k| k as f32 * c).collect();
        let q = quantize(&x, spec(bits, false, gs), &single()).unwrap();
        prop_assert_eq!(dequantize(&q, &single()).unwrap(), x.clone());
        // Asymmetric: groups spanning [o - 2^(b-1) c, o + 2^(b-1) c].
        let x: Vec<f32> = ks.iter().enumerate().map(|(i, &k)| {
            let k = if i % gs == 1 { half } else { k };
            (k + shift) as f32 * c
        }).collect();
        let q = quantize(&x, spec(bits, true, gs), &single()).unwrap();
        let y = dequantize(&q, &single()).unwrap();
        for (i, grp) in x.chunks(gs).enumerate() {
            let mx = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let full_range = grp.len() > 1;
            for (j, &v) in grp.iter().enumerate() {
                let got = y[i * gs + j];
                if full_range && v == mx {
                    prop_assert_eq!(got, v - c); // clipped by one step
                } else {
                    prop_assert_eq!(got, v);
                }
            }
        }
    }

    /// Every kernel equals the scalar reference bit for bit, for quantize
    /// (both roundings), dequantize, dequantize_add and the fused kernel.
    #[test]
    fn kernels_bit_exact(x in vector(), gs in group_size(), bits in prop_oneof![Just(4u32), Just(8)],
                         asym: bool, seed in proptest::option::of(any::<u64>())) {
        let sp = spec(bits, asym, gs);
        let base = single().with_kernel(Kernel::Scalar);
        let base = match seed { Some(s) => base.stochastic(s), None => base };
        let q0 = quantize(&x, sp, &base).unwrap();
        let y0 = dequantize(&q0, &base).unwrap();
        let mut acc0: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
        dequantize_add(&q0, &mut acc0, &base).unwrap();
        let q1 = quantize(&x.iter().map(|v| -v).collect::<Vec<_>>(), sp, &base).unwrap();
        let r0 = dequant_reduce_quant(&[&q0, &q1, &q0], spec(12 - bits, !asym, gs + 1), &base).unwrap();
        for k in available_kernels() {
            let o = base.with_kernel(k);
            let q = quantize(&x, sp, &o).unwrap();
            prop_assert_eq!(q.to_bytes(), q0.to_bytes(), "kernel {}", k);
            let y = dequantize(&q0, &o).unwrap();
            prop_assert_eq!(bits_of(&y), bits_of(&y0), "kernel {}", k);
            let mut acc: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
            dequantize_add(&q0, &mut acc, &o).unwrap();
            prop_assert_eq!(bits_of(&acc), bits_of(&acc0), "kernel {}", k);
            let r = dequant_reduce_quant(&[&q0, &q1, &q0], spec(12 - bits, !asym, gs + 1), &o).unwrap();
            prop_assert_eq!(r.to_bytes(), r0.to_bytes(), "kernel {}", k);
        }
    }

    /// The fused kernel equals dequantize -> sum in f64 -> quantize within
    /// the bound (one output step + f32 summation slack), and equals the
    /// unfused f32 composition bit for bit.
    #[test]
    fn reduce_matches_reference(len in 0usize..2500, k in 1usize..6, gs_in in group_size(),
                                gs_out in group_size(), bits_in in prop_oneof![Just(4u32), Just(8)],
                                bits_out in prop_oneof![Just(4u32), Just(8)], asym: bool, seed: u64) {
        let inputs: Vec<Quantized> = (0..k).map(|j| {
            let x = values_direct(len, seed.wrapping_add(j as u64));
            quantize(&x, spec(bits_in, asym, gs_in), &single()).unwrap()
        }).collect();
        let out_spec = spec(bits_out, !asym, gs_out);
        let r = dequant_reduce_quant(&inputs, out_spec, &Options::default()).unwrap();
        let deq: Vec<Vec<f32>> = inputs.iter().map(|q| dequantize(q, &single()).unwrap()).collect();
        // f64 reference sum.
        let sum64: Vec<f64> = (0..len).map(|i| deq.iter().map(|d| f64::from(d[i])).sum()).collect();
        let abs_sum: Vec<f64> = (0..len).map(|i| deq.iter().map(|d| f64::from(d[i]).abs()).sum()).collect();
        let y = dequantize(&r, &single()).unwrap();
        for i in 0..len {
            let g = i / gs_out;
            let scale = f64::from(r.scales()[g]);
            let off = r.offsets().map_or(0.0, |o| f64::from(o[g]));
            let slack = (k as f64 + 4.0) * EPS * (abs_sum[i] + off.abs() + 256.0 * scale);
            let err = (sum64[i] - f64::from(y[i])).abs();
            prop_assert!(err <= scale + slack, "i={} err={} scale={}", i, err, scale);
        }
        // Unfused composition in f32, same summation order.
        let mut sum32 = vec![0f32; len];
        for q in &inputs {
            dequantize_add(q, &mut sum32, &single()).unwrap();
        }
        let unfused = quantize(&sum32, out_spec, &single()).unwrap();
        prop_assert_eq!(r.to_bytes(), unfused.to_bytes());
    }
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Deterministic values without proptest (for the reduce inputs).
fn values_direct(len: usize, seed: u64) -> Vec<f32> {
    let mut st = seed ^ 0x5DEE_CE66;
    (0..len)
        .map(|_| {
            st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((st >> 40) as f32 / 16_777_216.0 - 0.5) * 8.0
        })
        .collect()
}

#[test]
fn avx512_status_reported() {
    if Kernel::Avx512.is_available() {
        println!("AVX-512 available: covered by kernels_bit_exact");
    } else {
        println!("AVX-512 not available on this CPU: its bit-exactness checks are skipped");
        let err =
            quantize(&[1.0f32], QuantSpec::int8(1).unwrap(), &Options::default().with_kernel(Kernel::Avx512))
                .unwrap_err();
        assert!(err.to_string().contains("avx512"), "{err}");
    }
    assert!(available_kernels().contains(&Kernel::Scalar));
}

/// Large inputs (parallel path) equal the single-threaded result, for odd
/// INT4 group sizes (chunks must split at even elements) and stochastic
/// rounding (the RNG must not depend on the split).
#[test]
fn parallel_equals_single_thread() {
    let x = values_direct(300_001, 3);
    for (bits, gs) in [(4, 7), (4, 2048), (8, 1), (8, 33), (4, 70_001)] {
        for rounding in [Rounding::NearestEven, Rounding::Stochastic { seed: 9 }] {
            for asym in [false, true] {
                let sp = spec(bits, asym, gs);
                let a = quantize(&x, sp, &single().with_rounding(rounding)).unwrap();
                let b = quantize(&x, sp, &Options::default().with_rounding(rounding)).unwrap();
                assert_eq!(a, b, "bits={bits} gs={gs} {rounding:?} asym={asym}");
                let ya = dequantize(&a, &single()).unwrap();
                let yb = dequantize(&a, &Options::default()).unwrap();
                assert_eq!(bits_of(&ya), bits_of(&yb));
                let r1 = dequant_reduce_quant(&[&a, &b], sp, &single()).unwrap();
                let r2 = dequant_reduce_quant(&[&a, &b], sp, &Options::default()).unwrap();
                assert_eq!(r1, r2);
            }
        }
    }
}
