//! Writes reference vectors of the kernels for the Python bindings' test
//! (`python/tests/test_kernels.py`, run by `cargo xtask test-torch`): inputs, the
//! wire encodings this crate produces, their dequantization, and fused reductions.
//! The Python side must reproduce every byte.
//!
//! `cargo run --release -p zeropp-quant --example golden_vectors -- DIR`

use std::error::Error;
use std::path::Path;

use serde_json::json;
use zeropp_quant::half::bf16;
use zeropp_quant::rng::splitmix64;
use zeropp_quant::{
    Bits, Options, QuantSpec, QuantizedRef, Scheme, dequant_reduce_quant_to_wire, dequantize_into,
    encoded_len, quantize_to_wire,
};

/// A test input: magnitudes that change every 37 elements, exact zeros, and an
/// all-zero stretch (a group whose scale falls back to 1).
fn input(n: usize, salt: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = splitmix64(salt.wrapping_mul(0x9E37) ^ i as u64);
            let u = (h >> 40) as f32 / (1u64 << 24) as f32;
            let mag = 10f32.powi(((i / 37) % 5) as i32 - 2);
            if h.is_multiple_of(29) || (n > 600 && (300..340).contains(&i)) {
                0.0
            } else {
                (2.0 * u - 1.0) * mag
            }
        })
        .collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::write(dir.join(name), bytes)
}

fn main() -> Result<(), Box<dyn Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: golden_vectors DIR")?;
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir)?;
    let mut cases = Vec::new();
    let mut k = 0u64;
    for bits in [Bits::Int4, Bits::Int8] {
        for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
            for (n, gs) in [(1usize, 1usize), (7, 3), (255, 64), (1001, 256), (4097, 128)] {
                for seed in [None, Some(42u64)] {
                    for dtype in ["float32", "bfloat16"] {
                        k += 1;
                        let spec = QuantSpec::new(bits, scheme, gs)?;
                        let opts = seed.map_or(Options::default(), |s| Options::default().stochastic(s));
                        let x = input(n, k);
                        let mut wire = vec![0u8; encoded_len(spec, n)];
                        let in_bytes: Vec<u8> = if dtype == "float32" {
                            quantize_to_wire(&x, spec, &opts, &mut wire)?;
                            bytemuck_f32(&x)
                        } else {
                            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                            quantize_to_wire(&xb, spec, &opts, &mut wire)?;
                            xb.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()
                        };
                        let mut deq = vec![0f32; n];
                        dequantize_into(&QuantizedRef::from_bytes(&wire)?, &mut deq, &Options::default())?;
                        let name = format!("q{k}");
                        write(dir, &format!("{name}.in"), &in_bytes)?;
                        write(dir, &format!("{name}.wire"), &wire)?;
                        write(dir, &format!("{name}.deq"), &bytemuck_f32(&deq))?;
                        cases.push(json!({
                            "name": name, "op": "quantize", "dtype": dtype, "bits": bits.bits(),
                            "symmetric": scheme == Scheme::Symmetric, "group_size": gs, "n": n, "seed": seed,
                        }));
                    }
                }
            }
        }
    }
    // The fused kernel: three inputs of mixed specs, reduced into INT4 and INT8.
    for (n, bits, seed) in
        [(1001usize, Bits::Int4, None), (999, Bits::Int8, Some(7u64)), (4097, Bits::Int4, Some(9))]
    {
        k += 1;
        let specs = [
            QuantSpec::int4(256)?,
            QuantSpec::int8(256)?,
            QuantSpec::new(Bits::Int4, Scheme::Asymmetric, 64)?,
        ];
        let mut wires = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let mut w = vec![0u8; encoded_len(*spec, n)];
            quantize_to_wire(&input(n, k * 10 + i as u64), *spec, &Options::default(), &mut w)?;
            write(dir, &format!("r{k}.in{i}"), &w)?;
            wires.push(w);
        }
        let views = wires.iter().map(|w| QuantizedRef::from_bytes(w)).collect::<Result<Vec<_>, _>>()?;
        let out_spec = QuantSpec::new(bits, Scheme::Symmetric, 256)?;
        let opts = seed.map_or(Options::default(), |s| Options::default().stochastic(s));
        let mut out = vec![0u8; encoded_len(out_spec, n)];
        dequant_reduce_quant_to_wire(&views, out_spec, &opts, &mut out)?;
        let name = format!("r{k}");
        write(dir, &format!("{name}.wire"), &out)?;
        cases.push(json!({
            "name": name, "op": "reduce", "inputs": specs.len(), "bits": bits.bits(), "symmetric": true,
            "group_size": 256, "n": n, "seed": seed,
        }));
    }
    std::fs::write(dir.join("manifest.json"), serde_json::to_string_pretty(&json!({ "cases": cases }))?)?;
    println!("golden_vectors: {} cases in {}", cases.len(), dir.display());
    Ok(())
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
