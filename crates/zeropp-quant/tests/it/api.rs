//! API behaviour: errors, element types, buffer variants, edge cases.

use zeropp_quant::half::{bf16, f16};
use zeropp_quant::{
    Bits, Options, QuantError, QuantSpec, Quantized, QuantizedRef, Scheme, dequant_reduce_quant,
    dequant_reduce_quant_into, dequant_reduce_quant_to_wire, dequantize, dequantize_add, dequantize_into,
    encoded_len, quantize, quantize_into, quantize_to_wire,
};

fn o() -> Options {
    Options::default()
}

#[test]
fn bad_specs() {
    assert_eq!(QuantSpec::int8(0), Err(QuantError::ZeroGroupSize));
    assert_eq!(Bits::from_bits(2), Err(QuantError::UnsupportedBits(2)));
    assert!(QuantSpec::new(Bits::Int8, Scheme::Symmetric, usize::MAX).is_err());
    assert!("nope".parse::<Scheme>().is_err());
    assert!(QuantError::ZeroGroupSize.to_string().contains("group size 0"));
}

#[test]
fn non_finite_names_first_index() {
    for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
        for gs in [1, 3, 64, 10_000, 20_000] {
            let spec = QuantSpec::new(Bits::Int8, scheme, gs).unwrap();
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = vec![0.5f32; 300_000];
                x[123_457] = bad;
                x[200_000] = f32::NAN;
                for opts in [o(), o().single_thread()] {
                    let err = quantize(&x, spec, &opts).unwrap_err();
                    assert!(
                        matches!(err, QuantError::NonFinite { index: 123_457, .. }),
                        "{scheme:?} gs={gs}: {err}"
                    );
                    let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                    let err = quantize(&b, spec, &opts).unwrap_err();
                    assert!(matches!(err, QuantError::NonFinite { index: 123_457, .. }), "{err}");
                }
            }
        }
    }
    let err = quantize(&[1.0f32, 2.0, f32::NAN], QuantSpec::int4(2).unwrap(), &o()).unwrap_err();
    assert_eq!(err.to_string(), "non-finite input value NaN at index 2");
}

#[test]
fn reduce_overflow_is_an_error() {
    let spec = QuantSpec::int8(4).unwrap();
    let a = quantize(&[f32::MAX, 1.0, 0.0, 0.0, 3.0e38], spec, &o()).unwrap();
    let err = dequant_reduce_quant(&[&a, &a], spec, &o()).unwrap_err();
    assert!(matches!(err, QuantError::NonFinite { index: 0, .. }), "{err}");
}

#[test]
fn empty_and_tiny() {
    for spec in [QuantSpec::int8(1).unwrap(), QuantSpec::int4(7).unwrap()] {
        let q = quantize::<f32>(&[], spec, &o()).unwrap();
        assert!(q.is_empty());
        assert_eq!(q.num_groups(), 0);
        assert_eq!(dequantize(&q, &o()).unwrap(), Vec::<f32>::new());
        assert_eq!(q.to_bytes().len(), 32);
        let r = dequant_reduce_quant(&[&q], spec, &o()).unwrap();
        assert!(r.is_empty());
        let q = quantize(&[-3.0f32], spec, &o()).unwrap();
        assert_eq!(dequantize(&q, &o()).unwrap(), vec![-3.0]);
    }
    // All-zero group: s = 1, scale = 1, q = 0.
    let q = quantize(&[0.0f32; 5], QuantSpec::int8(2).unwrap(), &o()).unwrap();
    assert_eq!(q.scales(), &[1.0, 1.0, 1.0]);
    assert!(q.data().iter().all(|&b| b == 0));
    // Constant asymmetric group reproduces the constant.
    let spec = QuantSpec::new(Bits::Int4, Scheme::Asymmetric, 4).unwrap();
    let q = quantize(&[0.3f32; 7], spec, &o()).unwrap();
    assert_eq!(dequantize(&q, &o()).unwrap(), vec![0.3f32; 7]);
}

#[test]
fn extreme_magnitudes_stay_finite() {
    for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
        let spec = QuantSpec::new(Bits::Int8, scheme, 4).unwrap();
        let tiny = [1e-45f32, -1e-44, 0.0, 3e-45];
        let q = quantize(&tiny, spec, &o()).unwrap();
        assert!(q.scales().iter().all(|s| s.is_finite() && *s > 0.0));
        let y = dequantize(&q, &o()).unwrap();
        for (a, b) in tiny.iter().zip(&y) {
            assert!((a - b).abs() <= 2e-44, "{a} {b}");
        }
        let huge = [3e38f32, -3e38, 1.0, 2e38];
        let q = quantize(&huge, spec, &o()).unwrap();
        assert!(q.scales().iter().all(|s| s.is_finite() && *s > 0.0));
        assert!(QuantizedRef::from_bytes(&q.to_bytes()).is_ok());
    }
}

