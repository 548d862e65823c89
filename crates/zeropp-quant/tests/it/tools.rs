//! The `tools` helpers (cargo feature `tools`, which the self dev-dependency
//! in the manifest turns on for the tests and the bench).

use zeropp_quant::tools::{ErrorStats, error_stats, f32_from_le_bytes, random_normalish, round_trip};
use zeropp_quant::{Options, QuantError, QuantSpec, encoded_len};

#[test]
fn random_normalish_is_seeded_and_standardised() {
    let x = random_normalish(100_000, 3);
    assert_eq!(x, random_normalish(100_000, 3));
    assert_ne!(x, random_normalish(100_000, 4));
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
    assert!(mean.abs() < 0.02, "mean {mean}");
    assert!((var - 1.0).abs() < 0.05, "variance {var}");
    // A sum of four uniforms, rescaled: bounded by 2 * sqrt(3).
    assert!(x.iter().all(|v| v.abs() <= 2.0 * 3.0f32.sqrt()));
}

#[test]
fn raw_f32_parsing() {
    let x = [1.5f32, -0.0, f32::MAX, 3.25e-20];
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let y = f32_from_le_bytes(&bytes).unwrap();
    assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), x.map(f32::to_bits));
    assert!(f32_from_le_bytes(&[]).unwrap().is_empty());
    assert!(matches!(f32_from_le_bytes(&bytes[..7]), Err(QuantError::LengthMismatch { actual: 7, .. })));
}

#[test]
fn error_statistics() {
    let s = error_stats(&[1.0, 2.0, -3.0], &[1.0, 2.5, -2.0]).unwrap();
    assert_eq!(s, ErrorStats { max_abs: 1.0, mean_abs: 0.5 });
    assert_eq!(error_stats(&[], &[]).unwrap(), ErrorStats::default());
    assert!(matches!(error_stats(&[1.0], &[]), Err(QuantError::LengthMismatch { .. })));
}

#[test]
fn wire_round_trip() {
    let x = random_normalish(10_000, 1);
    let spec = QuantSpec::int8(256).unwrap();
    let rt = round_trip(&x, spec, &Options::default()).unwrap();
    assert_eq!(rt.wire.len(), encoded_len(spec, x.len()));
    assert_eq!(rt.reconstructed.len(), x.len());
    assert_eq!(rt.errors, error_stats(&x, &rt.reconstructed).unwrap());
    // INT8, symmetric: within one step of the largest group's scale.
    assert!(rt.errors.max_abs <= f64::from(2.0 * 3.0f32.sqrt()) / 128.0 + 1e-6);
    assert!((rt.compression_ratio - (x.len() * 4) as f64 / rt.wire.len() as f64).abs() < 1e-12);
    assert!(rt.quantize_gbps() >= 0.0 && rt.dequantize_gbps() >= 0.0);
}
