//! Helpers behind the `zeropp quant` command: test data, raw f32 files,
//! error statistics and a timed round trip through the wire format.
//!
//! Only with the cargo feature `tools` (off by default): these are for the
//! command line, the benches and the tests, not part of the quantization API.

use crate::error::{QuantError, Result};
use crate::ops::{dequantize_into, quantize_to_wire};
use crate::quantized::QuantizedRef;
use crate::rng::splitmix64;
use crate::spec::{Options, QuantSpec};
use crate::wire::encoded_len;
use std::time::Instant;

/// `n` deterministic pseudo-random, roughly normal values (mean 0, standard
/// deviation 1: a sum of four uniforms, rescaled) for seed `seed`.
pub fn random_normalish(n: usize, seed: u64) -> Vec<f32> {
    let base = splitmix64(seed);
    (0..n as u64)
        .map(|i| {
            let h = splitmix64(base ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let u = (0..4).map(|k| ((h >> (16 * k)) & 0xFFFF) as f32 / 65536.0);
            // Sum of 4 U(0,1): mean 2, variance 4/12.
            (u.sum::<f32>() - 2.0) * 3.0f32.sqrt()
        })
        .collect()
}

/// Parses a raw little-endian f32 file. Errors if the length is not a
/// multiple of 4.
pub fn f32_from_le_bytes(bytes: &[u8]) -> Result<Vec<f32>> {
    if bytes.len() & 3 != 0 {
        return Err(QuantError::LengthMismatch {
            what: "raw f32 input (bytes, must be a multiple of 4)",
            expected: bytes.len() - bytes.len() % 4,
            actual: bytes.len(),
        });
    }
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Absolute error statistics of a reconstruction.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ErrorStats {
    /// Largest `|x - x̂|`.
    pub max_abs: f64,
    /// Mean `|x - x̂|` (0 for empty inputs).
    pub mean_abs: f64,
}

/// Error statistics of `approx` against `exact` (equal lengths).
pub fn error_stats(exact: &[f32], approx: &[f32]) -> Result<ErrorStats> {
    if exact.len() != approx.len() {
        return Err(QuantError::LengthMismatch {
            what: "error_stats",
            expected: exact.len(),
            actual: approx.len(),
        });
    }
    let mut max_abs = 0f64;
    let mut sum = 0f64;
    for (&a, &b) in exact.iter().zip(approx) {
        let e = (f64::from(a) - f64::from(b)).abs();
        max_abs = max_abs.max(e);
        sum += e;
    }
    let mean_abs = if exact.is_empty() { 0.0 } else { sum / exact.len() as f64 };
    Ok(ErrorStats { max_abs, mean_abs })
}

/// Result of [`round_trip`].
#[derive(Debug, Clone)]
pub struct RoundTrip {
    /// The wire encoding.
    pub wire: Vec<u8>,
    /// The dequantized values.
    pub reconstructed: Vec<f32>,
    /// Reconstruction error.
    pub errors: ErrorStats,
    /// Input bytes divided by wire bytes.
    pub compression_ratio: f64,
    /// Seconds spent quantizing into the wire buffer.
    pub quantize_secs: f64,
    /// Seconds spent decoding and dequantizing.
    pub dequantize_secs: f64,
}

impl RoundTrip {
    /// Quantize throughput in GB/s of f32 input (0 if too fast to time).
    pub fn quantize_gbps(&self) -> f64 {
        gbps(self.reconstructed.len() * 4, self.quantize_secs)
    }

    /// Dequantize throughput in GB/s of f32 output (0 if too fast to time).
    pub fn dequantize_gbps(&self) -> f64 {
        gbps(self.reconstructed.len() * 4, self.dequantize_secs)
    }
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 }
}

/// Quantizes `input` to the wire format, decodes it zero-copy, dequantizes,
/// and measures error, compression and time.
pub fn round_trip(input: &[f32], spec: QuantSpec, opts: &Options) -> Result<RoundTrip> {
    let mut wire = vec![0u8; encoded_len(spec, input.len())];
    let t0 = Instant::now();
    let n = quantize_to_wire(input, spec, opts, &mut wire)?;
    let quantize_secs = t0.elapsed().as_secs_f64();
    wire.truncate(n);
    let mut reconstructed = vec![0f32; input.len()];
    let t1 = Instant::now();
    let view = QuantizedRef::from_bytes(&wire)?;
    dequantize_into(&view, &mut reconstructed, opts)?;
    let dequantize_secs = t1.elapsed().as_secs_f64();
    let errors = error_stats(input, &reconstructed)?;
    let compression_ratio = (input.len() * 4) as f64 / wire.len() as f64;
    Ok(RoundTrip { wire, reconstructed, errors, compression_ratio, quantize_secs, dequantize_secs })
}