#[test]
fn int4_packing_layout() {
    // Symmetric INT4, one group with amax 8: s = 1, q = x (8 clips to 7).
    let x = [8.0f32, -8.0, 1.0, -1.0, 3.0];
    let q = quantize(&x, QuantSpec::int4(5).unwrap(), &o()).unwrap();
    assert_eq!(q.data(), &[0x78, 0x1F, 0x30]);
    assert_eq!((q.q(0), q.q(1), q.q(4), q.q(5)), (Some(7), Some(-8), Some(3), None));
}

#[test]
fn half_types_in_and_out() {
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.01).sin() * 4.0).collect();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    let spec = QuantSpec::int8(64).unwrap();
    // bf16 input quantizes exactly like its f32 widening.
    let wide: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    assert_eq!(quantize(&xb, spec, &o()).unwrap(), quantize(&wide, spec, &o()).unwrap());
    let wide: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
    let q = quantize(&xh, spec, &o()).unwrap();
    assert_eq!(q, quantize(&wide, spec, &o()).unwrap());
    let y32 = dequantize(&q, &o()).unwrap();
    let mut yb = vec![bf16::ZERO; 1000];
    dequantize_into(&q, &mut yb, &o()).unwrap();
    let mut yh = vec![f16::ZERO; 1000];
    dequantize_into(&q, &mut yh, &o()).unwrap();
    for i in 0..1000 {
        assert_eq!(yb[i], bf16::from_f32(y32[i]));
        assert_eq!(yh[i], f16::from_f32(y32[i]));
    }
    // Large groups (> one tile) through the converting path.
    let big: Vec<bf16> = (0..50_001).map(|i| bf16::from_f32((i % 777) as f32 - 300.0)).collect();
    let wide: Vec<f32> = big.iter().map(|v| v.to_f32()).collect();
    let spec = QuantSpec::new(Bits::Int4, Scheme::Asymmetric, 20_001).unwrap();
    assert_eq!(quantize(&big, spec, &o()).unwrap(), quantize(&wide, spec, &o()).unwrap());
    let q = quantize(&wide, spec, &o()).unwrap();
    let mut yb = vec![bf16::ZERO; big.len()];
    dequantize_into(&q, &mut yb, &o()).unwrap();
    let y = dequantize(&q, &o()).unwrap();
    assert!(yb.iter().zip(&y).all(|(a, b)| *a == bf16::from_f32(*b)));
}

#[test]
fn into_variants_and_length_errors() {
    let x: Vec<f32> = (0..777).map(|i| i as f32 - 300.0).collect();
    let spec = QuantSpec::new(Bits::Int4, Scheme::Asymmetric, 33).unwrap();
    let q = quantize(&x, spec, &o()).unwrap();
    let mut dst = Quantized::zeroed(spec, 777).unwrap();
    quantize_into(&x, &o(), &mut dst).unwrap();
    assert_eq!(dst, q);
    let mut wrong = Quantized::zeroed(spec, 776).unwrap();
    assert!(matches!(quantize_into(&x, &o(), &mut wrong), Err(QuantError::LengthMismatch { .. })));
    let mut buf = vec![0u8; encoded_len(spec, 777)];
    assert_eq!(quantize_to_wire(&x, spec, &o(), &mut buf).unwrap(), buf.len());
    assert_eq!(buf, q.to_bytes());
    let mut small = vec![0u8; buf.len() - 1];
    assert!(matches!(quantize_to_wire(&x, spec, &o(), &mut small), Err(QuantError::BufferTooSmall { .. })));
    let mut out = vec![0f32; 776];
    assert!(dequantize_into(&q, &mut out, &o()).is_err());
    assert!(dequantize_add(&q, &mut out, &o()).is_err());
    let mut acc = vec![1.0f32; 777];
    dequantize_add(&q, &mut acc, &o()).unwrap();
    let y = dequantize(&q, &o()).unwrap();
    assert!(acc.iter().zip(&y).all(|(a, b)| *a == 1.0 + b));
    // Fused kernel variants agree; lengths are checked.
    let out_spec = QuantSpec::int8(100).unwrap();
    let r = dequant_reduce_quant(&[&q, &q], out_spec, &o()).unwrap();
    let mut r2 = Quantized::zeroed(out_spec, 777).unwrap();
    dequant_reduce_quant_into(&[&q, &q], &o(), &mut r2).unwrap();
    assert_eq!(r, r2);
    let mut wbuf = vec![0u8; encoded_len(out_spec, 777)];
    dequant_reduce_quant_to_wire(&[&q, &q], out_spec, &o(), &mut wbuf).unwrap();
    assert_eq!(wbuf, r.to_bytes());
    let short = quantize(&x[..10], spec, &o()).unwrap();
    assert!(matches!(
        dequant_reduce_quant(&[&q, &short], out_spec, &o()),
        Err(QuantError::LengthMismatch { .. })
    ));
    assert_eq!(dequant_reduce_quant::<&Quantized>(&[], out_spec, &o()).unwrap_err(), QuantError::NoInputs);
}
